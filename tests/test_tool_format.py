"""Specification of tools for every model: the generic tool format (pantheon.text.tool_format), the chat
template's hook that applies it, the deprecated `functions` / `function_call` request fields, and the
prompt the real default model (SmolLM2, whose template has no tools branch) receives.
"""

from __future__ import annotations

import json

import pytest

from pantheon.text import tool_format
from pantheon.text.chat_template import ChatTemplate
from pantheon.errors import RequestError, TemplateError
from pantheon.text.tool_format import NATIVE, ToolSupport
from pantheon.web.chat import parse_chat_request

# SmolLM2's template, verbatim: every role name is written as it is, and there is no tools branch.
SMOL = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
        "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
        "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
# A Gemma-2-style template: no system role at all, and roles must alternate.
NO_SYSTEM = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
             "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
             "{{ raise_exception('Conversation roles must alternate') }}{% endif %}"
             "[{{ m['role'] }}]{{ m['content'] }}{% endfor %}")
# Declares tools natively but knows neither tool calls in history nor the tool role.
TOOLS_ONLY = ("{% if tools %}TOOLS:{{ tools | tojson }}\n{% endif %}"
              "{% for m in messages %}[{{ m.role }}]{{ m.content }}\n{% endfor %}")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = {"role": "user", "content": "What is the weather in Paris?"}
CALLED = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}
NO_SUPPORT = ToolSupport(False, False, False)


# ---- the generic format, as pure functions ------------------------------------------------------------------


def test_tools_block_lists_each_definition_as_json_and_the_call_syntax():
    block = tool_format.tools_block([WEATHER, TIME])
    assert json.dumps(WEATHER) in block and json.dumps(TIME) in block
    assert "<tools>\n" + json.dumps(WEATHER) + "\n" + json.dumps(TIME) + "\n</tools>" in block
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in block
    assert "<tool_response></tool_response>" in block
    assert block.endswith("If no function is needed, answer the user directly.")


@pytest.mark.parametrize("choice,sentence", [
    ("auto", "If no function is needed, answer the user directly."),
    ("required", "You must call at least one of these functions in this answer."),
    ({"type": "function", "function": {"name": "get_time"}}, 'You must call the function "get_time" in this answer.'),
])
def test_tool_choice_words_the_instruction(choice, sentence):
    assert tool_format.tools_block([TIME], choice).endswith(sentence)


def test_a_call_is_written_in_the_syntax_the_emitter_parses():
    from pantheon.text.emitter import Emitter

    text = tool_format.call_text(CALLED["tool_calls"][0])
    assert text == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    em = Emitter(tools_enabled=True)
    em.feed(text)
    em.finish()
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in em.tool_calls] == \
        [("get_weather", {"city": "Paris"})]


def test_call_arguments_that_are_not_a_json_object_stay_a_string():
    call = {"function": {"name": "f", "arguments": "not json"}}
    assert tool_format.call_text(call) == '<tool_call>\n{"name": "f", "arguments": "not json"}\n</tool_call>'
    assert '"arguments": {}' in tool_format.call_text({"function": {"name": "f"}})


def test_a_result_carries_name_call_id_and_content():
    assert tool_format.result_text("18 C", "get_weather", "call_1") == \
        '<tool_response>\n{"name": "get_weather", "tool_call_id": "call_1", "content": "18 C"}\n</tool_response>'
    # JSON content stays structured; anything else (also broken JSON) is the string as sent
    assert '"content": {"t": 18}' in tool_format.result_text('{"t": 18}')
    assert '"content": "{broken"' in tool_format.result_text("{broken")


def test_history_calls_become_assistant_text_and_results_user_turns():
    history = [ASK, CALLED, RESULT]
    out = tool_format.rewrite_history(history, NO_SUPPORT)
    assert out[0] is ASK
    assert out[1] == {"role": "assistant", "content": tool_format.call_text(CALLED["tool_calls"][0])}
    assert out[2] == {"role": "user", "content": tool_format.result_text("18 C, sunny", "get_weather", "call_1")}
    assert history == [ASK, CALLED, RESULT] and "tool_calls" in CALLED  # the caller's messages are untouched


def test_assistant_text_comes_before_its_calls():
    msg = {"role": "assistant", "content": "Let me look.", "tool_calls": CALLED["tool_calls"]}
    out = tool_format.rewrite_history([msg], NO_SUPPORT)
    assert out[0]["content"] == "Let me look.\n" + tool_format.call_text(CALLED["tool_calls"][0])


def test_neighbouring_results_and_user_text_share_one_user_turn():
    calls = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}},
        {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]}
    history = [ASK, calls, {"role": "tool", "tool_call_id": "a", "content": "18 C"},
               {"role": "tool", "tool_call_id": "b", "content": "noon"}, {"role": "user", "content": "Thanks"}]
    out = tool_format.rewrite_history(history, NO_SUPPORT)
    assert [m["role"] for m in out] == ["user", "assistant", "user"]
    assert out[2]["content"] == (tool_format.result_text("18 C", "get_weather", "a") + "\n"
                                 + tool_format.result_text("noon", "get_time", "b") + "\n\nThanks")


def test_two_plain_user_messages_are_not_joined():
    history = [ASK, {"role": "user", "content": "Hello?"}]
    assert tool_format.rewrite_history(history, ToolSupport(True, False, False)) == history


def test_a_result_without_a_known_call_keeps_what_it_has():
    out = tool_format.rewrite_history([{"role": "tool", "name": "lookup", "content": "x"}], NO_SUPPORT)
    assert out == [{"role": "user", "content": tool_format.result_text("x", "lookup")}]


def test_only_the_missing_pieces_are_rewritten():
    history = [ASK, CALLED, RESULT]
    assert tool_format.rewrite_history(history, NATIVE) is history
    calls_only = tool_format.rewrite_history(history, ToolSupport(True, True, False))
    assert calls_only[1] is CALLED and calls_only[2]["role"] == "user"


def test_tools_block_joins_the_system_message_or_opens_one():
    with_system = tool_format.declare_tools([{"role": "system", "content": "Be brief."}, ASK], [WEATHER])
    assert with_system[0]["content"] == "Be brief.\n\n" + tool_format.tools_block([WEATHER])
    without = tool_format.declare_tools([ASK], [WEATHER])
    assert without == [{"role": "system", "content": tool_format.tools_block([WEATHER])}, ASK]
    in_user = tool_format.declare_tools([ASK], [WEATHER], in_system=False)
    assert in_user == [{"role": "user", "content": tool_format.tools_block([WEATHER]) + "\n\n" + ASK["content"]}]


def test_adapt_hands_native_tools_to_the_template_and_generic_ones_to_the_messages():
    assert tool_format.adapt([ASK], [WEATHER], "auto", NATIVE) == ([ASK], [WEATHER])
    msgs, tools = tool_format.adapt([ASK], [WEATHER], "auto", NO_SUPPORT)
    assert tools is None and msgs[0]["role"] == "system" and json.dumps(WEATHER) in msgs[0]["content"]
    assert tool_format.adapt([ASK], None, "auto", NO_SUPPORT) == ([ASK], None)


# ---- the chat template applies it -------------------------------------------------------------------------


def test_tool_support_is_read_from_the_template_source():
    assert ChatTemplate(SMOL).tool_support == NO_SUPPORT
    assert ChatTemplate(TOOLS_ONLY).tool_support == ToolSupport(True, False, False)
    assert ChatTemplate(None).tool_support == NATIVE  # the ChatML fallback renders all of it
    qwen_like = ("{% if tools %}{{ tools | tojson }}{% endif %}{% for m in messages %}{% if m.role == 'tool' %}R"
                 "{% elif m['tool_calls'] %}C{% endif %}{% endfor %}")
    assert ChatTemplate(qwen_like).tool_support == NATIVE


def test_template_without_tools_gets_the_generic_format():
    tmpl = ChatTemplate(SMOL)
    plain = tmpl.render([ASK])
    with_tools = tmpl.render([ASK], [WEATHER, TIME])
    assert "You are a helpful AI assistant named SmolLM" in plain
    assert with_tools == ("<|im_start|>system\n" + tool_format.tools_block([WEATHER, TIME]) + "<|im_end|>\n"
                          "<|im_start|>user\n" + ASK["content"] + "<|im_end|>\n<|im_start|>assistant\n")


def test_template_without_tools_renders_history_calls_and_results():
    out = ChatTemplate(SMOL).render([ASK, CALLED, RESULT], [WEATHER])
    assert out.endswith(
        "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n"
        "</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n"
        "{\"name\": \"get_weather\", \"tool_call_id\": \"call_1\", \"content\": \"18 C, sunny\"}\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert "<|im_start|>tool" not in out
    # also without tools declared (tool_choice "none"): history is never dropped
    assert "<tool_call>" in ChatTemplate(SMOL).render([ASK, CALLED, RESULT])


def test_native_tools_with_generic_history():
    out = ChatTemplate(TOOLS_ONLY).render([ASK, CALLED, RESULT], [WEATHER])
    assert out.startswith("TOOLS:" + json.dumps([WEATHER]))
    assert "[assistant]<tool_call>" in out and "[user]<tool_response>" in out and "[tool]" not in out


def test_a_template_that_refuses_a_system_turn_gets_the_block_in_the_first_user_turn():
    tmpl = ChatTemplate(NO_SYSTEM)
    out = tmpl.render([ASK, CALLED, RESULT], [WEATHER])
    assert out.startswith("[user]" + tool_format.tools_block([WEATHER]) + "\n\n" + ASK["content"])
    with pytest.raises(TemplateError, match="System role not supported"):  # the client's own system turn
        tmpl.render([{"role": "system", "content": "S"}, ASK], [WEATHER])


def test_chatml_fallback_says_when_a_call_is_required():
    tmpl = ChatTemplate(None)
    assert "You must call" not in tmpl.render([ASK], [WEATHER])
    assert "You must call at least one of these functions" in tmpl.render([ASK], [WEATHER], tool_choice="required")
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert 'You must call the function "get_weather"' in tmpl.render([ASK], [WEATHER], tool_choice=named)


# ---- the deprecated functions / function_call fields -------------------------------------------------------


def parse(**body):
    body.setdefault("messages", [ASK])
    return parse_chat_request(body, {})


def test_functions_are_tools_and_function_call_is_tool_choice():
    creq = parse(functions=[WEATHER["function"], TIME["function"]])
    assert creq.tools == [WEATHER, TIME] and creq.tool_choice == "auto"
    assert parse(functions=[WEATHER["function"]], function_call="none").tool_choice == "none"
    named = parse(functions=[WEATHER["function"], TIME["function"]], function_call={"name": "get_time"})
    assert named.tool_choice == {"type": "function", "function": {"name": "get_time"}}
    assert named.template_tools() == [TIME]
    assert parse(tools=[WEATHER], function_call={"name": "get_weather"}).tool_choice["function"]["name"] == \
        "get_weather"


def test_function_messages_in_history_are_tool_calls_and_results():
    creq = parse(messages=[ASK, {"role": "assistant", "content": None,
                                 "function_call": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
                           {"role": "function", "name": "get_weather", "content": "18 C"}])
    assert creq.messages[1] == {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]}
    assert creq.messages[2] == {"role": "tool", "name": "get_weather", "content": "18 C"}
    out = ChatTemplate(SMOL).render(creq.messages)
    assert tool_format.result_text("18 C", "get_weather") in out
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in out


BAD = [
    ({"tools": [WEATHER], "functions": [TIME["function"]]}, "functions"),
    ({"functions": []}, "functions"),
    ({"functions": {"name": "f"}}, "functions"),
    ({"functions": [{"name": ""}]}, "functions[0].name"),
    ({"functions": [{"name": "f", "type": "function"}]}, "functions[0].type"),
    ({"functions": [{"name": "f"}, {"name": "f"}]}, "functions[1].name"),
    ({"functions": [{"name": "f", "parameters": []}]}, "functions[0].parameters"),
    ({"functions": [{"name": "f"}], "function_call": {"name": "g"}}, "function_call.name"),
    ({"functions": [{"name": "f"}], "function_call": "required"}, "function_call"),
    ({"functions": [{"name": "f"}], "function_call": "auto", "tool_choice": "auto"}, "function_call"),
    ({"function_call": "auto"}, "function_call"),
    ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].name"),
    ({"messages": [{"role": "user", "content": "x", "function_call": {"name": "f"}}]}, "messages[0].function_call"),
    ({"messages": [{"role": "assistant", "function_call": {"name": "f", "arguments": {}}}]},
     "messages[0].function_call.arguments"),
    ({"messages": [{"role": "assistant", "function_call": {"arguments": "{}"}}]}, "messages[0].function_call.name"),
    ({"messages": [{"role": "assistant", "function_call": {"name": "f"}, "tool_calls": CALLED["tool_calls"]}]},
     "messages[0].function_call"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[p for _, p in BAD])
def test_bad_function_fields_are_400_naming_the_field(body, param):
    with pytest.raises(RequestError) as info:
        parse(**body)
    assert info.value.status == 400 and info.value.param == param


# ---- the real default model ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol(smol_server):
    """A server with SmolLM2 (its template has no tools branch): the run's shared one (server_util.SMOL)."""
    return smol_server


def prompt_tokens(srv, messages: list[dict], **body) -> int:
    """The prompt's token count, from one greedy token of the answer."""
    from server_util import SMOL_KEY

    r = srv.post("/v1/chat/completions", {"model": "smol", "messages": messages, "max_tokens": 1,
                                          "temperature": 0, **body}, key=SMOL_KEY)
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


@pytest.mark.real
def test_real_smollm2_prompt_holds_the_tools_block(smol):
    plain = prompt_tokens(smol, [ASK])
    with_tools = prompt_tokens(smol, [ASK], tools=[WEATHER, TIME])
    assert with_tools > plain + 100  # two JSON definitions and the instructions (the default system prompt goes)
    assert prompt_tokens(smol, [ASK], tools=[WEATHER, TIME], tool_choice="none") == plain
    only_time = {"type": "function", "function": {"name": "get_time"}}
    assert plain < prompt_tokens(smol, [ASK], tools=[WEATHER, TIME], tool_choice=only_time) < with_tools
    # the deprecated form renders the same prompt
    assert prompt_tokens(smol, [ASK], functions=[WEATHER["function"], TIME["function"]]) == with_tools


@pytest.mark.real
def test_real_smollm2_prompt_holds_history_calls_and_results(smol):
    asked = prompt_tokens(smol, [ASK, {"role": "assistant", "content": ""}], tools=[WEATHER])
    called = prompt_tokens(smol, [ASK, CALLED], tools=[WEATHER])
    assert called > asked + 10  # the call is in the assistant turn, not dropped
    answered = prompt_tokens(smol, [ASK, CALLED, RESULT], tools=[WEATHER])
    longer = prompt_tokens(smol, [ASK, CALLED, {**RESULT, "content": "18 C, sunny, light wind from the west"}],
                           tools=[WEATHER])
    assert answered > called and longer > answered  # the result's own text reaches the prompt
