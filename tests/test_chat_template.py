"""Chat templates render as transformers' `apply_chat_template` renders them: the features
model templates use, per-request options, the shipped templates by name."""

from __future__ import annotations

import datetime
import json

import pytest

from engine.chat_template import ChatTemplate, ChatTemplateError

HI = [{"role": "user", "content": "Hi"}]


def render(source: str, messages: list[dict[str, str]], **bind: object) -> str:
    t = ChatTemplate(source, "<s>", "</s>")
    return (t.bind(**bind) if bind else t).render(messages)  # type: ignore[arg-type]


def test_loop_controls_work() -> None:
    src = (
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{% if m.content == 'c' %}{% break %}{% endif %}{{ m.content }}{% endfor %}"
    )
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
            {"role": "user", "content": "b"}, {"role": "user", "content": "c"},
            {"role": "user", "content": "d"}]  # fmt: skip
    assert render(src, msgs) == "ab"


def test_tojson_keeps_text_as_written() -> None:
    """transformers' `tojson` is `json.dumps` without ASCII escapes; jinja's own would turn
    `<` into `\\u003c` and `é` into `\\u00e9`, which changes what the model reads."""
    text = 'café <b>"x"</b>'
    assert render("{{ messages[0].content | tojson }}", [{"role": "user", "content": text}]) \
        == json.dumps(text, ensure_ascii=False)  # fmt: skip
    assert render("{{ {'a': 1} | tojson(indent=2) }}", HI) == '{\n  "a": 1\n}'


def test_strftime_now_and_raise_exception() -> None:
    year = str(datetime.datetime.now().year)
    assert year in render("{{ strftime_now('%Y-%m-%d') }}", HI)
    with pytest.raises(ChatTemplateError, match="no system"):
        render("{{ raise_exception('no system') }}", HI)


def test_request_variables_reach_the_template_but_not_over_the_servers_own() -> None:
    src = "{% if enable_thinking is defined and not enable_thinking %}/no_think {% endif %}" \
          "{{ messages[0].content }}{{ bos_token }}"  # fmt: skip
    assert render(src, HI) == "Hi<s>"
    assert render(src, HI, variables={"enable_thinking": False}) == "/no_think Hi<s>"
    assert render(src, HI, variables={"bos_token": "X"}) == "Hi<s>"


def test_continue_final_message_ends_right_after_its_text() -> None:
    t = ChatTemplate.resolve("chatml", None, "", "")
    msgs = [{"role": "user", "content": "Count to five."},
            {"role": "assistant", "content": "One, two, "}]  # fmt: skip
    out = t.bind(add_generation_prompt=False, continue_final_message=True).render(msgs)
    assert out.endswith("<|im_start|>assistant\nOne, two,")
    assert t.render(msgs).endswith("One, two, <|im_end|>\n<|im_start|>assistant\n")


def test_shipped_templates_by_name() -> None:
    assert "<start_of_turn>" in ChatTemplate.resolve("gemma", None, "<bos>", "").render(HI)
    assert ChatTemplate.resolve("chatml", None, "", "").render(HI) == (
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
