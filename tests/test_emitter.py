"""Specification of the streaming output emitter (pantheon.text.emitter).

The emitter splits detokenized fragments into reasoning, content and tool calls and applies stop strings.
Every rule must hold however the text is split into fragments, so most tests feed the same text both
whole and cut at every position and compare.
"""

from __future__ import annotations

import json
import re
from typing import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pantheon.text.emitter import (
    THINK_CLOSE,
    THINK_OPEN,
    TOOL_CLOSE,
    TOOL_OPEN,
    Delta,
    Emitter,
    merge_deltas,
    new_tool_call_id,
    parse_tool_call,
)

ID_RE = re.compile(r"^call_[A-Za-z0-9]{24}$")


def run(fragments: Sequence[str], **kwargs) -> tuple[Emitter, list[Delta]]:
    """Feed fragments then finish; returns the emitter and every delta in order."""
    em = Emitter(**kwargs)
    deltas: list[Delta] = []
    for f in fragments:
        deltas += em.feed(f)
    deltas += em.finish()
    return em, deltas


def merged(fragments: Sequence[str], **kwargs) -> dict:
    """Merged message without the random tool-call ids, so runs can be compared."""
    _, deltas = run(fragments, **kwargs)
    msg = merge_deltas(deltas)
    if msg["tool_calls"]:
        msg["tool_calls"] = [{k: v for k, v in c.items() if k != "id"} for c in msg["tool_calls"]]
    return msg


def splits2(text: str):
    """Every way of cutting `text` into three fragments (two cut points, empty fragments included)."""
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1):
            yield [text[:i], text[i:j], text[j:]]


def call(name: str, arguments: object) -> str:
    return TOOL_OPEN + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + TOOL_CLOSE


# -- content and reasoning --------------------------------------------------------------------------------


def test_plain_content_streams_without_delay():
    em = Emitter()
    assert em.feed("Hello") == [Delta("content", "Hello")]
    assert em.feed(", world") == [Delta("content", ", world")]
    assert em.finish() == []
    assert (em.content, em.reasoning, em.stopped, em.tool_calls) == ("Hello, world", "", False, [])
    assert em.finish_reason is None


def test_think_block_is_reasoning_and_tags_are_swallowed():
    msg = merged(["\n<think>\nLet me see.</think>\n\nThe answer is 4."])
    assert msg == {"content": "The answer is 4.", "reasoning_content": "\nLet me see.", "tool_calls": None}


def test_content_leading_whitespace_stripped_only_after_think_close():
    assert merged(["  hi"])["content"] == "  hi"
    assert merged(["<think>r</think>", "\n", "\n ", " hi \n"])["content"] == "hi \n"


def test_in_think_starts_in_reasoning():
    em, deltas = run(["reasoning", " more</think>", "\n\nanswer"], in_think=True)
    assert [d.kind for d in deltas] == ["reasoning", "reasoning", "content"]
    assert (em.reasoning, em.content) == ("reasoning more", "answer")


def test_in_think_tolerates_repeated_open_tag():
    assert merged(["<think>r</think>a"], in_think=True) == merged(["r</think>a"], in_think=True)


def test_unterminated_reasoning_stays_reasoning():
    assert merged(["<think>still thinking <"]) == {
        "content": "",
        "reasoning_content": "still thinking <",
        "tool_calls": None,
    }


def test_think_tag_not_at_start_is_dropped_not_reasoning():
    # Reasoning only opens at the very start; a later tag is stray and removed.
    assert merged(["Hi <think>x</think> there"]) == {"content": "Hi x there", "reasoning_content": None,
                                                       "tool_calls": None}


def test_stray_think_markers_inside_reasoning_are_dropped():
    assert merged(["<think>a<think>b</think>c"], ) == {"content": "c", "reasoning_content": "ab",
                                                        "tool_calls": None}


def test_marker_removal_is_single_pass():
    # Documented limitation: a marker formed only by cutting another marker out of its middle stays.
    assert merged(["x<th</think>ink>"])["content"] == "x<think>"


def test_parse_think_false_keeps_tags_as_content():
    text = "<think>a</think>b"
    assert merged([text], parse_think=False, in_think=True) == {"content": text, "reasoning_content": None,
                                                                 "tool_calls": None}


@pytest.mark.parametrize("in_think", [False, True])
def test_think_markers_split_at_every_position(in_think):
    text = " <think>r1 <b> r2</think>\n\nc1 </thi c2"
    expected = merged([text], in_think=in_think)
    assert expected["content"] == "c1 </thi c2"
    for frags in splits2(text):
        assert merged(frags, in_think=in_think) == expected, frags


def test_carry_held_only_while_it_can_still_match():
    em = Emitter()
    em.feed("x")
    assert em.feed("a</th") == [Delta("content", "a")]  # "</th" may still become "</think>"
    assert em.feed("e") == [Delta("content", "</the")]  # ...and now cannot
    assert em.feed("<") == []
    assert em.finish() == [Delta("content", "<")]  # the end releases any carry


def test_start_waits_only_for_a_possible_open_tag():
    em = Emitter()
    assert em.feed("\n ") == []
    assert em.feed("<th") == []
    assert em.feed("e") == [Delta("content", "\n <the")]


# -- tool calls ---------------------------------------------------------------------------------------------


def test_single_tool_call():
    em, deltas = run([call("get_weather", {"city": "Zürich"})], tools_enabled=True)
    (d,) = deltas
    assert d.kind == "tool_call"
    assert d.tool_call["index"] == 0 and d.tool_call["type"] == "function"
    assert ID_RE.match(d.tool_call["id"])
    assert d.tool_call["function"] == {"name": "get_weather", "arguments": '{"city": "Zürich"}'}
    assert em.tool_calls == [{k: v for k, v in d.tool_call.items() if k != "index"}]
    assert em.finish_reason == "tool_calls"
    msg = merge_deltas(deltas)
    assert msg["content"] is None and msg["tool_calls"] == em.tool_calls


def test_several_tool_calls_after_reasoning_with_whitespace_between():
    text = ("<think>need two</think>\n\n" + call("a", {"x": 1}) + "\n" + call("b", "{\"y\": 2}") + "\n")
    for frags in splits2(text):
        em, deltas = run(frags, tools_enabled=True)
        msg = merge_deltas(deltas)
        assert msg["content"] is None and msg["reasoning_content"] == "need two"
        assert [c["function"] for c in msg["tool_calls"]] == [
            {"name": "a", "arguments": '{"x": 1}'},
            {"name": "b", "arguments": '{"y": 2}'},  # a string is kept exactly as written
        ]
        assert [d.tool_call["index"] for d in deltas if d.kind == "tool_call"] == [0, 1]


def test_tool_call_after_text_and_missing_arguments():
    msg = merged(["Let me check.\n", TOOL_OPEN, '{"name": "now"}', TOOL_CLOSE], tools_enabled=True)
    assert msg == {"content": "Let me check.\n", "reasoning_content": None,
                   "tool_calls": [{"type": "function", "function": {"name": "now", "arguments": "{}"}}]}


def test_tool_call_delta_carries_raw_body():
    body = ' {"name": "f", "arguments": {}} '
    _, deltas = run([TOOL_OPEN + body + TOOL_CLOSE], tools_enabled=True)
    assert deltas[0].text == body


@pytest.mark.parametrize("body", ['{"name": "f", "arguments": {', '{"arguments": {}}', '{"name": ""}',
                                  '["f"]', 'not json', '{"name": "f", "arguments": 3}'])
def test_malformed_tool_call_is_kept_verbatim_as_content(body):
    text = "pre " + TOOL_OPEN + body + TOOL_CLOSE + " post"
    em, deltas = run([text], tools_enabled=True)
    assert em.tool_calls == [] and em.finish_reason is None
    assert merge_deltas(deltas) == {"content": text, "reasoning_content": None, "tool_calls": None}


def test_unterminated_tool_call_is_released_as_content_at_finish():
    em = Emitter(tools_enabled=True)
    assert em.feed("ok " + TOOL_OPEN + '{"name": "f"') == [Delta("content", "ok ")]
    assert em.finish() == [Delta("content", TOOL_OPEN + '{"name": "f"')]


def test_think_markers_dropped_from_failed_tool_call_text():
    em, _ = run([TOOL_OPEN + "x</think>y" + TOOL_CLOSE + TOOL_OPEN + "<think>z"], tools_enabled=True)
    assert em.content == TOOL_OPEN + "xy" + TOOL_CLOSE + TOOL_OPEN + "z"


def test_tools_disabled_means_tool_call_is_content():
    text = call("f", {})
    assert merged([text]) == {"content": text, "reasoning_content": None, "tool_calls": None}


def test_tool_call_inside_reasoning_is_reasoning():
    text = "<think>I could " + call("f", {}) + "</think>"
    assert merged([text], tools_enabled=True)["reasoning_content"] == "I could " + call("f", {})


def test_tool_call_ids_are_unique_and_well_formed():
    ids = {new_tool_call_id() for _ in range(2000)}
    assert len(ids) == 2000 and all(ID_RE.match(i) for i in ids)
    em, _ = run([call("f", {})] * 20, tools_enabled=True)
    assert len({c["id"] for c in em.tool_calls}) == 20


def test_parse_tool_call_arguments_unicode_not_escaped():
    parsed = parse_tool_call('{"name": "f", "arguments": {"q": "日本"}}')
    assert parsed is not None and parsed["function"]["arguments"] == '{"q": "日本"}'


# -- bare JSON tool calls (tool_names given) ------------------------------------------------------------------

NAMES = ("get_weather", "f")
BARE = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
WEATHER_CALL = {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}


@pytest.mark.parametrize("text", [
    BARE, "\n  " + BARE + "\n", "```json\n" + BARE + "\n```", "```\n" + BARE + "\n```\n", "``` JSON \n" + BARE + "```",
    "```json\n" + BARE + "\n",  # the closing fence never came: the answer ended
])
def test_a_whole_answer_that_is_a_bare_or_fenced_call_is_a_tool_call(text):
    for frags in splits2(text):
        em, deltas = run(frags, tools_enabled=True, tool_names=NAMES)
        assert merge_deltas_without_ids(deltas) == {"content": None, "reasoning_content": None,
                                                    "tool_calls": [WEATHER_CALL]}
        assert "".join(d.text for d in deltas).strip() == text.strip()  # the raw text, fences included
        assert em.finish_reason == "tool_calls"


def merge_deltas_without_ids(deltas: list[Delta]) -> dict:
    msg = merge_deltas(deltas)
    if msg["tool_calls"]:
        msg["tool_calls"] = [{k: v for k, v in c.items() if k != "id"} for c in msg["tool_calls"]]
    return msg


@pytest.mark.parametrize("text", [
    '{"name": "delete_everything", "arguments": {}}',  # not a declared tool
    '{"answer": 42}', '{"name": "f", "arguments": 3}', "{not json}", "[1, 2]",
    "```python\nprint(1)\n```", "```json\n[1]\n```", "```json\n" + BARE + " and more\n```",
    BARE[:-1],  # unterminated at the end
])
def test_json_that_is_not_a_declared_call_is_content_verbatim(text):
    for frags in splits2(text):
        em, deltas = run(frags, tools_enabled=True, tool_names=NAMES)
        assert em.tool_calls == [] and em.content == text


def test_bare_calls_need_tool_names_and_tools_enabled():
    assert merged([BARE], tools_enabled=True)["content"] == BARE
    assert merged([BARE], tool_names=NAMES)["content"] == BARE


def test_prose_and_code_are_held_only_until_they_cannot_be_a_call():
    em = Emitter(tools_enabled=True, tool_names=NAMES)
    assert em.feed("  ") == []  # leading whitespace might lead into a call
    assert em.feed("Hi") == [Delta("content", "  Hi")]
    em = Emitter(tools_enabled=True, tool_names=NAMES)
    assert em.feed("```py") == [Delta("content", "```py")]
    em = Emitter(tools_enabled=True, tool_names=NAMES)
    assert em.feed('{"answer": 4') == [Delta("content", '{"answer": 4')]  # its first key is not a call's
    em = Emitter(tools_enabled=True, tool_names=NAMES)
    assert em.feed('{"name": "get_weather", "argu') == []


def test_bare_call_after_reasoning_and_several_in_a_row():
    text = "<think>weather</think>\n" + BARE + "\n" + '{"name": "f"}' + "\nDone."
    for frags in splits2(text):
        em, deltas = run(frags, tools_enabled=True, tool_names=NAMES)
        msg = merge_deltas_without_ids(deltas)
        assert msg["reasoning_content"] == "weather" and msg["content"] == "Done."
        assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather", "f"]


def test_json_later_in_an_answer_is_content():
    text = "Here: " + BARE
    assert merged([text], tools_enabled=True, tool_names=NAMES)["content"] == text


def test_text_after_a_closed_call_is_content():
    for text in (BARE + "\nThat is all.", "```json\n" + BARE + "\n```\nThat is all."):
        msg = merged([text], tools_enabled=True, tool_names=NAMES)
        assert msg["tool_calls"] == [WEATHER_CALL] and msg["content"] == "That is all."


def test_a_bare_call_is_not_content_so_stops_do_not_cut_it():
    msg = merged([BARE + " rest"], tools_enabled=True, tool_names=NAMES, stop=["Paris", "rest"])
    assert msg["tool_calls"] == [WEATHER_CALL] and msg["content"] is None


# -- stop strings ------------------------------------------------------------------------------------------


def test_stop_string_cuts_and_later_input_is_ignored():
    em = Emitter(stop=["END"])
    assert em.feed("abc EN") == [Delta("content", "abc ")]
    assert em.feed("D more") == []
    assert em.stopped and em.finish_reason == "stop"
    assert em.feed("anything") == []
    assert em.finish() == []
    assert em.content == "abc "


@pytest.mark.parametrize("stop", ["\n\n", "STOP", "x", "ü!"])
def test_stop_split_at_every_position_never_leaks(stop):
    text = "<think>STOP x ü! \n\n</think>Here ü is a text\n x STOP ü! \n\n tail"
    cut = text.index("</think>") + len("</think>")
    content = text[cut:]
    expected = content[: content.index(stop)]
    for frags in splits2(text):
        em, deltas = run(frags, stop=[stop])
        assert em.stopped
        assert em.content == expected
        assert all(stop not in d.text for d in deltas if d.kind == "content")


def test_stop_inside_reasoning_does_not_stop():
    em, _ = run(["<think>we must STOP here?</think>", "Answer"], stop=["STOP"])
    assert not em.stopped and em.reasoning == "we must STOP here?" and em.content == "Answer"


def test_stop_prefix_released_when_it_diverges_or_at_finish():
    em = Emitter(stop=["<|end|>"])
    assert em.feed("a <|e") == [Delta("content", "a ")]
    assert em.feed("x") == [Delta("content", "<|ex")]
    assert em.feed(" <|en") == [Delta("content", " ")]
    assert em.finish() == [Delta("content", "<|en")]
    assert not em.stopped and em.finish_reason is None


def test_earliest_of_several_stops_wins():
    em, _ = run(["one two three"], stop=["three", "two", "", "e tw"])
    assert em.content == "on" and em.stopped


def test_stop_matches_visible_content_across_removed_markers_and_tool_calls():
    em, _ = run(["ST</think>OP"], stop=["STOP"])
    assert em.content == "" and em.stopped
    # Everything from the start of the stop string on is cut, including a tool call inside it.
    em, deltas = run(["ST", call("f", {}), "OP tail"], stop=["STOP"], tools_enabled=True)
    assert em.stopped and em.content == "" and em.tool_calls == [] and deltas == []


def test_tool_call_after_held_stop_prefix_waits_and_keeps_order():
    em = Emitter(stop=["STOP"], tools_enabled=True)
    assert em.feed("ok ST") == [Delta("content", "ok ")]
    assert em.feed(call("f", {})) == []  # "ST" might still begin a stop string spanning the call
    out = em.feed("ay")
    assert [(d.kind, d.text) for d in out] == [("content", "ST"), ("tool_call", '{"name": "f", "arguments": {}}'),
                                               ("content", "ay")]
    assert em.finish() == [] and em.finish_reason == "tool_calls"


def test_tool_call_before_stop_is_kept():
    em, _ = run([call("f", {}) + "STOP"], stop=["STOP"], tools_enabled=True)
    assert em.stopped and len(em.tool_calls) == 1
    assert em.finish_reason == "tool_calls"  # calls made take precedence, as in OpenAI


def test_stop_does_not_apply_inside_tool_call_body():
    em, _ = run([call("say", {"text": "STOP"})], stop=["STOP"], tools_enabled=True)
    assert not em.stopped and len(em.tool_calls) == 1


def test_malformed_tool_call_content_is_subject_to_stops():
    em, _ = run([TOOL_OPEN + "bad STOP" + TOOL_CLOSE], stop=["STOP"], tools_enabled=True)
    assert em.stopped and em.content == TOOL_OPEN + "bad "


def test_feed_after_finish_is_an_error():
    em = Emitter()
    em.finish()
    with pytest.raises(RuntimeError):
        em.feed("x")


def test_merge_deltas_empty_answer():
    assert merge_deltas([]) == {"content": "", "reasoning_content": None, "tool_calls": None}


# -- property: streamed == non-streamed, nothing leaks, nothing is lost -------------------------------------

STOPS = ["STOP", "aa", "<|end|>", "\n\n", "é!"]
TOOL_BODIES = [
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    '{"name": "f", "arguments": "{\\"x\\": 1}"}',
    '{"name": "g", "arguments": {"s": "STOP é"}}',
    '{"name": ',
    '{"arguments": {}}',
    "not json",
]
# No piece starts with the tail of a marker (such as "ink>"), so no marker can be formed by removing
# another marker from its middle; see test_marker_removal_is_single_pass for that documented limitation.
PIECES = (
    [THINK_OPEN, THINK_CLOSE, TOOL_OPEN, TOOL_CLOSE, "</th", "<thi", "<tool_", "</tool_c", "<", "</"]
    + STOPS + ["ST", "a", "<|en", "é"]
    + TOOL_BODIES + [TOOL_OPEN + b + TOOL_CLOSE for b in TOOL_BODIES]
    + ["hello", " ", "\n", "日本語", "🙂", "x y"]
    + ["```", "```json\n", "`", "{", "}", '{"name": "f"}']  # bare and fenced calls (with tool_names)
)


@st.composite
def scenario(draw):
    text = "".join(draw(st.lists(st.sampled_from(PIECES), max_size=12)))
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=8)))
    fragments = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    kwargs = dict(
        stop=draw(st.lists(st.sampled_from(STOPS), max_size=4, unique=True)),
        in_think=draw(st.booleans()),
        tools_enabled=draw(st.booleans()),
        parse_think=draw(st.booleans()),
        tool_names=draw(st.sampled_from([(), ("get_weather", "f")])),
    )
    return text, fragments, kwargs


def sequence(deltas: list[Delta]) -> list[tuple[str, str]]:
    """Deltas as (kind, text) with adjacent text of one kind joined: the split-independent output order."""
    out: list[tuple[str, str]] = []
    for d in deltas:
        if d.kind != "tool_call" and out and out[-1][0] == d.kind:
            out[-1] = (d.kind, out[-1][1] + d.text)
        else:
            out.append((d.kind, d.text))
    return out


def normalized(text: str) -> str:
    """Text without tool-call tags and whitespace: what must survive the emitter unchanged."""
    return "".join(text.replace(TOOL_OPEN, "").replace(TOOL_CLOSE, "").split())


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenario())
def test_property_streaming_is_exact(case):
    text, fragments, kwargs = case
    em, deltas = run(fragments, **kwargs)
    whole_em, whole = run([text], **kwargs)

    # (a) streamed == non-streamed
    strip_ids = lambda msg: {**msg, "tool_calls": msg["tool_calls"] and [
        {k: v for k, v in c.items() if k != "id"} for c in msg["tool_calls"]]}
    msg = merge_deltas(deltas)
    assert strip_ids(msg) == strip_ids(merge_deltas(whole))
    assert (em.stopped, em.content, em.reasoning) == (whole_em.stopped, whole_em.content, whole_em.reasoning)
    assert em.content == (msg["content"] or "") and em.reasoning == (msg["reasoning_content"] or "")
    assert em.tool_calls == (msg["tool_calls"] or [])
    assert sequence(deltas) == sequence(whole)  # even the interleaving of channels is the same

    # no empty deltas; tool calls well formed with unique ids and consecutive indices
    assert all(d.text for d in deltas if d.kind != "tool_call")
    calls = [d.tool_call for d in deltas if d.kind == "tool_call"]
    assert [c["index"] for c in calls] == list(range(len(calls)))
    assert len({c["id"] for c in calls}) == len(calls) and all(ID_RE.match(c["id"]) for c in calls)
    assert all(isinstance(c["function"]["arguments"], str) for c in calls)
    if not kwargs["tools_enabled"]:
        assert not calls

    # (b) no stop string in content, no think marker anywhere
    for stop in kwargs["stop"]:
        assert stop not in em.content
    if kwargs["parse_think"]:
        for out in [em.content, em.reasoning] + [d.text for d in deltas]:
            assert THINK_OPEN not in out and THINK_CLOSE not in out

    # (c) nothing lost: every input character is in reasoning, content or a tool-call body (in order), up
    # to the stop; only think markers, tool-call tags and whitespace may disappear.
    source = text.replace(THINK_OPEN, "").replace(THINK_CLOSE, "") if kwargs["parse_think"] else text
    produced = normalized("".join(d.text for d in deltas))
    if em.stopped:
        assert normalized(source).startswith(produced)
    else:
        assert produced == normalized(source)


# ---- a tool call cut by the token limit (issue 31, item 12) ------------------------------------------------------
def cut_run(text: str, **kwargs) -> tuple[Emitter, list[Delta]]:
    """`text` fed in one-character fragments, then finish(cut=True): generation hit max_tokens there."""
    em = Emitter(**kwargs)
    deltas: list[Delta] = []
    for ch in text:
        deltas += em.feed(ch)
    return em, deltas + em.finish(cut=True)


FULL_CALL = TOOL_OPEN + '\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n' + TOOL_CLOSE


@pytest.mark.parametrize("cut_at", range(1, len(FULL_CALL) + 1))
def test_a_call_cut_anywhere_never_leaks_its_syntax_into_content(cut_at):
    """Forced (`calls_only`): whatever the cut, the content is empty and the call, once its block opened,
    is the partial call with finish_reason "length"."""
    em, deltas = cut_run(FULL_CALL[:cut_at], tools_enabled=True, tool_names=["get_weather"], calls_only=True)
    msg = merge_deltas(deltas)
    assert not msg["content"]
    if cut_at < len(TOOL_OPEN):
        assert msg["tool_calls"] is None and em.finish_reason is None  # no call began: the caller says "length"
        return
    (got,) = msg["tool_calls"]
    assert ID_RE.match(got["id"]) and got["type"] == "function"
    assert "get_weather".startswith(got["function"]["name"])
    assert em.finish_reason == ("tool_calls" if cut_at == len(FULL_CALL) else "length")


def test_a_cut_call_keeps_its_name_and_the_arguments_written_so_far():
    em, deltas = cut_run(TOOL_OPEN + '{"name": "get_weather", "arguments": {"city": "Par', tools_enabled=True)
    msg = merge_deltas(deltas)
    assert msg["content"] is None and em.finish_reason == "length"
    assert [c["function"] for c in msg["tool_calls"]] == [{"name": "get_weather", "arguments": '{"city": "Par'}]
    # Cut inside the name: the name so far, no arguments yet.
    _, deltas = cut_run(TOOL_OPEN + '{"name": "get_wea', tools_enabled=True)
    assert merge_deltas(deltas)["tool_calls"][0]["function"] == {"name": "get_wea", "arguments": ""}
    # A complete first call, the second cut: both returned, the finish is "length".
    em, deltas = cut_run(call("a", {}) + "\n" + TOOL_OPEN + '{"name": "b", "arguments": {"x": [1, 2', tools_enabled=True)
    assert [c["function"] for c in merge_deltas(deltas)["tool_calls"]] == [
        {"name": "a", "arguments": "{}"}, {"name": "b", "arguments": '{"x": [1, 2'}]
    assert em.finish_reason == "length"


def test_an_auto_call_cut_after_its_tag_is_a_partial_call_and_text_before_stays_content():
    em, deltas = cut_run("Let me check.\n" + TOOL_OPEN + '{"name": "get_weather", "arg', tools_enabled=True,
                         tool_names=["get_weather"])
    msg = merge_deltas(deltas)
    assert msg["content"] == "Let me check.\n" and em.finish_reason == "length"
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}


def test_a_bare_call_cut_after_its_declared_name_is_a_partial_call():
    em, deltas = cut_run('```json\n{"name": "get_weather", "arguments": {"city": "Pa', tools_enabled=True,
                         tool_names=["get_weather"])
    msg = merge_deltas(deltas)
    assert msg["content"] is None and em.finish_reason == "length"
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Pa'}
    # A name that is not a declared tool's, or one not complete yet: it may be ordinary JSON, kept as content.
    for text in ('{"name": "other", "arguments": {"a', '{"name": "get_wea'):
        em, deltas = cut_run(text, tools_enabled=True, tool_names=["get_weather"])
        assert merge_deltas(deltas) == {"content": text, "reasoning_content": None, "tool_calls": None}


def test_without_a_cut_an_unterminated_block_is_still_content():
    """End of turn (not the token limit) inside a block: nothing says the model meant a call; kept verbatim."""
    em, deltas = run([TOOL_OPEN + '{"name": "f"'], tools_enabled=True)
    assert merge_deltas(deltas)["content"] == TOOL_OPEN + '{"name": "f"' and em.finish_reason is None
