"""What the second adversarial run found (issue 31), each as a specification the web layer now meets.

In-process (Flask's test client on the fake backend of test_web_app: one character, one token), so
each rule is checked without a model: the tokenizer routes, the cache scope's encoding, what is
size-checked before tokenizing, the bound on echoed prompt log probabilities, transfer codings, and
forced tool calls cut by `max_tokens`. Work that must leave the event loop is recognised by the name
of the OS thread it runs in (`pantheon.web.bridge.call_in_thread` names each one).
"""

from __future__ import annotations

import itertools
import threading

import pytest

from pantheon.web.chat import cache_scope, parse_chat_request
from test_web_app import HELLO, backend, chat, registry_app, sse  # noqa: F401  (fixtures below)
from test_web_app import app_and_reg, client  # noqa: F401  (pytest fixtures)


# ---- item 8: the cache scope is an unambiguous encoding of its parts ------------------------------------------
def _scope(key: str | None = None, **fields: str) -> str:
    return cache_scope(key, parse_chat_request({"messages": HELLO, **fields}, {}))


def test_cache_scopes_of_different_parts_never_coincide():
    # The pair: with separator bytes these two hashed the same bytes and shared a prefix cache.
    assert _scope(user="x\u0000\u0001y") != _scope(user="x", session_id="y\u0000")
    # And any other split of the same characters over the four parts.
    texts = [None, "", "x", "\u0000", "\u0001", "x\u0000", "\u0000\u0001y", "y\u0000", "x\u0000\u0001y"]
    seen: dict[str, tuple] = {}
    for key, user, session, salt in itertools.product(texts, repeat=4):
        fields = {k: v for k, v in (("user", user), ("session_id", session), ("cache_salt", salt)) if v is not None}
        scope = _scope(key, **fields)
        assert seen.setdefault(scope, (key, user, session, salt)) == (key, user, session, salt)


# ---- item 11: a transfer coding other than plain chunked is refused --------------------------------------------
@pytest.mark.parametrize("coding", ["gzip, chunked", "deflate,chunked", "chunked, chunked", "identity"])
def test_a_body_in_another_transfer_coding_is_501_and_never_read(client, app_and_reg, coding):
    before = backend(app_and_reg[1]).last_request
    r = client.post("/v1/chat/completions", data=b'{"messages": [{"role": "user", "content": "hi"}]}',
                    headers={"Content-Type": "application/json", "Transfer-Encoding": coding})
    assert r.status_code == 501, r.get_data(as_text=True)
    err = r.get_json()["error"]
    assert err["code"] == "unsupported_transfer_coding" and err["type"] == "invalid_request_error"
    assert backend(app_and_reg[1]).last_request is before  # nothing ran


def test_a_plainly_chunked_body_is_still_taken(client):
    r = client.post("/v1/chat/completions", data=b'{"messages": [{"role": "user", "content": "hi"}]}',
                    headers={"Content-Type": "application/json", "Transfer-Encoding": "Chunked"})
    assert r.status_code == 200, r.get_data(as_text=True)
