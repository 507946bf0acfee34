"""A generation's blocks as the Responses API's output items, streamed or whole.

Each block of a choice's answer (api.pipeline.output_blocks) is one output item: reasoning a
`reasoning` item, text a `message`, each call a `function_call`, in the blocks' order.
Streamed, a block's index opens its item (`output_item.added`, and a content part for
text and reasoning), its pieces are deltas, and the next block's index — or the end —
closes it with the `.done` events that carry the whole. A call comes whole, so its item
opens, gets its arguments in one delta and closes at once. An answer that makes no call
has a message, empty if the model wrote nothing, so a client always finds its text.
Streamed and whole, the same answer gives the same items.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from api.pipeline.output_blocks import Block, Reasoning, Text, ToolUse
from api.protocols.openai.responses_wire import (
    ArgumentsDelta,
    ArgumentsDone,
    FunctionCallItem,
    ItemAdded,
    ItemDone,
    MessageItem,
    OutputItem,
    OutputText,
    PartAdded,
    PartDone,
    ReasoningDelta,
    ReasoningDone,
    ReasoningItem,
    ReasoningText,
    Status,
    StreamEvent,
    TextDelta,
    TextDone,
)


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message(text: str, status: Status = "completed", id: str | None = None) -> MessageItem:
    return MessageItem(id=id or item_id("msg"), status=status, content=[OutputText(text=text)])


def reasoning(text: str, status: Status = "completed", id: str | None = None) -> ReasoningItem:
    return ReasoningItem(id=id or item_id("rs"), status=status,
                         content=[ReasoningText(text=text)])  # fmt: skip


def function_call(
    block: ToolUse, namespaced: Mapping[str, tuple[str, str]], status: Status = "completed"
) -> FunctionCallItem:
    """A call's item; one of a namespace's tools with `namespace` and `name` apart (the
    model called it by its flat name, api.protocols.openai.responses_input)."""
    c = block.call
    namespace, name = namespaced.get(c.name, (None, c.name))
    return FunctionCallItem(id=item_id("fc"), call_id=c.id, name=name, arguments=c.arguments,
                            status=status, namespace=namespace)  # fmt: skip


def whole(
    blocks: list[Block], cut: bool, namespaced: Mapping[str, tuple[str, str]]
) -> list[OutputItem]:
    """A whole answer's items; `cut`: it ended at its token limit (its last item is
    incomplete)."""
    items: list[OutputItem] = []
    for b in blocks:
        if isinstance(b, Text):
            items.append(message(b.text))
        elif isinstance(b, Reasoning):
            items.append(reasoning(b.text))
        else:
            items.append(function_call(b, namespaced))
    if not any(isinstance(i, MessageItem | FunctionCallItem) for i in items):
        items.append(message(""))
    if cut and isinstance(items[-1], MessageItem | ReasoningItem):
        items[-1].status = "incomplete"
    return items


@dataclass(slots=True)
class _Open:
    """The text or reasoning item being streamed."""

    block: int  # the block's index in the answer
    output_index: int
    id: str
    is_text: bool
    text: str = ""


class ItemStream:
    """One choice's output items as stream events, numbered from `first_sequence`."""

    def __init__(self, first_sequence: int, namespaced: Mapping[str, tuple[str, str]]) -> None:
        self._seq = first_sequence
        self._namespaced = namespaced
        self._open: _Open | None = None
        self.items: list[OutputItem] = []
        self.reasoning_text = ""  # all of it, for the usage's reasoning tokens

    def next(self) -> int:
        """The next event's sequence number (the codec's own events take theirs here too)."""
        self._seq += 1
        return self._seq - 1

    def blocks(self, blocks: list[Block]) -> Iterator[StreamEvent]:
        for b in blocks:
            if isinstance(b, ToolUse):
                yield from self._close("completed")
                yield from self._call(b)
                continue
            is_text = isinstance(b, Text)
            if self._open is None or self._open.block != b.index:
                yield from self._close("completed")
                yield from self._start(b.index, is_text)
            yield from self._delta(b.text)

    def finish(self, cut: bool) -> Iterator[StreamEvent]:
        """The last item closed (incomplete when `cut`), and the empty message of an
        answer without text or calls."""
        if not any(isinstance(i, MessageItem | FunctionCallItem) for i in self.items):
            yield from self._close("completed")
            yield from self._start(-1, True)
        yield from self._close("incomplete" if cut else "completed")

    def _start(self, block: int, is_text: bool) -> Iterator[StreamEvent]:
        o = self._open = _Open(block, len(self.items), item_id("msg" if is_text else "rs"),
                               is_text)  # fmt: skip
        item: OutputItem
        if is_text:
            item = MessageItem(id=o.id, status="in_progress", content=[])
        else:
            item = ReasoningItem(id=o.id, status="in_progress", content=[])
        self.items.append(item)
        yield ItemAdded(sequence_number=self.next(), output_index=o.output_index, item=item)
        part = OutputText(text="") if is_text else ReasoningText(text="")
        yield PartAdded(sequence_number=self.next(), item_id=o.id, output_index=o.output_index,
                        content_index=0, part=part)  # fmt: skip

    def _delta(self, text: str) -> Iterator[StreamEvent]:
        o = self._open
        assert o is not None  # (a delta follows its item's start)
        o.text += text
        if o.is_text:
            yield TextDelta(sequence_number=self.next(), item_id=o.id,
                            output_index=o.output_index, content_index=0, delta=text)  # fmt: skip
        else:
            self.reasoning_text += text
            yield ReasoningDelta(sequence_number=self.next(), item_id=o.id,
                                 output_index=o.output_index, content_index=0,
                                 delta=text)  # fmt: skip

    def _close(self, status: Status) -> Iterator[StreamEvent]:
        o, self._open = self._open, None
        if o is None:
            return
        i, at = o.id, o.output_index
        item: OutputItem
        if o.is_text:
            yield TextDone(sequence_number=self.next(), item_id=i, output_index=at,
                           content_index=0, text=o.text)  # fmt: skip
            part: OutputText | ReasoningText = OutputText(text=o.text)
            item = message(o.text, status, i)
        else:
            yield ReasoningDone(sequence_number=self.next(), item_id=i, output_index=at,
                                content_index=0, text=o.text)  # fmt: skip
            part = ReasoningText(text=o.text)
            item = reasoning(o.text, status, i)
        yield PartDone(sequence_number=self.next(), item_id=i, output_index=at, content_index=0,
                       part=part)  # fmt: skip
        self.items[o.output_index] = item
        yield ItemDone(sequence_number=self.next(), output_index=o.output_index, item=item)

    def _call(self, b: ToolUse) -> Iterator[StreamEvent]:
        done = function_call(b, self._namespaced)
        at = len(self.items)
        self.items.append(done)
        started = FunctionCallItem(id=done.id, call_id=done.call_id, name=done.name,
                                   arguments="", status="in_progress",
                                   namespace=done.namespace)  # fmt: skip
        yield ItemAdded(sequence_number=self.next(), output_index=at, item=started)
        yield ArgumentsDelta(sequence_number=self.next(), item_id=done.id, output_index=at,
                             delta=done.arguments)  # fmt: skip
        yield ArgumentsDone(sequence_number=self.next(), item_id=done.id, output_index=at,
                            name=done.name, arguments=done.arguments)  # fmt: skip
        yield ItemDone(sequence_number=self.next(), output_index=at, item=done)
