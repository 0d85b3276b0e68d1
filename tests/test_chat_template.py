"""Specification of pantheon.text.chat_template: HF-identical rendering of model templates, and the ChatML fallback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import FIXTURES
from pantheon.text.chat_template import ChatTemplate
from pantheon.errors import TemplateError
from pantheon.formats.gguf_reader import open_reader

REAL_NAMES = ["smollm2-135m", "qwen-0.5b", "gemma3-270m"]


def _fixture(name: str) -> dict:
    return json.loads((FIXTURES / "real" / f"{name}.json").read_text())


def _template_from_file(path: Path, source: str | None) -> ChatTemplate:
    """The template as the engine builds it: the file's template (or `source`) with its BOS/EOS texts.

    Only the few keys needed are read, since decoding the whole vocabulary takes seconds.
    """
    fields = open_reader(path).fields

    def token(key: str) -> str | None:
        if key not in fields:
            return None
        tokens = fields["tokenizer.ggml.tokens"]
        return bytes(tokens.parts[tokens.data[int(fields[key].contents())]]).decode("utf-8")

    if source is None and "tokenizer.chat_template" in fields:
        source = fields["tokenizer.chat_template"].contents()
    return ChatTemplate(source, token("tokenizer.ggml.bos_token_id"), token("tokenizer.ggml.eos_token_id"))


@pytest.fixture(scope="module")
def real_template(real_model_path):
    cache: dict[str, ChatTemplate] = {}

    def get(name: str) -> ChatTemplate:
        if name not in cache:
            path = real_model_path(name)  # a failed pull fails the test: real models never skip
            # The Gemma GGUF has no template; the fixture rendered with the official one, stored verbatim.
            cache[name] = _template_from_file(path, _fixture(name).get("chat_template_used"))
        return cache[name]

    return get


def _chat_cases() -> list:
    return [pytest.param(name, case, id=f"{name}-{i}")
            for name in REAL_NAMES for i, case in enumerate(_fixture(name)["chat_cases"])]


@pytest.mark.parametrize("name,case", _chat_cases())
def test_render_matches_hf(real_template, name, case):
    tmpl = real_template(name)
    assert tmpl.has_source
    assert tmpl.render(case["messages"], case.get("tools")) == case["rendered"]


def test_gemma_template_rejects_non_alternating_roles(real_template):
    tmpl = real_template("gemma3-270m")
    with pytest.raises(TemplateError, match="Conversation roles must alternate"):
        tmpl.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_qwen_tool_call_arguments_given_as_json_string(real_template):
    """OpenAI clients send arguments as a JSON string; the template must see the object (no double quoting)."""
    case = _fixture("qwen-0.5b")["chat_cases"][3]
    messages = json.loads(json.dumps(case["messages"]))
    fn = messages[1]["tool_calls"][0]["function"]
    fn["arguments"] = json.dumps(fn["arguments"])
    assert real_template("qwen-0.5b").render(messages, case["tools"]) == case["rendered"]
    assert isinstance(fn["arguments"], str)  # the caller's messages are not modified


@pytest.mark.parametrize("name,support", [("smollm2-135m", (False, False, False)), ("qwen-0.5b", (True, True, True)),
                                          ("gemma3-270m", (False, False, False))])
def test_tool_support_of_the_real_templates(real_template, name, support):
    """What each catalog template renders of tools itself; the rest is written in the generic tool format."""
    ts = real_template(name).tool_support
    assert (ts.declarations, ts.calls, ts.results) == support


# --- HF-compatible environment ---------------------------------------------------------------------------


def test_content_parts_are_joined_to_text():
    tmpl = ChatTemplate("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    msgs = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None}]
    assert tmpl.render(msgs) == "[a\nb][]"
    with pytest.raises(TemplateError, match="image_url"):
        tmpl.render([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_tojson_matches_hf():
    tmpl = ChatTemplate("{{ tools | tojson }}|{{ tools[0] | tojson(indent=2) }}")
    tools = [{"name": "é<&>'"}]
    assert tmpl.render([], tools) == '[{"name": "é<&>\'"}]|{\n  "name": "é<&>\'"\n}'


def test_variables_and_helpers():
    src = ("{{ bos_token }}|{{ eos_token }}|{{ add_generation_prompt }}|{{ enable_thinking is defined }}|"
           "{{ strftime_now('%Y') | length }}|{% for i in [1, 2, 3] %}{% if i == 2 %}{% break %}{% endif %}"
           "{{ i }}{% endfor %}|{% generation %}g{% endgeneration %}")
    tmpl = ChatTemplate(src, "<s>", "</s>")
    assert tmpl.render([]) == "<s>|</s>|True|False|4|1|g"
    assert tmpl.render([], add_generation_prompt=False, enable_thinking=False) == "<s>|</s>|False|True|4|1|g"
    assert ChatTemplate("{{ bos_token is defined }}").render([]) == "False"


def test_trim_and_lstrip_blocks():
    tmpl = ChatTemplate("{% for m in messages %}\n    {% if true %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}\n")
    assert tmpl.render([{"role": "user", "content": "x"}]) == "x\n"


@pytest.mark.parametrize("source,needle", [
    ("{{ raise_exception('no system role allowed') }}", "no system role allowed"),
    ("{{ undefined_thing + 1 }}", "UndefinedError"),
    ("{{ messages.append(1) }}", "SecurityError"),
    ("{{ messages[0].content + none }}", "TypeError"),
    ("{% for m in messages %}", "does not compile"),
])
def test_template_failures_are_template_errors(source, needle):
    tmpl = ChatTemplate(source)
    with pytest.raises(TemplateError, match=needle):
        tmpl.render([{"role": "user", "content": "hi"}])
    assert TemplateError.status == 400


def test_syntax_error_is_reported_on_the_object():
    tmpl = ChatTemplate("{% if %}")
    assert tmpl.has_source and tmpl.error and "does not compile" in tmpl.error


# --- ChatML fallback ---------------------------------------------------------------------------------------


def test_fallback_chatml_plain():
    tmpl = ChatTemplate(None)
    assert not tmpl.has_source
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
            {"role": "assistant", "content": "A"}, {"role": "user", "content": [{"type": "text", "text": "V"}]}]
    expected = ("<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n"
                "<|im_start|>user\nV<|im_end|>\n")
    assert tmpl.render(msgs, add_generation_prompt=False) == expected
    assert tmpl.render(msgs) == expected + "<|im_start|>assistant\n"
    assert ChatTemplate("").render(msgs, add_generation_prompt=False) == expected  # empty template = none


def test_fallback_tool_calls_and_grouped_tool_responses():
    tmpl = ChatTemplate(None)
    msgs = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"city": "Paris"}'}},
            {"id": "c2", "type": "function", "function": {"name": "w", "arguments": {"city": "Zürich"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "18C"},
        {"role": "tool", "tool_call_id": "c2", "content": "12C"},
        {"role": "assistant", "content": "Done."},
        {"role": "tool", "content": "late"},
    ]
    out = tmpl.render(msgs, add_generation_prompt=False)
    assert out == (
        "<|im_start|>user\nweather?<|im_end|>\n"
        "<|im_start|>assistant\n<tool_call>\n{\"name\": \"w\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n"
        "<tool_call>\n{\"name\": \"w\", \"arguments\": {\"city\": \"Zürich\"}}\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n<tool_response>\n12C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nDone.<|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nlate\n</tool_response><|im_end|>\n")


def test_fallback_tools_system_block():
    tools = [{"type": "function", "function": {"name": "w", "parameters": {"type": "object"}}}]
    out = ChatTemplate(None).render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
                                    tools)
    assert out.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert json.dumps(tools[0]) in out and out.count("<|im_start|>system") == 1
    assert out.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_fallback_think_prefill_and_prompt_ends_in_think():
    tmpl = ChatTemplate(None)
    msgs = [{"role": "user", "content": "hi"}]
    thinking = tmpl.render(msgs, enable_thinking=True)
    assert thinking.endswith("<|im_start|>assistant\n<think>\n")
    assert tmpl.prompt_ends_in_think(thinking)
    assert not tmpl.prompt_ends_in_think(tmpl.render(msgs))
    assert not tmpl.prompt_ends_in_think(tmpl.render(msgs, enable_thinking=False))


def test_prompt_ends_in_think_with_a_qwen3_style_template():
    src = ("{{ '<|im_start|>assistant\\n' }}{% if enable_thinking is defined and enable_thinking is false %}"
           "{{ '<think>\\n\\n</think>\\n\\n' }}{% elif enable_thinking %}{{ '<think>\\n' }}{% endif %}")
    tmpl = ChatTemplate(src)
    assert not tmpl.prompt_ends_in_think(tmpl.render([], enable_thinking=False))
    assert tmpl.prompt_ends_in_think(tmpl.render([], enable_thinking=True))
    assert not tmpl.prompt_ends_in_think(tmpl.render([]))
