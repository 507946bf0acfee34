"""Render chat messages to a prompt with a jinja2 chat template, as transformers does.

The GGUF's own `tokenizer.chat_template` is used when present; models without one (the
embedded Gemma 3 270M base model among them) get the Gemma template shipped here, and
`--chat-template` overrides both (a file, or the name of a shipped one: `gemma`,
`chatml`). Templates run in jinja2's sandbox: they come from model files, which are not
trusted code.

Templates are written against transformers' `apply_chat_template`, so they get what it
gives them: `loopcontrols` (`{% break %}`), a `tojson` that keeps non-ASCII text as it is,
`raise_exception`, `strftime_now`, `add_generation_prompt`, and any extra variables a
request passes (`chat_template_kwargs`, e.g. `enable_thinking`). `continue_final_message`
ends the prompt right after the last message's content, so the model continues it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from importlib import resources
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

BUILTIN = ("gemma", "chatml")
# Names the server sets itself: a request's chat_template_kwargs cannot replace them.
RESERVED = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"})


class ChatTemplateError(ValueError):
    """The template failed to render these messages (bad roles, template bug)."""


def builtin_template(name: str = "gemma") -> str:
    return resources.files("engine").joinpath(f"templates/{name}.jinja").read_text("utf-8")


def _raise(msg: str) -> None:
    raise ChatTemplateError(msg)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None,
    separators: tuple[str, str] | None = None, sort_keys: bool = False,
) -> str:  # fmt: skip
    """transformers' `tojson`: plain `json.dumps` (jinja's own escapes <, >, & and '),
    and what `map` or `select` give (generators) as lists, as llama.cpp's renderer takes
    them (its DeepSeek R1 template writes `tools | map(...) | tojson`)."""
    return json.dumps(
        x,
        ensure_ascii=ensure_ascii,
        indent=indent,
        separators=separators,
        sort_keys=sort_keys,
        default=_listed,
    )


def _listed(x: Any) -> list[Any]:
    if isinstance(x, Iterator):
        return list(x)
    raise TypeError(f"{type(x).__name__} is not JSON serializable")


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@dataclass(frozen=True)
class ChatTemplate:
    """A compiled template plus the special-token strings it may reference."""

    source: str
    bos_token: str = ""
    eos_token: str = ""
    # how this request renders (`bind`): shared compiled template, per-request options
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    variables: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    tools: list[dict[str, Any]] | None = field(default=None, compare=False, hash=False)

    def __post_init__(self) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
        )
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = _strftime_now
        env.filters["tojson"] = _tojson
        object.__setattr__(self, "_tmpl", env.from_string(self.source))

    def bind(
        self, *, add_generation_prompt: bool = True, continue_final_message: bool = False,
        variables: dict[str, Any] | None = None, tools: list[dict[str, Any]] | None = None,
    ) -> ChatTemplate:  # fmt: skip
        """This template with one request's options (the compiled template is shared)."""
        bound = object.__new__(ChatTemplate)
        for name, value in (
            ("source", self.source), ("bos_token", self.bos_token),
            ("eos_token", self.eos_token), ("add_generation_prompt", add_generation_prompt),
            ("continue_final_message", continue_final_message),
            ("variables", dict(variables or {})), ("tools", tools),
            ("_tmpl", self._tmpl),  # type: ignore[attr-defined]
        ):  # fmt: skip
            object.__setattr__(bound, name, value)
        return bound

    @classmethod
    def resolve(
        cls, override: str | Path | None, gguf_template: str | None, bos: str, eos: str
    ) -> ChatTemplate:
        """Pick the template: `override` (a file, or a shipped template's name), else the
        GGUF's, else the shipped Gemma one."""
        if override is not None and str(override) in BUILTIN and not Path(override).exists():
            source = builtin_template(str(override))
        elif override is not None:
            source = Path(override).read_text("utf-8")
        elif gguf_template:
            source = gguf_template
        else:
            source = builtin_template("gemma")
        return cls(source, bos, eos)

    def render(self, messages: list[dict[str, Any]]) -> str:
        variables = {k: v for k, v in self.variables.items() if k not in RESERVED}
        try:
            out: str = self._tmpl.render(  # type: ignore[attr-defined]
                **variables,
                messages=messages,
                tools=self.tools,
                add_generation_prompt=self.add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except ChatTemplateError:
            raise
        except (TemplateError, TypeError, KeyError, AttributeError, ValueError) as e:
            raise ChatTemplateError(f"chat template failed: {e}") from e
        if self.continue_final_message:
            out = _cut_after_final(out, messages)
        return out


def _cut_after_final(rendered: str, messages: list[dict[str, Any]]) -> str:
    """The prompt up to the end of the last message's content (transformers' rule: its
    stripped text, found last in the prompt), so the model continues that message."""
    content = messages[-1].get("content") if messages else None
    text = content.strip() if isinstance(content, str) else ""
    at = rendered.rfind(text) if text else -1
    if at < 0:
        raise ChatTemplateError(
            "continue_final_message: the last message's text is not in the prompt"
        )
    return rendered[: at + len(text)]
