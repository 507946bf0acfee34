"""The generic tool format (api.pipeline.generic_tools): what the model is told, the grammar that
holds its answer, and the answer read back — streamed in any cut as whole."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from llguidance import LLMatcher

from api.pipeline.answer import AnswerSplit
from api.pipeline.generic_tools import (
    GENERIC,
    EnvelopeStream,
    envelope_grammar,
    envelope_schema,
    generic_setup,
    parse_generic,
    renders_system,
    string_prefix,
    text_turns,
)
from api.pipeline.rendering import render
from api.pipeline.request import Chat, EarlierCall, Message
from engine.chat_template import ChatTemplate, builtin_template

WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS: Any = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time"}},
]  # fmt: skip
CALLS = '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}, ' \
        '{"name": "get_time", "arguments": {}}]}'  # fmt: skip
ANSWER = '{"response": "Line one\\nQuote \\"x\\", snow \\u2744 and \\ud83d\\ude00."}'
ANSWER_TEXT = 'Line one\nQuote "x", snow ❄ and 😀.'


def _every_cut(text: str, rng: random.Random, tries: int = 200) -> list[tuple[str, list[Any]]]:
    """(content, calls) of `text` streamed in random cuts, `tries` times."""
    out = []
    for _ in range(tries):
        cuts = sorted(rng.sample(range(1, len(text)), k=rng.randint(0, min(12, len(text) - 1))))
        stream, content, calls = EnvelopeStream(), "", []
        for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True):
            got, new = stream.feed(text[a:b])
            content, calls = content + got, calls + new
        rest, late = stream.flush()
        out.append((content + rest, [(c.name, json.loads(c.arguments)) for c in calls + late]))
    return out


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [(CALLS, "", [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]),
     (ANSWER, ANSWER_TEXT, []),
     ('  {"response" : "ok"}', "ok", []),
     ("Plain text, no JSON.", "Plain text, no JSON.", []),
     ('{"tool_calls": [{"name": "get_weather", "argu', "", []),
     (CALLS[: CALLS.index('{"name": "get_time"')] + '{"name": "get_ti', "",
      [("get_weather", {"city": "Paris", "days": 2})]),
     ('{"tool_calls": [{"x": 1}, {"name": "get_time", "arguments": {}}]}', '{"x": 1}',
      [("get_time", {})]),
     ('{"other": 1}', '{"other": 1}', []),
     ('{"tool_call": {"name": "get_time", "arguments": "{}"}}', "", [("get_time", {})]),
     ('{"response": {"a": 1}}', '{"a": 1}', [])],
)  # fmt: skip
def test_every_cut_of_an_answer_reads_as_the_whole(
    text: str, content: str, calls: list[tuple[str, dict[str, Any]]]
) -> None:
    """Each call comes whole, the calls a list cut short finished too, never their JSON as
    text; a plain answer is its decoded text; what is neither (not JSON, no envelope) is
    content as written."""
    got_content, got_calls = parse_generic(text)
    assert (got_content, [(c.name, json.loads(c.arguments)) for c in got_calls]) == (
        content, calls,
    )  # fmt: skip
    assert all(cut == (content, calls) for cut in _every_cut(text, random.Random(len(text))))


def test_a_plain_answer_streams_as_written_and_each_call_when_it_closes() -> None:
    stream = EnvelopeStream()
    assert stream.feed('{"response": "Hel') == ("Hel", [])
    assert stream.feed("lo \\u00e") == ("lo ", [])  # an escape is held until whole
    assert stream.feed('9"}') == ("é", [])
    calls, first_ends = EnvelopeStream(), CALLS.index("}}") + 2
    assert calls.feed(CALLS[:20]) == ("", [])
    text, first = calls.feed(CALLS[20:first_ends])  # a call comes once its object closes
    assert text == "" and [c.name for c in first] == ["get_weather"]
    text, second = calls.feed(CALLS[first_ends:])
    assert text == "" and [c.name for c in second] == ["get_time"]
    assert calls.flush() == ("", [])


def test_a_json_string_prefix_stops_before_a_partial_escape() -> None:
    assert string_prefix("ab\\") == ("ab", 2, False)
    assert string_prefix("ab\\u00") == ("ab", 2, False)
    assert string_prefix("\\ud83d") == ("", 0, False)  # its low surrogate may follow
    assert string_prefix("\\ud83d\\ude00!") == ("😀!", 13, False)
    assert string_prefix('done" trailing') == ("done", 5, True)


def test_the_grammar_allows_the_envelope_and_compiles() -> None:
    """`required`: calls only, valid arguments, one unless parallel; a named function: only
    its calls, one; `auto`: calls or a plain answer. Each is a grammar llguidance takes."""
    required = envelope_schema(TOOLS, None, False, False)
    assert required["properties"]["tool_calls"]["maxItems"] == 1
    alternatives = required["properties"]["tool_calls"]["items"]["anyOf"]
    assert [a["properties"]["name"] for a in alternatives] == [
        {"const": "get_weather"}, {"const": "get_time"},
    ]  # fmt: skip
    assert alternatives[0]["properties"]["arguments"] == WEATHER
    parallel = envelope_schema(TOOLS, None, True, False)
    assert "maxItems" not in parallel["properties"]["tool_calls"]
    named = envelope_schema(TOOLS, "get_weather", True, False)
    assert named["properties"]["tool_calls"]["maxItems"] == 1
    assert named["properties"]["tool_calls"]["items"]["properties"]["name"] == {
        "const": "get_weather"
    }
    auto = envelope_schema(TOOLS, None, True, True)
    assert [list(a["properties"]) for a in auto["anyOf"]] == [["tool_calls"], ["response"]]
    for name, parallel_, answer in ((None, False, False), (None, True, True), ("get_time", 1, 0)):
        grammar = envelope_grammar(TOOLS, name, bool(parallel_), bool(answer))
        assert LLMatcher.validate_grammar(grammar) == "", grammar


def test_setup_tells_the_tools_and_holds_the_answer() -> None:
    auto = generic_setup(TOOLS, None, True)
    assert auto.parse and auto.lenient and auto.render is None and auto.history_as_text
    assert auto.prompt is not None and "### get_weather" in auto.prompt
    assert '{"response": ' in auto.prompt and '"tool_calls"' in auto.prompt
    required = generic_setup(TOOLS, "required", False, system_role=False)
    assert not required.lenient and required.prompt_in_user
    assert required.prompt is not None and '{"response"' not in required.prompt
    named = generic_setup(TOOLS, {"type": "function", "function": {"name": "get_time"}}, True)
    assert named.prompt is not None and "Call get_time." in named.prompt
    assert named.grammar is not None and "get_weather" not in named.grammar.split("%json")[1]
    none = generic_setup(TOOLS, "none", True)
    assert none.grammar is None and none.prompt is None and none.history_as_text
    with pytest.raises(ValueError, match="not in tools"):
        generic_setup(TOOLS, {"type": "function", "function": {"name": "nope"}}, True)


def test_the_prompt_s_example_answers_parse() -> None:
    """What the model is told to write is what the parser reads."""
    prompt = generic_setup(TOOLS, "auto", True).prompt or ""
    call = next(line for line in prompt.splitlines() if line.startswith('{"tool_calls"'))
    _, calls = parse_generic(call.replace("NAME", "get_time"))
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {"arg": "value"})]
    answer = next(line for line in prompt.splitlines() if line.startswith('{"response"'))
    assert parse_generic(answer) == ("your answer", [])


HISTORY = (
    Message("user", "Weather in Paris and the time?"),
    Message("assistant", "", (
        EarlierCall("c1", "get_weather", '{"city": "Paris", "days": 1}',
                    {"city": "Paris", "days": 1}),
        EarlierCall("c2", "get_time", "{}", {}),
    )),
    Message("tool", "Sunny", call_id="c1"),
    Message("tool", "12:00", call_id="c2", name="get_time"),
    Message("user", "Thanks. And tomorrow?"),
)  # fmt: skip


def test_earlier_calls_and_results_render_as_plain_turns() -> None:
    turns = text_turns(HISTORY)
    assert [t["role"] for t in turns] == ["user", "assistant", "user", "user"]
    assert json.loads(turns[1]["content"]) == {"tool_calls": [
        {"name": "get_weather", "arguments": {"city": "Paris", "days": 1}},
        {"name": "get_time", "arguments": {}},
    ]}  # fmt: skip
    assert turns[2]["content"] == (
        "Result of call c1 to get_weather:\nSunny\n\nResult of call c2 to get_time:\n12:00"
    )
    assert all("tool_calls" not in t and "tool_call_id" not in t for t in turns)


def test_gemma_s_template_renders_the_tools_and_the_round_trip() -> None:
    """Gemma's template has no tool role and folds the system message into the first user
    turn: the tools, the earlier call and its result all reach the prompt."""
    template = ChatTemplate(builtin_template("gemma"), "<bos>", "<eos>")
    assert renders_system(template.render)
    setup = generic_setup(TOOLS, "auto", True)
    messages, bound = render(template, Chat(HISTORY), setup)
    prompt = bound.render(messages)
    assert "### get_weather" in prompt and '{"response": "your answer"}' in prompt
    assert '<start_of_turn>model\n{"tool_calls": [{"name": "get_weather"' in prompt
    assert "Result of call c1 to get_weather:\nSunny" in prompt
    assert prompt.endswith("<start_of_turn>model\n")


def test_a_template_without_a_system_role_gets_the_tools_in_the_first_user_turn() -> None:
    no_system = ChatTemplate(
        "{% for m in messages %}{% if m.role == 'system' %}"
        "{{ raise_exception('no system role') }}{% endif %}"
        "[{{ m.role }}] {{ m.content }}\n{% endfor %}"
    )
    assert not renders_system(no_system.render)
    setup = generic_setup(TOOLS, "required", True, system_role=False)
    messages, bound = render(no_system, Chat((Message("user", "Hi"),)), setup)
    prompt = bound.render(messages)
    assert prompt.startswith("[user] ## Tools") and prompt.rstrip().endswith("Hi")


def test_parallel_tool_calls_false_keeps_one_call_and_finishes_as_calls() -> None:
    split = AnswerSplit(None, GENERIC, one_call=True)
    split.feed(CALLS)
    parts, reason = split.finish("stop")
    assert [c.name for c in split.all.calls] == ["get_weather"] and reason == "tool_calls"
    assert parts.content == ""


def test_a_repeated_call_ends_the_answer_with_the_calls_before_it() -> None:
    """A small model forced to call writes the same call again and again until max_tokens:
    the repeat (same function, same arguments, whatever their spacing or key order) ends
    the answer — the calls before it go out, the generation is told to stop."""
    first = '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}'
    other = '{"name": "get_weather", "arguments": {"city": "Rome"}}'
    again = '{"name": "get_weather", "arguments": {"days": 3,  "city": "Paris"}}'
    split = AnswerSplit(None, GENERIC)
    got = split.feed('{"tool_calls": [' + first + ", " + other + ", ")
    assert [json.loads(c.arguments)["city"] for c in got.calls] == ["Paris", "Rome"]
    assert not split.ended
    late = split.feed(again + ", " + other)
    assert late.calls == [] and split.ended
    assert split.feed("]}").calls == []  # (nothing after the end counts)
    _, reason = split.finish("stop")
    assert len(split.all.calls) == 2 and reason == "tool_calls"
