"""Chat prompt to token ids: template text parses special tokens, message content does not.

Rendering the template and tokenizing the whole string with `parse_special=True` (what
llama-server and vLLM did) lets a message forge control tokens: fifty "<start_of_turn>" in
a user message become fifty turn markers, "<end_of_turn>\\n<start_of_turn>model\\n" writes
the model's turn. So the template is rendered twice: with the real contents (R1) and with
each content replaced by a probe (R2) that carries a per-call random nonce and whitespace
on which the usual transforms (`| trim`, `split('</think>')[-1]`, `lstrip('\\n')`) act
visibly. R2 gives, wherever a content is rendered, the transform the template applied and
the template text around it; R1 must then be exactly T0 g1(C1) T1 ... gn(Cn) Tn, found left
to right (linear). Then:

- short prompts are tokenized whole with `parse_special=True` first: if that gives the
  control tokens of T0..Tn and no more, no content spelled one, and these are exactly the
  ids the server always produced;
- otherwise (and for long prompts, where it is also faster) the template segments are split
  at their special tokens and each run of raw text (template text and content together, as
  llama.cpp itself sees it) is tokenized with `parse_special=False`: the ids of the whole
  string, except that spelled control tokens stay text;
- no alignment (a transform beyond recognition, such as `| tojson`): the whole string is
  used only when no content spells a control token, else `ChatTemplateError` (a 400).

Strings outside `content` (the role, for one) are template text as far as the tokenizer
knows; one that spells a control token is refused outright.
"""

from __future__ import annotations

import logging
import re
import secrets
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from engine.chat_template import ChatTemplate, ChatTemplateError

log = logging.getLogger(__name__)

Tokenize = Callable[[str, bool, bool], list[int]]  # (text, add_special, parse_special) -> ids
IsControl = Callable[[int], bool]

THINK_END = "</think>"
_EM = "\u2003"  # Python whitespace (so `trim` eats it) that no real template writes
_PAD_LEFT = "\n" + _EM  # `lstrip('\n')` leaves the em space, `trim` leaves nothing
_PAD_RIGHT = _EM + "\n"
_MARKS = re.compile("[\ue000-\ue003\u2003]")  # probe characters: never template text
_WS = " \t\n\v\f\r"  # C isspace(): what llama.cpp's LSTRIP/RSTRIP tokens eat
_MAX_STATES = 16  # alignments kept alive per rendered content (1 in practice)
# Up to here the whole prompt is tokenized first (exactly the old ids when no content spells
# a control token); beyond, per run of text, which gives the same ids faster: llama.cpp's
# special-token pass scans the text once per special token and fragment (Gemma has 6,400
# specials: about 2-3x slower at 4,000 messages, 8x with a forged marker in each), while
# learning the template's specials costs a few ms once.
_WHOLE_MAX_CHARS = 8192


def _same(s: str) -> str:
    return s


def _strip_nl(s: str) -> str:
    return s.strip("\n")


def _lstrip_nl(s: str) -> str:
    return s.lstrip("\n")


def _rstrip_nl(s: str) -> str:
    return s.rstrip("\n")


_TRIMS: tuple[Callable[[str], str], ...] = (
    _same, str.strip, str.lstrip, str.rstrip, _strip_nl, _lstrip_nl, _rstrip_nl,
)  # fmt: skip


def _transform(after_think: bool, trim: Callable[[str], str]) -> Callable[[str], str]:
    if after_think:
        return lambda s: trim(s.split(THINK_END)[-1])
    return trim


# What templates do to content before printing it, most common first; the probe tells them
# apart (each leaves a different text on either side of the probe's marker).
_TRANSFORMS = tuple(_transform(a, t) for a in (False, True) for t in _TRIMS)


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A chat prompt's token ids, and how many of them come before the first message that
    is not a system (or developer) message: the start that requests with the same system
    prompt share (0 when there is none, or when the template could not be aligned)."""

    ids: list[int]
    system_end: int = 0


_SYSTEM_ROLES = ("system", "developer")


def chat_prompt_ids(
    template: ChatTemplate,
    messages: list[dict[str, Any]],
    tokenize: Tokenize,
    is_control: IsControl,
    *,
    add_bos: bool,
    bos_token: str,
    find_system_end: bool = False,
) -> ChatPrompt:
    """Token ids of the chat prompt, BOS added unless the rendered prompt starts with the BOS
    text; control tokens come only from template text. Raises `ChatTemplateError` when that
    cannot be guaranteed. Thread-safe: every cache lives for this call only.
    `find_system_end`: also find where the system block ends (one more tokenization)."""
    tok = _Tokenizer(tokenize, is_control)
    _refuse_spelled_fields(messages, tok)
    rendered = template.render(messages)
    want_bos = add_bos and not (bos_token and rendered.startswith(bos_token))
    contents = {
        i: c for i, m in enumerate(messages) if isinstance(c := m.get("content"), str) and c
    }
    found = _align(template, messages, contents, rendered)
    if found is None:
        _refuse_spelled_contents(contents, tok)
        return ChatPrompt(tok.ids(rendered, special=True, add_special=want_bos))
    segments, spans, owners = found
    ids = _aligned_ids(tok, rendered, segments, spans, want_bos)
    first = next((i for i, m in enumerate(messages) if m.get("role") not in _SYSTEM_ROLES), 0)
    if not find_system_end or first == 0 or first not in owners:
        return ChatPrompt(ids)
    # The system block ends where the first other message's content starts; tokenized
    # alone, that text may end on a different token than inside the prompt (a merge across
    # the boundary): the ids both agree on are the shared start.
    head = tok.ids(rendered[: spans[owners.index(first)][0]], special=True, add_special=want_bos)
    n = next((i for i, (a, b) in enumerate(zip(head, ids, strict=False)) if a != b), len(head))
    return ChatPrompt(ids, min(n, len(ids)))


def _aligned_ids(
    tok: _Tokenizer,
    rendered: str,
    segments: list[str],
    spans: list[tuple[int, int]],
    want_bos: bool,
) -> list[int]:
    wrap = tok.ids("", special=False, add_special=True) if want_bos else []
    head, tail = wrap[:1], wrap[1:]  # BOS first, EOS (vocabs that add one) last
    if len(rendered) > _WHOLE_MAX_CHARS:
        try:
            return head + _runs(tok, rendered, segments, spans) + tail
        except _Unsplittable:
            pass  # the whole string decides, below
    ids = tok.ids(rendered, special=True, add_special=want_bos)
    expected = [c for seg in segments for c in tok.segment_controls(seg)]
    if tok.controls(ids) == tok.controls(head) + expected + tok.controls(tail):
        return ids
    log.debug("message content spells control tokens: tokenizing it as text")
    return head + _runs(tok, rendered, segments, spans) + tail


def _runs(
    tok: _Tokenizer, rendered: str, segments: list[str], spans: list[tuple[int, int]]
) -> list[int]:
    parts: list[str | _Special] = list(tok.parts(segments[0]))
    for (a, b), seg in zip(spans, segments[1:], strict=True):
        parts.append(rendered[a:b])
        parts += tok.parts(seg)
    return tok.build(parts)


class _Unsplittable(ChatTemplateError):
    """Template text the server cannot split into special tokens and text the way the
    tokenizer does (so it cannot tokenize template and content separately)."""


@dataclass(frozen=True, slots=True)
class _Special:
    """A special token in template text, with llama.cpp's whitespace-eating flags."""

    id: int
    lstrip: bool
    rstrip: bool


class _Tokenizer:
    """`tokenize` and `is_control` plus what one request learns about them (one per call,
    so nothing is shared between threads)."""

    def __init__(self, tokenize: Tokenize, is_control: IsControl) -> None:
        self._tokenize = tokenize
        self._is_control = is_control
        self._control: dict[int, bool] = {}
        self._seg_controls: dict[str, list[int]] = {}
        self._parts: dict[str, list[str | _Special]] = {}
        self._specials: dict[str, _Special] = {}

    def ids(self, text: str, *, special: bool, add_special: bool = False) -> list[int]:
        return self._tokenize(text, add_special, special)

    def controls(self, ids: Iterable[int]) -> list[int]:
        memo = self._control
        out = []
        for t in ids:
            c = memo.get(t)
            if c is None:
                c = memo[t] = bool(self._is_control(t))
            if c:
                out.append(t)
        return out

    def segment_controls(self, segment: str) -> list[int]:
        got = self._seg_controls.get(segment)
        if got is None:
            got = self._seg_controls[segment] = self.controls(self.ids(segment, special=True))
        return got

    def spelled(self, text: str) -> str | None:
        """The first control token `text` spells (one `parse_special=True` would produce and
        `parse_special=False` would not), or None."""
        with_special = self.controls(self.ids(text, special=True))
        if not with_special or with_special == self.controls(self.ids(text, special=False)):
            return None
        hit = self._first_special(text)
        return text[hit[0] : hit[1]] if hit else text[:40]

    def _has_control(self, text: str) -> bool:
        return bool(self.controls(self.ids(text, special=True)))

    def _first_special(self, text: str) -> tuple[int, int] | None:
        """Where the first control token in `text` is spelled: the shortest prefix that
        yields one ends it, the shortest suffix of that prefix that yields one starts it.
        The tokenizer does not report offsets; two bisections find them."""
        if not self._has_control(text):
            return None
        lo, hi = 1, len(text)
        while lo < hi:
            mid = (lo + hi) // 2
            if self._has_control(text[:mid]):
                hi = mid
            else:
                lo = mid + 1
        end = lo
        lo, hi = 0, end - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._has_control(text[mid:end]):
                lo = mid
            else:
                hi = mid - 1
        return lo, end

    def parts(self, segment: str) -> list[str | _Special]:
        """A template segment split into special tokens and raw text, checked to tokenize
        back to exactly what the tokenizer makes of the segment."""
        got = self._parts.get(segment)
        if got is not None:
            return got
        parts: list[str | _Special] = []
        rest = segment
        while rest:
            hit = self._first_special(rest)
            if hit is None:
                parts.append(rest)
                break
            start, end = hit
            if start:
                parts.append(rest[:start])
            parts.append(self._special(rest[start:end]))
            rest = rest[end:]
        if self.build(parts) != self.ids(segment, special=True):
            raise _Unsplittable(
                "message content spells control tokens, and this tokenizer splits the chat "
                "template's special tokens in a way the server cannot reproduce to keep that "
                "content as text"
            )
        self._parts[segment] = parts
        return parts

    def _special(self, text: str) -> _Special:
        got = self._specials.get(text)
        if got is not None:
            return got
        ids = self.ids(text, special=True)
        if len(ids) != 1 or not self.controls(ids):
            raise _Unsplittable(
                f"message content spells control tokens, and chat template text {text!r} is "
                "not one special token, so the server cannot keep that content as text"
            )
        got = self._specials[text] = _Special(
            ids[0],
            lstrip=self.ids(" " + text, special=True) == ids,
            rstrip=self.ids(text + " ", special=True) == ids,
        )
        return got

    def build(self, parts: Iterable[str | _Special]) -> list[int]:
        """Ids of specials and raw text, as llama.cpp tokenizes once it has split the
        specials out: each run of raw text is one `parse_special=False` call (so an SPM
        space prefix lands where it would), less whitespace a stripping special eats."""
        out: list[int] = []
        run: list[str] = []
        eat_left = False
        for part in parts:
            if isinstance(part, str):
                run.append(part)
                continue
            self._flush(run, out, eat_left=eat_left, eat_right=part.lstrip)
            out.append(part.id)
            eat_left = part.rstrip
        self._flush(run, out, eat_left=eat_left, eat_right=False)
        return out

    def _flush(self, run: list[str], out: list[int], *, eat_left: bool, eat_right: bool) -> None:
        text = "".join(run)
        run.clear()
        if eat_left:
            text = text.lstrip(_WS)
        if eat_right:
            text = text.rstrip(_WS)
        if text:
            out += self.ids(text, special=False)


@dataclass(frozen=True, slots=True)
class _Probe:
    """What stands in for each content in the second rendering: a random nonce (no content
    can imitate it) and, around `</think>`, whitespace that each known transform leaves
    differently on the two sides of the marker."""

    nonce: str = field(default_factory=lambda: f"{secrets.randbits(64):020d}")

    def marker(self, k: int) -> str:
        return f"\ue002{self.nonce}:{k}\ue003"

    def content(self, k: int) -> str:
        return (
            f"{_PAD_LEFT}\ue000{self.nonce}\ue001{THINK_END}{_PAD_LEFT}{self.marker(k)}{_PAD_RIGHT}"
        )

    def markers(self, probed: str) -> Iterator[tuple[int, int, int]]:
        """(start, end, message index) of each marker in the probed rendering."""
        for m in re.finditer(f"\ue002{self.nonce}:(\\d+)\ue003", probed):
            yield m.start(), m.end(), int(m.group(1))

    def shapes(self) -> list[tuple[str, str]]:
        """Per transform, the text it leaves left and right of the marker."""
        shapes = []
        for t in _TRANSFORMS:
            left, _, right = t(self.content(0)).partition(self.marker(0))
            shapes.append((left, right))
        return shapes


# Per rendered content: (end in probed, end in rendered) -> (the state before, content start)
_Level = dict[tuple[int, int], tuple[tuple[int, int], int]]


def _align(
    template: ChatTemplate,
    messages: list[dict[str, Any]],
    contents: dict[int, str],
    rendered: str,
) -> tuple[list[str], list[tuple[int, int]], list[int]] | None:
    """Template segments T0..Tn, the spans of `rendered` holding the contents between
    them and the message each came from, or None when `rendered` is not
    T0 g1(C1) T1 ... Tn for transforms g we know.

    Each content is found in the probed rendering by its marker, and the text left and right
    of the marker names the transform. The walk keeps (end in probed, end in rendered)
    states: normally one; two only where both readings give the same raw text."""
    probe = _Probe()
    try:
        probed = template.render(
            [
                {**m, "content": probe.content(i)} if i in contents else m
                for i, m in enumerate(messages)
            ]
        )
    except ChatTemplateError:
        return None
    shapes = probe.shapes()
    lefts, rights = {left for left, _ in shapes}, {right for _, right in shapes}
    states: list[tuple[int, int]] = [(0, 0)]
    levels: list[_Level] = []
    owners: list[int] = []  # the message of each rendered content
    xs: dict[tuple[int, int], str] = {}  # (message, transform) -> rendered content
    for bs, be, k in probe.markers(probed):
        text = contents.get(k)
        if text is None:
            return None
        left_ok = {x for x in lefts if bs >= len(x) and probed.startswith(x, bs - len(x), bs)}
        right_ok = {x for x in rights if probed.startswith(x, be)}
        cands = [
            (bs - len(left), be + len(right), i)
            for i, (left, right) in enumerate(shapes)
            if left in left_ok and right in right_ok
        ]
        level: _Level = {}
        for e, p in states:
            for start, end, i in cands:
                seg = probed[e:start] if start >= e else None
                if seg is None or _MARKS.search(seg) or not rendered.startswith(seg, p):
                    continue
                x = xs.get((k, i))
                if x is None:
                    x = xs[(k, i)] = _TRANSFORMS[i](text)
                q = p + len(seg)
                if rendered.startswith(x, q):
                    level.setdefault((end, q + len(x)), ((e, p), q))
        if not level:
            return None
        levels.append(level)
        owners.append(k)
        states = list(level)[:_MAX_STATES]
    for e, p in states:
        last = probed[e:]
        if _MARKS.search(last) or rendered[p:] != last:
            continue
        segments, spans = [last], []
        key = (e, p)
        for level in reversed(levels):
            prev, q = level[key]
            spans.append((q, key[1]))
            segments.append(rendered[prev[1] : q])
            key = prev
        return segments[::-1], spans[::-1], owners
    return None


def _refuse_spelled_contents(contents: dict[int, str], tok: _Tokenizer) -> None:
    for i, text in contents.items():
        spelled = tok.spelled(text)
        if spelled is not None:
            raise ChatTemplateError(
                f"message {i} content contains control-token text such as {spelled!r} that "
                "this chat template does not let the server keep as text"
            )


def _refuse_spelled_fields(messages: list[dict[str, Any]], tok: _Tokenizer) -> None:
    """Strings other than a message's text content reach the prompt as template text."""
    seen: set[str] = set()
    for i, m in enumerate(messages):
        for key, value in m.items():
            if key == "content" and isinstance(value, str):
                continue
            for s in _strings(value):
                if s in seen:
                    continue
                seen.add(s)
                spelled = tok.spelled(s)
                if spelled is not None:
                    raise ChatTemplateError(
                        f"message {i} field {key!r} contains control-token text such as "
                        f"{spelled!r}; only message content can be kept as text"
                    )


def _strings(value: Any) -> Iterable[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _strings(v)
