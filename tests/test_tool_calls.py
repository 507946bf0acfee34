"""Tool-call text into calls: any cut of the stream gives what the whole answer gives."""

from __future__ import annotations

import json
import random

import pytest

from api.tool_calls import ToolStream, detect, forced_grammar, parse

ONE = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TWO = ONE + '\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
CASES = [
    ("Let me check.\n" + ONE, "Let me check.\n", [("get_weather", {"city": "Paris"})]),
    (TWO + "\nDone.", "", [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]),
    ("No tools needed: 4.", "No tools needed: 4.", []),
    ("<tool_call>\n{not json}\n</tool_call>", "<tool_call>\n{not json}\n</tool_call>", []),
    ("Hmm <tool_call>\n{\"name\": \"f\", \"argu", "Hmm <tool_call>\n{\"name\": \"f\", \"argu", []),
    ("a < b and <tool_ca", "a < b and <tool_ca", []),
]  # fmt: skip


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_every_cut_of_the_stream_gives_the_whole_answer_s_calls(
    text: str, content: str, calls: list[tuple[str, dict[str, str]]]
) -> None:
    got_content, got_calls = parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    rng = random.Random(len(text))
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), k=rng.randint(0, 8)))
        split = ToolStream()
        streamed, found = "", []
        for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
            out, new = split.feed(text[a:b])
            streamed, found = streamed + out, found + new
        streamed += split.flush()
        assert streamed == content
        assert [(c.name, c.arguments) for c in found] == [(c.name, c.arguments) for c in got_calls]


def test_the_format_comes_from_the_template() -> None:
    assert detect("{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}<tool_call>") \
        == "hermes"  # fmt: skip
    assert detect("<start_of_turn>user\n{{ content }}") is None


def test_a_forced_call_grammar_names_the_function_and_its_schema() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}},
        {"type": "function", "function": {"name": "g"}}]  # fmt: skip
    g = forced_grammar(tools, "f", parallel=False)
    assert '"const": "f"' in g and '"g"' not in g and "call+" not in g
    assert "anyOf" in forced_grammar(tools, None, parallel=True)
