"""Tool-call text into calls: any cut of the stream gives what the whole answer gives."""

from __future__ import annotations

import json
import random

import pytest

from api.pipeline.tool_calls import Call, ToolStream, detect, forced_grammar, parse, tool_prompt

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


def assert_every_cut(
    text: str, fmt: str, content: str, calls: list[Call], rng: random.Random, tries: int,
    max_cuts: int,
) -> None:  # fmt: skip
    """Streamed in `tries` random cuts (up to `max_cuts` each), `text` gives `content` and
    the same calls as parsed whole."""
    for _ in range(tries):
        k = rng.randint(0, min(max_cuts, len(text) - 1))
        cuts = sorted(rng.sample(range(1, len(text)), k=k))
        split = ToolStream(fmt)
        streamed, found = "", []
        for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
            out, new = split.feed(text[a:b])
            streamed, found = streamed + out, found + new
        rest, late = split.flush()
        assert streamed + rest == content
        assert [(c.name, c.arguments) for c in found + late] == [
            (c.name, c.arguments) for c in calls
        ]


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_every_cut_of_the_stream_gives_the_whole_answer_s_calls(
    text: str, content: str, calls: list[tuple[str, dict[str, str]]]
) -> None:
    got_content, got_calls = parse(text)
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got_calls] == calls
    assert_every_cut(text, "hermes", content, got_calls, random.Random(len(text)), 200, 8)


def test_the_format_comes_from_the_template() -> None:
    assert detect("{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}<tool_call>") \
        == "hermes"  # fmt: skip
    assert detect("<start_of_turn>user\n{{ content }}") is None


def test_a_forced_call_grammar_names_the_function_and_its_schema() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}},
        {"type": "function", "function": {"name": "g"}}]  # fmt: skip
    g = forced_grammar(tools, "f", False, "hermes")
    assert '"const": "f"' in g and '"g"' not in g and "call+" not in g
    both = forced_grammar(tools, None, True, "hermes")
    assert "call+" in both and "call: call_0 | call_1" in both


V31 = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'
       '<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{"tz": "CET"}'
       "<｜tool▁call▁end｜><｜tool▁calls▁end｜>")  # fmt: skip
V3 = ("Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
      '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')  # fmt: skip


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [(V31, "", [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]),
     (V3, "Checking.", [("get_weather", {"city": "Paris"})]),
     ("No call.", "No call.", [])],
)  # fmt: skip
def test_deepseek_calls_v3_and_v3_1_in_any_cut(
    text: str, content: str, calls: list[tuple[str, dict[str, str]]]
) -> None:
    got_content, got = parse(text, "deepseek_v3")
    assert got_content == content
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    assert_every_cut(text, "deepseek_v3", content, got, random.Random(7), 100, 8)


def test_deepseek_is_detected_and_its_forced_call_is_in_its_own_syntax() -> None:
    assert detect("{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + name}}") == "deepseek_v3"
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    g = forced_grammar(tools, "f", False, "deepseek_v3")
    assert g.startswith('start: "<｜tool▁calls▁begin｜>" call "<｜tool▁calls▁end｜>"')
    assert '"f" "<｜tool▁sep｜>" %json' in g
    old = forced_grammar(tools, "f", False, "deepseek_v3", old_deepseek=True)
    assert '"function" "<｜tool▁sep｜>" "f"' in old and "```json" in old


MISTRAL_V3 = 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'
MISTRAL_V7 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}'
LLAMA3 = '{"name": "get_weather", "parameters": {"city": "Paris"}}'


@pytest.mark.parametrize(
    ("fmt", "text", "content", "calls"),
    [("mistral", MISTRAL_V3, "Sure.", [("get_weather", {"city": "Paris"})]),
     ("mistral", MISTRAL_V7, "", [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]),
     ("mistral", "[TOOL_CALLS]oops", "[TOOL_CALLS]oops", []),
     ("llama3_json", "  " + LLAMA3, "", [("get_weather", {"city": "Paris"})]),
     ("llama3_json", "<|python_tag|>" + LLAMA3, "", [("get_weather", {"city": "Paris"})]),
     ("llama3_json", "{not a call", "{not a call", []),
     ("llama3_json", "Paris is nice.", "Paris is nice.", [])],
)  # fmt: skip
def test_formats_whose_calls_end_the_answer_in_any_cut(
    fmt: str, text: str, content: str, calls: list[tuple[str, dict[str, str]]]
) -> None:
    """Mistral's `[TOOL_CALLS]` (a JSON list, or name[ARGS]{…} per call) and Llama 3's
    JSON answer: the calls are the rest of the answer, known when it ends; until a call
    starts, text streams as content."""
    got_content, got = parse(text, fmt)
    assert (got_content, [(c.name, json.loads(c.arguments)) for c in got]) == (content, calls)
    assert_every_cut(text, fmt, content, got, random.Random(3), 100, 6)


def test_forced_calls_in_mistral_and_llama3_syntax_compile() -> None:
    """Each format's forced-call grammar is one llguidance accepts (checked against a
    vocabulary-free compile: the lark and JSON schema parts parse)."""
    from llguidance import LLMatcher

    params = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
    for fmt, style in (("mistral", False), ("mistral", True), ("llama3_json", False),
                       ("hermes", False), ("deepseek_v3", False)):  # fmt: skip
        g = forced_grammar(tools, None, True, fmt, args_style=style)
        assert LLMatcher.validate_grammar(g) == "", (fmt, g)


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    from api.pipeline.answer import AnswerSplit

    split = AnswerSplit(None, "hermes", one_call=True)
    got = split.feed(TWO)
    rest, reason = split.finish("stop")
    assert [c.name for c in got.calls + rest.calls] == ["get_weather"]
    assert [c.name for c in split.all.calls] == ["get_weather"] and reason == "tool_calls"


@pytest.mark.parametrize(
    ("fmt", "old_deepseek", "args_style"),
    [("hermes", False, False), ("deepseek_v3", False, False), ("deepseek_v3", True, False),
     ("mistral", False, False), ("mistral", False, True), ("llama3_json", False, False)],
)  # fmt: skip
def test_the_call_syntax_told_to_a_model_parses(
    fmt: str, old_deepseek: bool, args_style: bool
) -> None:
    """Where a template drops `tools`, the server's system message tells the model its
    functions and how to call them: that example, filled in, is a call the parser reads."""
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                               "parameters": {"type": "object"}}}]  # fmt: skip
    text = tool_prompt(tools, fmt, old_deepseek, args_style)
    assert "### get_weather" in text and "Weather" in text
    example = text.split("them):\n", 1)[1].replace("NAME", "get_weather")
    _, calls = parse(example, fmt)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"arg": "value"})]
