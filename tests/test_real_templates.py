"""Tool calls on real models' chat templates (the ones llama.cpp ships for its own tests,
from the llama-cpp-python source the project builds): the format is detected from the
template; the prompt tells the model its tools (the template's way, or the server's
system message where the template drops them); an assistant's call and the tool's result
render; and what the template writes for a call — the text the model was trained to
produce — parses back into that call, whole and in any cut of a stream."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import pytest

from api.pipeline.generic_tools import renders_system
from api.pipeline.rendering import TemplateArguments, render, renders_system_between
from api.pipeline.request import Chat, Message
from api.pipeline.tool_calls import ToolSetup, detect, parse, renders_tools, tool_setup, with_prompt
from bench.peers import llama_cpp_source
from engine.chat_template import ChatTemplate
from tests.test_tool_calls import assert_every_cut

DS_BOS, DS_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
L3_HEAD = "<|start_header_id|>assistant<|end_header_id|>\n\n"
# file, format, bos, the text that opens the assistant's answer, the end of its turn
TEMPLATES = [
    ("Qwen-Qwen2.5-7B-Instruct.jinja", "hermes", "", "<|im_start|>assistant\n", "<|im_end|>"),
    ("Qwen-Qwen3-0.6B.jinja", "hermes", "", "<|im_start|>assistant\n", "<|im_end|>"),
    ("NousResearch-Hermes-3-Llama-3.1-8B-tool_use.jinja", "hermes", "<|begin_of_text|>",
     "<|im_start|>assistant\n", "<|im_end|>"),
    ("deepseek-ai-DeepSeek-V3.1.jinja", "deepseek_v3", DS_BOS, "<｜Assistant｜>", DS_EOS),
    ("deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja", "deepseek_v3", DS_BOS, "<｜Assistant｜>",
     DS_EOS),
    ("llama-cpp-deepseek-r1.jinja", "deepseek_v3", DS_BOS, "<｜Assistant｜>", DS_EOS),
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistral", "<s>", "[/INST]", "</s>"),
    ("unsloth-mistral-Devstral-Small-2507.jinja", "mistral", "<s>", "[/INST]", "</s>"),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", "llama3_json", "<|begin_of_text|>", L3_HEAD,
     "<|eot_id|>"),
    ("meta-llama-Llama-3.3-70B-Instruct.jinja", "llama3_json", "<|begin_of_text|>", L3_HEAD,
     "<|eot_id|>"),
]  # fmt: skip
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, for some days",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "days": {"type": "integer"}},
                   "required": ["city"]}}}]  # fmt: skip
ASK = "What is the weather in Paris this week?"
ARGS = {"city": "Paris", "days": 3}
CALL_ID = "abcDEF123"  # Mistral's templates want nine letters or digits


@pytest.fixture(scope="module")
def templates() -> Path:
    return llama_cpp_source(Path(__file__).resolve().parents[1] / ".bench") / "models/templates"


def _call() -> dict[str, Any]:
    """An assistant's call as the server hands it to templates (api.pipeline.rendering)."""
    args = TemplateArguments(json.dumps(ARGS), ARGS)
    return {"id": CALL_ID, "type": "function",
            "function": {"name": "get_weather", "arguments": args}}  # fmt: skip


@pytest.mark.parametrize(("name", "fmt", "bos", "head", "eot"), TEMPLATES,
                         ids=[t[0].removesuffix(".jinja") for t in TEMPLATES])  # fmt: skip
def test_a_real_template_s_call_parses_back(
    templates: Path, name: str, fmt: str, bos: str, head: str, eot: str
) -> None:
    source = (templates / name).read_text("utf-8")
    assert detect(source) == fmt
    tpl = ChatTemplate(source, bos, eot if eot != "<|im_end|>" else "")
    user = {"role": "user", "content": ASK}
    # as the server does it (api.server.app, api.pipeline.structured, api.protocols.openai.routes)
    own = renders_tools(lambda tools: tpl.bind(tools=tools).render([user]))
    setup = tool_setup(TOOLS, "auto", True, fmt, None, "function<｜tool▁sep｜>" in source,
                       "[ARGS]" in source, own)  # fmt: skip
    assert (setup.prompt is None) == own
    messages = with_prompt([user], setup.prompt) if setup.prompt else [user]
    prompt = tpl.bind(tools=TOOLS).render(messages)
    assert "get_weather" in prompt and "The weather in a city" in prompt  # the model is told
    asked = {"role": "assistant", "content": "", "tool_calls": [_call()]}
    history = tpl.bind(tools=TOOLS, add_generation_prompt=False).render([user, asked])
    # The model's answer as the template writes it: after the assistant's header that
    # follows the question, up to its end of turn (the server stops there, never shows it).
    start = history.index(head, history.rindex(ASK)) + len(head)
    answer = history[start:].split(eot)[0]
    content, calls = parse(answer, fmt)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", ARGS)]
    # (before the call, Qwen 3 and DeepSeek V3.1 write an empty reasoning block)
    assert re.sub(r"<think>\s*</think>", "", content).strip() == ""
    assert_every_cut(answer, fmt, content, calls, random.Random(name), 50, 6)
    # the tool's result renders, and the conversation continues after it
    result = {"role": "tool", "tool_call_id": CALL_ID, "name": "get_weather",
              "content": '{"temperature_c": 21}'}  # fmt: skip
    turn = tpl.bind(tools=TOOLS).render([user, asked, result])
    assert "temperature_c" in turn[turn.rindex("get_weather") :]


def _renderable(folder: Path) -> list[tuple[str, ChatTemplate]]:
    """Every template of llama.cpp's set that renders a plain chat (some need tags or
    variables of their own servers)."""
    out = []
    for f in sorted(folder.glob("*.jinja")):
        try:
            t = ChatTemplate(f.read_text("utf-8"), "<s>", "</s>")
            t.render([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"},
                      {"role": "user", "content": "More"}])  # fmt: skip
        except Exception:  # (a template the server could not load either)
            continue
        out.append((f.name, t))
    return out


def test_a_system_message_between_turns_reaches_the_prompt_on_every_template(
    templates: Path,
) -> None:
    """Agents send system text mid-conversation (Claude Code its environment, OpenAI
    clients a developer message): on every template it is in the prompt, with the first
    system message kept — where the template renders one there, as a system turn, else
    in the user turn beside it (Gemma 3 raises unless turns alternate; DeepSeek R1 keeps
    only the last system message; Gemma 2 has no system role at all)."""
    chat = Chat(
        (Message("user", "Hi"), Message("assistant", "Hello"),
         Message("system", "Mid-conversation note"), Message("user", "More")),
        instructions="First instructions",
    )  # fmt: skip
    kinds = {True: 0, False: 0}
    found = _renderable(templates)
    assert len(found) >= 40
    for name, t in found:
        first, between = renders_system(t.render), renders_system_between(t.render)
        kinds[between] += 1
        messages, bound = render(t, chat, ToolSetup(), first, between)
        prompt = bound.render(messages)
        assert "First instructions" in prompt and "Mid-conversation note" in prompt, name
        assert prompt.index("Hello") < prompt.index("Mid-conversation note"), name
        assert prompt.index("Mid-conversation note") < prompt.index("More"), name
    assert kinds[True] and kinds[False]  # both paths taken
