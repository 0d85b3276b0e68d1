"""Issue 32: the APIs agents speak, through their official SDKs on a live server with the real default model
(smollm2-135m): OpenAI's Responses API (`openai` responses.create / .stream / .parse, function tools,
previous_response_id with the prefix cache, the response store and its key isolation, the `openai-agents`
Runner) and Anthropic's Messages API (`anthropic` messages.create / .stream, system prompts, tool_use /
tool_result, stop_sequences, count_tokens, errors in Anthropic's shape), and the two chat/completions gaps
(a list of prompts on /v1/completions, malformed tool-call arguments in a history). Forced tool calls go through the
grammar path, which the 135M model follows; it is never asked to call a tool on its own.

The validators and the answer shapes on a scripted backend are covered by tests/test_openapi.py (the fuzz
of the published document) and tests/test_agent_apis_shapes.py.
"""

from __future__ import annotations

import asyncio
import json

import anthropic
import openai
import pydantic
import pytest
import requests

from server_util import SMOL_KEY

pytestmark = pytest.mark.real

MODEL = "smol"
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}}
T0 = {"temperature": 0}  # the anthropic SDK has no sampling arguments any more; the route still takes them
A_WEATHER = {"name": "get_weather", "description": "Get the current weather in a city",
             "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


@pytest.fixture(scope="module")
def srv(smol_server):
    return smol_server  # shared; nothing here changes it


@pytest.fixture(scope="module")
def oai(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key=SMOL_KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def claude(srv):
    return anthropic.Anthropic(base_url=srv.url, api_key=SMOL_KEY, max_retries=0, timeout=300)


# ---- OpenAI Responses --------------------------------------------------------------------------------------------
def test_responses_create_and_stream_give_the_same_text_at_temperature_0(oai):
    kw = dict(model=MODEL, instructions="You are a helpful assistant.", input="Name three colours of the rainbow.",
              temperature=0, max_output_tokens=24, store=False)
    r = oai.responses.create(**kw)
    assert r.status in ("completed", "incomplete") and r.output_text.strip()
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    types = []
    with oai.responses.stream(**kw) as stream:
        deltas = []
        for ev in stream:
            types.append(ev.type)
            if ev.type == "response.output_text.delta":
                deltas.append(ev.delta)
        final = stream.get_final_response()
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types[-1] == "response.completed"
    assert "response.output_item.added" in types and "response.output_item.done" in types
    assert "".join(deltas) == final.output_text == r.output_text


def test_responses_input_items_and_max_output_tokens(oai):
    r = oai.responses.create(model=MODEL, input=[
        {"role": "developer", "content": "Answer in one word."},
        {"role": "user", "content": [{"type": "input_text", "text": "What colour is the sky?"}]}],
        temperature=0, max_output_tokens=2, store=False)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 2


class Person(pydantic.BaseModel):
    name: str
    age: int


@pytest.mark.parametrize("stream", [False, True])
def test_responses_parse_with_a_pydantic_model(oai, stream):
    kw = dict(model=MODEL, input="Give me a person as JSON with a name and an age.", text_format=Person,
              temperature=0, max_output_tokens=60, store=False)
    if stream:
        with oai.responses.stream(**kw) as s:
            for _ in s:
                pass
            parsed = s.get_final_response().output_parsed
    else:
        parsed = oai.responses.parse(**kw).output_parsed
    assert isinstance(parsed, Person) and isinstance(parsed.age, int)


def test_responses_json_object_format(oai):
    r = oai.responses.create(model=MODEL, input='Give a JSON object with the keys "name" and "age" of a person.',
                             text={"format": {"type": "json_object"}}, temperature=0, max_output_tokens=60,
                             store=False)
    assert isinstance(json.loads(r.output_text), dict)


@pytest.mark.parametrize("stream", [False, True])
def test_responses_forced_function_call_and_its_result(oai, stream):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model=MODEL, tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
              temperature=0, max_output_tokens=60, store=False)
    if stream:
        arg_deltas = []
        with oai.responses.stream(input=ask, **kw) as s:
            for ev in s:
                if ev.type == "response.function_call_arguments.delta":
                    arg_deltas.append(ev.delta)
            r = s.get_final_response()
    else:
        r = oai.responses.create(input=ask, **kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    args = json.loads(calls[0].arguments)
    assert set(args) == {"city"} and isinstance(args["city"], str)
    if stream:
        assert "".join(arg_deltas) == calls[0].arguments
    # The round trip: the call and its output go back as items; the model answers in text.
    follow = ask + [{"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
                     "arguments": calls[0].arguments},
                    {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 24 C"}]
    r2 = oai.responses.create(model=MODEL, input=follow, tools=[WEATHER], tool_choice="none", temperature=0,
                              max_output_tokens=30, store=False)
    assert r2.output_text.strip() and not [o for o in r2.output if o.type == "function_call"]


def test_previous_response_id_continues_the_conversation_from_the_prefix_cache(oai):
    turns = ["My name is Ada. Say hello.", "What is two plus two?", "What is my name?"]
    prev, cached = None, []
    for text in turns:
        r = oai.responses.create(model=MODEL, instructions="You are a friendly assistant.", input=text,
                                 previous_response_id=prev, temperature=0, max_output_tokens=16)
        assert r.previous_response_id == prev
        cached.append(r.usage.input_tokens_details.cached_tokens)
        prev = r.id
    assert cached[1] > 0 and cached[2] > 0, cached
    assert cached[2] > cached[1], "the third turn reuses the second turn's conversation too"


def test_a_stored_response_is_read_back_and_deleted_and_only_by_its_key(oai, srv):
    r = oai.responses.create(model=MODEL, input="Say yes.", temperature=0, max_output_tokens=4)
    got = oai.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text
    other = openai.OpenAI(base_url=srv.url + "/v1", api_key="another-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError):  # the server's key is required at all
        other.responses.retrieve(r.id)
    oai.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model=MODEL, input="And?", previous_response_id=r.id, max_output_tokens=2)


def test_store_false_keeps_nothing(oai):
    r = oai.responses.create(model=MODEL, input="Say yes.", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(r.id)


def test_built_in_tools_are_refused_with_a_400_naming_them(oai):
    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model=MODEL, input="Search the web.", tools=[{"type": "web_search"}])
    assert err.value.body["param"] == "tools[0].type"


def test_the_openai_agents_runner_calls_a_function_tool_then_answers_in_its_output_type(srv):
    """The Agents SDK's loop: a forced tool call, the tool's result sent back, a typed final answer.

    The agent has an output type, so every turn carries a JSON-schema `text.format` and the first one also
    `tool_choice: "required"`: the forced call constrains that turn and the format the answer after it (the
    Runner resets tool_choice to auto once the tool ran). The format is also what bounds the 135M model's
    last turn: in free text it echoes the tool's random call id back and may run past any token budget,
    which the SDK reports as an error (`response.incomplete`)."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        answer: str = Field(max_length=80)

    set_tracing_disabled(True)
    seen = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        seen.append(city)
        return f"It is sunny in {city}."

    client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key=SMOL_KEY, max_retries=0, timeout=300)
    agent = Agent(name="weather", instructions="Answer questions about the weather.", tools=[get_weather],
                  output_type=Weather, model=OpenAIResponsesModel(model=MODEL, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, temperature=0,
                                               max_tokens=160))
    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=4))
    assert seen == ["Paris"]  # called once, with the city the grammar let the model write
    assert [type(i).__name__ for i in result.new_items] == ["ToolCallItem", "ToolCallOutputItem", "MessageOutputItem"]
    assert isinstance(result.final_output, Weather) and result.final_output.answer.strip()


# ---- Anthropic Messages ------------------------------------------------------------------------------------------
def test_messages_create_and_stream_give_the_same_text_at_temperature_0(claude):
    kw = dict(model=MODEL, max_tokens=24, system="You are a helpful assistant.", extra_body=T0,
              messages=[{"role": "user", "content": "Name three colours of the rainbow."}])
    m = claude.messages.create(**kw)
    assert m.type == "message" and m.role == "assistant" and m.stop_reason in ("end_turn", "max_tokens")
    text = "".join(b.text for b in m.content if b.type == "text")
    assert text.strip() and m.usage.output_tokens > 0 and m.usage.input_tokens > 0
    with claude.messages.stream(**kw) as s:
        streamed = "".join(s.text_stream)
        final = s.get_final_message()
    assert streamed == text == "".join(b.text for b in final.content if b.type == "text")
    assert final.stop_reason == m.stop_reason and final.usage.output_tokens == m.usage.output_tokens


def test_messages_system_blocks_and_prefix_cache_reads(claude):
    kw = dict(model=MODEL, max_tokens=4, extra_body=T0,
              system=[{"type": "text", "text": "You are a terse assistant who answers in one word."}],
              messages=[{"role": "user", "content": [{"type": "text", "text": "Colour of grass?"}]}])
    claude.messages.create(**kw)
    m = claude.messages.create(**kw)
    assert m.usage.cache_read_input_tokens > 0  # the same prompt again: read from the prefix cache
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens > m.usage.cache_read_input_tokens


def test_messages_stop_sequences(claude):
    free = claude.messages.create(model=MODEL, max_tokens=30, extra_body=T0,
                                  messages=[{"role": "user", "content": "Count from one to ten in words."}])
    text = free.content[0].text
    words = text.split()
    assert len(words) > 3, text
    stop = words[2]
    m = claude.messages.create(model=MODEL, max_tokens=30, extra_body=T0, stop_sequences=[stop],
                               messages=[{"role": "user", "content": "Count from one to ten in words."}])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert m.content[0].text == text[:text.index(stop)]


@pytest.mark.parametrize("stream", [False, True])
def test_messages_forced_tool_use_and_tool_result(claude, stream):
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model=MODEL, max_tokens=60, tools=[A_WEATHER], extra_body=T0,
              tool_choice={"type": "tool", "name": "get_weather"})
    if stream:
        with claude.messages.stream(messages=ask, **kw) as s:
            m = s.get_final_message()
    else:
        m = claude.messages.create(messages=ask, **kw)
    assert m.stop_reason == "tool_use"
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and isinstance(uses[0].input.get("city"), str)
    follow = ask + [{"role": "assistant", "content": m.content},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                                  "content": "Sunny, 24 C"}]}]
    m2 = claude.messages.create(model=MODEL, max_tokens=30, tools=[A_WEATHER], extra_body=T0,
                                tool_choice={"type": "none"}, messages=follow)
    assert m2.stop_reason in ("end_turn", "max_tokens") and m2.content[0].type == "text"


def test_messages_any_tool_choice_forces_a_call(claude):
    m = claude.messages.create(model=MODEL, max_tokens=60, tools=[A_WEATHER], extra_body=T0,
                               tool_choice={"type": "any"},
                               messages=[{"role": "user", "content": "Weather in Rome?"}])
    assert m.stop_reason == "tool_use" and any(b.type == "tool_use" for b in m.content)


def test_count_tokens_is_the_prompt_a_message_takes(claude):
    kw = dict(model=MODEL, system="Be brief.", messages=[{"role": "user", "content": "Hello there!"}])
    n = claude.messages.count_tokens(**kw).input_tokens
    m = claude.messages.create(max_tokens=1, **kw)
    assert n == m.usage.input_tokens + m.usage.cache_read_input_tokens


def test_errors_are_in_anthropics_shape(claude, srv):
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model=MODEL, max_tokens=10, messages=[{"role": "robot", "content": "hi"}])
    assert err.value.body["type"] == "error"
    assert err.value.body["error"]["type"] == "invalid_request_error"
    assert "messages[0].role" in err.value.body["error"]["message"]
    bad_key = anthropic.Anthropic(base_url=srv.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as err:
        bad_key.messages.create(model=MODEL, max_tokens=10, messages=[{"role": "user", "content": "hi"}])
    assert err.value.body["error"]["type"] == "authentication_error"
    r = requests.post(srv.url + "/v1/messages", json={"model": MODEL, "messages": []},
                      headers={"Authorization": f"Bearer {SMOL_KEY}"}, timeout=30)  # Bearer works too
    assert r.status_code == 400 and r.json()["type"] == "error"


def test_the_model_root_serves_both_routes(srv):
    headers = {"x-api-key": SMOL_KEY}
    r = requests.post(srv.url + f"/m/{MODEL}/v1/messages", headers=headers, timeout=120,
                      json={"max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200 and r.json()["model"] == MODEL
    r = requests.post(srv.url + f"/m/{MODEL}/v1/responses", headers=headers, timeout=120,
                      json={"max_output_tokens": 2, "input": "hi", "store": False})
    assert r.status_code == 200 and r.json()["model"] == MODEL


def test_the_new_routes_are_counted_in_the_metrics(srv):
    text = requests.get(srv.url + "/metrics", headers={"Authorization": f"Bearer {SMOL_KEY}"}, timeout=30).text
    assert 'route="/v1/responses"' in text and 'route="/v1/messages"' in text


# ---- chat/completions gaps -----------------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
def test_a_list_of_prompts_is_one_choice_per_prompt_and_n(oai, stream):
    prompts = ["The capital of France is", "One, two, three,"]
    alone = [oai.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0).choices[0].text
             for p in prompts]
    kw = dict(model=MODEL, prompt=prompts, max_tokens=6, temperature=0, n=2)
    texts: dict[int, str] = {}
    if stream:
        for chunk in oai.completions.create(stream=True, **kw):
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
    else:
        r = oai.completions.create(**kw)
        assert [c.index for c in r.choices] == [0, 1, 2, 3]
        texts = {c.index: c.text for c in r.choices}
    assert [texts[i] for i in range(4)] == [alone[0], alone[0], alone[1], alone[1]]


def test_a_malformed_arguments_string_in_the_history_is_a_400_naming_it(oai):
    history = [{"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
                   "name": "get_weather", "arguments": "{\"city\": \"Par"}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "Sunny"}]
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model=MODEL, messages=history, max_tokens=4)
    assert err.value.body["param"] == "messages[1].tool_calls[0].function.arguments"
