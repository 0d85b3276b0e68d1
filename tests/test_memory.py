"""Memory watch and request admission (pantheon.runtime.memory) on constructed snapshots: no model, no JAX."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import pytest

from conftest import wait_until
from pantheon.runtime import memory
from pantheon.errors import BusyError
from pantheon.types import ModelGeometry
from pantheon.runtime.memory import (
    CAPPED,
    CRITICAL,
    DENIED,
    ELEVATED,
    FIT,
    HIGH,
    OK,
    Admission,
    MemSnapshot,
    MemWatch,
    PoolSample,
    admit,
    cap_messages,
    level_for,
)

GiB = 1024 ** 3


def host(used_frac: float, total: int = 100 * GiB) -> PoolSample:
    return PoolSample("host", total, int(total * used_frac), "given")


def snap(used_frac: float, total: int = 100 * GiB, dies: tuple[PoolSample, ...] = ()) -> MemSnapshot:
    return MemSnapshot(host=host(used_frac, total), dies=dies, taken_at=time.monotonic())


def fake_model(bpt: int = 1024 * 1024, max_seq: int = 4096, per_seq: int = 0, dies=(0,), platform: str = "cpu"):
    """An unsized geometry: just what admission reads of a model that only knows its state bytes/token,
    max_seq, dies (+ a hybrid's per-sequence state)."""
    return ModelGeometry(max_seq=max_seq, state_bytes_per_token=bpt, state_bytes_per_sequence=per_seq,
                         dies=tuple(dies), platform=platform)


# ---- pressure levels -----------------------------------------------------------------------------
def test_level_thresholds():
    assert [level_for(f) for f in (0.0, 0.79, 0.80, 0.89, 0.90, 0.969, 0.97, 1.0)] == \
        [OK, OK, ELEVATED, ELEVATED, HIGH, HIGH, CRITICAL, CRITICAL]


def test_snapshot_pressure_is_the_tightest_measured_pool():
    die_hot = PoolSample("die:1", 10 * GiB, int(9.8 * GiB), "memory_stats", True, 1)
    die_ledger = PoolSample("die:2", 10 * GiB, 10 * GiB, "budget", False, 2)  # ledger: shown, not pressure
    s = snap(0.5, dies=(die_hot, die_ledger))
    assert s.pressure() == CRITICAL
    assert s.pressure([2]) == OK  # the host (0.5) and a ledger-only die
    assert s.pressure([0]) == OK
    assert snap(0.91).pressure() == HIGH
    d = s.as_dict()
    assert d["pressure"] == "CRITICAL" and d["dies"][1]["measured"] is False


# ---- admission outcomes ------------------------------------------------------------------------
def test_fit_when_memory_and_window_allow():
    a = admit(fake_model(), 1000, snap(0.5))
    assert a == Admission(FIT, 1000, "fits", 4096, OK)
    assert a.fit and not a.capped and not a.denied


def test_capped_by_free_memory_gives_fit_tokens():
    # 100 GiB host, 95 GiB used -> 5 GiB free - 3 GiB reserve (the slice above 0.97) ~ 2 GiB ~ 2048 tokens.
    s = snap(0.95)
    a = admit(fake_model(bpt=1024 * 1024, max_seq=100000), 3000, s)
    expected = (s.host.free_bytes - s.host.reserve_bytes()) // (1024 * 1024)
    assert 2040 <= expected <= 2048
    assert a.outcome == CAPPED and a.fit_tokens == expected and "free memory on host" in a.reason
    assert a.pressure == HIGH and a.window == 50000  # HIGH also halved the window (not the limit here)


def test_capped_by_window_and_reserve_tokens():
    a = admit(fake_model(bpt=16, max_seq=1024), 5000, snap(0.1), reserve_tokens=200)
    assert a.outcome == CAPPED and a.fit_tokens == 1024 - 200
    assert "context window" in a.reason


def test_denied_when_almost_nothing_fits():
    a = admit(fake_model(bpt=1024 * 1024), 3000, snap(0.968))  # 3.2 GiB free, 3 GiB reserve
    assert a.outcome == DENIED
    with pytest.raises(BusyError) as exc:
        a.raise_if_denied()
    assert exc.value.status == 503 and exc.value.retry_after == 5
    admit(fake_model(), 10, snap(0.1)).raise_if_denied()  # FIT: no raise


def test_denied_under_critical():
    assert admit(fake_model(bpt=1), 10, snap(0.99)).outcome == DENIED


def test_per_sequence_recurrent_bytes_are_charged():
    free_after_reserve = 100 * GiB - int(0.5 * 100 * GiB) - -(-3 * 100 * GiB // 100)
    m = fake_model(bpt=1024, per_seq=free_after_reserve)  # the recurrent state eats everything
    assert admit(m, 10, snap(0.5)).outcome == DENIED
    assert admit(fake_model(bpt=1024, per_seq=GiB), 10, snap(0.5)).outcome == FIT


def test_measured_die_limits_a_device_model_and_sharding_splits_the_charge():
    die = PoolSample("die:0", 16 * GiB, 15 * GiB, "memory_stats", True, 0)  # 1 GiB free, 0.48 GiB reserve
    s = snap(0.99, dies=(die,))  # the host is full, but a GPU model's state is not in host RAM ...
    gpu = fake_model(bpt=1024 * 1024, max_seq=100000, platform="gpu")
    a = admit(gpu, 100000, s, min_tokens=1)
    assert a.outcome == CAPPED  # ... though host CRITICAL still clamps the window (ladder)
    one = (1 * GiB - -(-3 * 16 * GiB // 100)) // (1024 * 1024)
    assert a.fit_tokens == min(one, 50000)
    die1 = PoolSample("die:1", 16 * GiB, 15 * GiB, "memory_stats", True, 1)
    s2 = snap(0.1, dies=(die, die1))
    two = admit(fake_model(bpt=1024 * 1024, max_seq=100000, dies=(0, 1), platform="gpu"), 100000, s2, min_tokens=1)
    assert two.fit_tokens == 2 * one  # half the bytes per token on each die


def test_ladder_halves_the_window_under_high_pressure_and_logs(caplog):
    memory._ladder_logged_at = 0.0
    with caplog.at_level(logging.WARNING, logger="pantheon.runtime.memory"):
        a = admit(fake_model(bpt=1, max_seq=16384), 10000, snap(0.92))
    assert a.window == 8192 and a.outcome == CAPPED and a.fit_tokens == 8192
    assert "[ladder] HIGH -> prefill window clamped 16384 -> 8192" in caplog.text
    assert admit(fake_model(bpt=1, max_seq=16384), 10000, snap(0.85)).window == 16384  # ELEVATED: no clamp


# ---- the watch ---------------------------------------------------------------------------------
def test_fail_open_when_memwatch_not_running():
    memory.stop_memwatch()
    assert not memory.memwatch_running()
    a = admit(fake_model(bpt=10 ** 12), 10 ** 6)
    assert a.outcome == FIT and a.fit_tokens == 10 ** 6 and "fails open" in a.reason
    w = MemWatch(host_reader=lambda: host(0.99))
    assert w.snapshot() is None and w.pressure() == OK  # not started
    assert admit(fake_model(bpt=10 ** 12), 100, watch=w).outcome == FIT


def test_memwatch_thread_samples_and_swaps_snapshots():
    readings = iter([0.5, 0.85, 0.93] + [0.99] * 1000)
    w = MemWatch(host_reader=lambda: host(next(readings)), interval_s=0.02)
    try:
        w.start()
        assert w.running and w.pressure() == OK  # the first sample is taken synchronously
        first = w.snapshot()
        wait_until(lambda: w.pressure() == CRITICAL, 30, "the sampler to reach the CRITICAL reading")
        assert w.snapshot() is not first and first.host.used_fraction == 0.5  # immutable, swapped whole
        assert w.pressure_fn()() == CRITICAL
        assert admit(fake_model(bpt=1), 10, watch=w).outcome == DENIED
    finally:
        w.stop()
    assert not w.running and w.snapshot() is None and w.pressure() == OK


def test_memwatch_reads_dies_from_the_ledger():
    from pantheon.serving.dies import Die, DieManager
    dm = DieManager([Die(0, 1000), Die(1, 1000)])
    dm.bind("a", "m", [1], 400)
    w = MemWatch(dm, host_reader=lambda: host(0.1))
    s = w.sample()
    assert [(d.die, d.total_bytes, d.used_bytes, d.source, d.measured) for d in s.dies] == \
        [(0, 1000, 0, "budget", False), (1, 1000, 400, "budget", False)]


def test_global_start_stop():
    w = memory.start_memwatch(interval_s=0.05)
    try:
        assert memory.memwatch() is w and memory.memwatch_running()
        assert memory.start_memwatch() is w  # idempotent
        assert 0 <= w.pressure() <= CRITICAL
    finally:
        memory.stop_memwatch()
    assert memory.memwatch() is None


# ---- capping a conversation ----------------------------------------------------------------------
def words(messages: list[dict]) -> int:
    """A stand-in tokenizer: 2 tokens of framing per message + one per word."""
    return sum(2 + len(str(m.get("content") or "").split()) for m in messages)


def conv(n_turns: int) -> list[dict]:
    msgs = [{"role": "system", "content": "be brief and kind"}]  # 6 tokens
    for i in range(n_turns):
        msgs.append({"role": "user", "content": f"question {i} " + "x " * 8})  # 12
        msgs.append({"role": "assistant", "content": f"answer {i} " + "y " * 8})  # 12
    msgs.append({"role": "user", "content": "the last question please"})  # 6
    return msgs


def test_cap_messages_noop_when_it_fits():
    msgs = conv(2)
    out, capped = cap_messages(msgs, words, 1000)
    assert out == msgs and capped is False


def test_cap_messages_drops_oldest_turns_keeps_system_and_last_user():
    msgs = conv(5)  # 6 + 5 * 24 + 6 = 132 tokens
    out, capped = cap_messages(msgs, words, 60)
    assert capped and words(out) <= 60
    assert out[0] == msgs[0] and out[-1] == msgs[-1]
    assert out[1]["role"] == "user"  # the kept history starts at a turn boundary
    assert out[1:-1] == msgs[-1 - (len(out) - 2):-1]  # the most recent turns, contiguous
    assert len(out) == 2 + 2 * 2  # 6 + 2 * 24 + 6 = 60: exactly two turns fit


def test_cap_messages_never_orphans_tool_results():
    msgs = [{"role": "system", "content": "s"},
            {"role": "user", "content": "u " * 10},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]},
            {"role": "tool", "content": "t " * 10, "tool_call_id": "1"},
            {"role": "assistant", "content": "a " * 10},
            {"role": "user", "content": "last"}]
    out, capped = cap_messages(msgs, words, 20)
    assert capped and all(m.get("role") != "tool" for m in out)
    assert out[0]["role"] == "system" and out[-1]["content"] == "last"


def test_cap_messages_shortens_system_then_user_only_when_unavoidable():
    msgs = [{"role": "system", "content": " ".join(f"s{i}" for i in range(50))},
            {"role": "user", "content": "old " * 20},
            {"role": "assistant", "content": "ok"},
            {"role": "user", "content": " ".join(f"u{i}" for i in range(10))}]
    out, capped = cap_messages(msgs, words, 30)  # history gone, system cut to fit, user whole
    assert capped and words(out) <= 30 and len(out) == 2
    assert out[1] == msgs[-1] and out[0]["content"].startswith("s0 s1")
    out, capped = cap_messages(msgs, words, 8)  # not even the user message fits whole: keep its tail
    assert capped and words(out) <= 8 and len(out) == 1
    assert out[0]["role"] == "user" and out[0]["content"].endswith("u9")


def test_cap_messages_accepts_id_lists():
    msgs = conv(3)
    out, capped = cap_messages(msgs, lambda m: [0] * words(m), 40)
    assert capped and words(out) <= 40 and out[-1] == msgs[-1]


# ---- what a request adds (issue 22: spurious 503s) -------------------------------------------------
MiB = 1024 ** 2


def smollm_like(platform: str = "cpu", dies=(0,)) -> ModelGeometry:
    """A geometry admission can size: SmolLM2-135M's config and the engine's default buckets."""
    from pantheon.formats.gguf_loader import ModelConfig
    cfg = ModelConfig(arch="llama", n_layers=30, hidden=576, n_heads=9, n_kv_heads=3, head_dim=64, ffn=1536,
                      vocab=49152, rms_eps=1e-5, rope_base=1e5, n_rot=64, rope_type="norm", context_length=8192,
                      attn_scale=0.125)
    return ModelGeometry(max_seq=2048, n_slots=8, chunk=128, capacity=2176, chunk_buckets=(32, 64, 96, 128),
                         span_buckets=(128, 256, 512, 1024, 2176), hidden=cfg.hidden, head_dim=cfg.head_dim,
                         n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, vocab=cfg.vocab,
                         ffn=max(cfg.ffn, cfg.n_experts_used * cfg.expert_ffn) + cfg.n_experts,
                         state_bytes_per_token=cfg.kv_bytes_per_token, dies=tuple(dies), platform=platform)


def free_snap(free_after_reserve: int, total: int = 100 * GiB) -> MemSnapshot:
    """The host with exactly `free_after_reserve` bytes above admission's reserve (HIGH pressure)."""
    reserve = PoolSample("host", total, 0, "given").reserve_bytes()
    return MemSnapshot(host=PoolSample("host", total, total - reserve - free_after_reserve, "given"),
                       taken_at=time.monotonic())


def test_request_is_charged_what_it_adds_not_its_kv_cache():
    m = smollm_like()
    kv = m.state_bytes_per_token  # 46080 bytes a token, already allocated in every slot
    # The case: 20 prompt tokens + 256 reserved for the answer, a few MiB free. Their KV
    # (276 x 45 KiB = 12 MiB) does not fit, but what the request adds does.
    s = free_snap(6 * MiB)
    assert (20 + 256) * kv > 6 * MiB
    a = admit(m, 20, s, reserve_tokens=256)
    assert a.outcome == FIT and a.fit_tokens == 20 and a.pressure == HIGH
    assert memory.request_bytes(m, 20, 256) < 3 * MiB
    # A long prompt (within the window HIGH pressure halves to 1024): 1000 tokens of KV are 44 MiB;
    # 40 MiB free holds its 128-token chunk's activations and its host copies (about 25 MiB).
    s = free_snap(40 * MiB)
    a = admit(m, 1000, s, reserve_tokens=24)
    assert a.outcome == FIT and a.window == 1024
    assert 1000 * kv > 40 * MiB > memory.request_bytes(m, 1000, 24)


def test_request_is_refused_when_even_what_it_adds_does_not_fit():
    m = smollm_like()
    s = free_snap(1 * MiB)  # less than one step's activations
    a = admit(m, 20, s, reserve_tokens=256)
    assert a.outcome == DENIED and "free memory on host" in a.reason
    with pytest.raises(BusyError) as exc:
        a.raise_if_denied()
    assert exc.value.status == 503
    assert memory.request_bytes(m, 20, 256) > 1 * MiB


def test_what_a_request_adds_grows_with_its_chunk_and_caps_long_prompts():
    m = smollm_like()
    short, full = memory.request_bytes(m, 20), memory.request_bytes(m, 2000)
    assert short < full
    assert memory.activation_bytes(m, 2000) == memory.activation_bytes(m, 1900)  # both: one full chunk
    # Room for the short prompt's activations only: a long prompt is capped to what fits, not denied.
    room = memory.request_bytes(m, 500, 32)
    a = admit(m, 2000, free_snap(room), reserve_tokens=32, min_tokens=8)
    assert a.outcome == CAPPED and 8 <= a.fit_tokens <= 2000
    assert memory.request_bytes(m, a.fit_tokens, 32) <= room < memory.request_bytes(m, a.fit_tokens + 1, 32)


def test_ladder_still_applies_to_a_sized_model():
    m = smollm_like()
    assert admit(m, 10, snap(0.99)).outcome == DENIED  # CRITICAL: 503 whatever the request adds
    memory._ladder_logged_at = 0.0
    a = admit(m, 1500, snap(0.92))  # HIGH: plenty of bytes, but the window is halved to 1024
    assert a.window == 1024 and a.outcome == CAPPED and a.fit_tokens == 1024
    assert admit(m, 1500, snap(0.5)).outcome == FIT


def test_a_device_model_is_charged_its_activations_on_its_die_split_when_sharded():
    m = smollm_like(platform="gpu")
    act = memory.activation_bytes(m, 1000)
    die = PoolSample("die:0", 16 * GiB, 16 * GiB - PoolSample("d", 16 * GiB, 0, "given").reserve_bytes() - act // 2,
                     "memory_stats", True, 0)
    s = snap(0.1, dies=(die,))  # the die is at HIGH (window 1024): a 1000-token prompt, one full chunk
    assert admit(m, 1000, s).outcome != FIT  # one die: the chunk's activations do not fit
    die1 = PoolSample("die:1", die.total_bytes, die.used_bytes, "memory_stats", True, 1)
    two = smollm_like(platform="gpu", dies=(0, 1))
    assert admit(two, 1000, snap(0.1, dies=(die, die1))).outcome == FIT  # halved over two dies
