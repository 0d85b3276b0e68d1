"""`pantheon.serving.metrics`: the exposition parses, event counters move, scrape-time callbacks feed gauges."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pantheon.serving.metrics import MAX_ROUTES, Metrics


def scrape(m: Metrics) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} of one render, which must parse as Prometheus text."""
    body, ctype = m.render()
    assert ctype.startswith("text/plain")
    out = {}
    for fam in text_string_to_metric_families(body.decode("utf-8")):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict, name: str, **labels) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


def test_empty_render_parses():
    s = scrape(Metrics())
    assert value(s, "pantheon_jax_compilations_total") is not None
    assert value(s, "pantheon_scrape_errors_total") == 0


def test_two_instances_do_not_collide():
    a, b = Metrics(), Metrics()
    a.observe_request("/", 200)
    assert value(scrape(a), "pantheon_http_requests_total", route="/", status="200") == 1
    assert value(scrape(b), "pantheon_http_requests_total", route="/", status="200") is None


def test_event_counters_move():
    m = Metrics()
    m.observe_request("/v1/chat/completions", 200)
    m.observe_request("/v1/chat/completions", 200)
    m.observe_request("/v1/chat/completions", 429)
    m.add_tokens("tiny", 12, 5)
    m.add_tokens("tiny", 3, 0)
    m.observe_admission("fit")
    m.observe_admission("capped")
    m.observe_admission("bogus")
    m.observe_rejection(429)
    m.observe_rejection("503")
    m.disconnect("tiny")
    s = scrape(m)
    assert value(s, "pantheon_http_requests_total", route="/v1/chat/completions", status="200") == 2
    assert value(s, "pantheon_http_requests_total", route="/v1/chat/completions", status="429") == 1
    assert value(s, "pantheon_prompt_tokens_total", model="tiny") == 15
    assert value(s, "pantheon_generation_tokens_total", model="tiny") == 5
    assert value(s, "pantheon_admissions_total", outcome="fit") == 1
    assert value(s, "pantheon_admissions_total", outcome="capped") == 1
    assert value(s, "pantheon_admissions_total", outcome="other") == 1
    assert value(s, "pantheon_rejections_total", status="429") == 1
    assert value(s, "pantheon_rejections_total", status="503") == 1
    assert value(s, "pantheon_client_disconnects_total", model="tiny") == 1


def test_histograms_bucket_latencies():
    m = Metrics()
    m.observe_ttft("tiny", 0.003)
    m.observe_ttft("tiny", 0.2)
    m.observe_itl("tiny", 0.02)
    m.observe_e2e("tiny", 130.0)  # beyond the last bucket: only +Inf
    m.observe_queue("tiny", -1.0)  # clock skew never makes a negative observation
    s = scrape(m)
    assert value(s, "pantheon_time_to_first_token_seconds_count", model="tiny") == 2
    assert value(s, "pantheon_time_to_first_token_seconds_bucket", model="tiny", le="0.005") == 1
    assert value(s, "pantheon_time_to_first_token_seconds_bucket", model="tiny", le="120.0") == 2
    assert value(s, "pantheon_inter_token_latency_seconds_sum", model="tiny") == pytest.approx(0.02)
    assert value(s, "pantheon_e2e_request_latency_seconds_bucket", model="tiny", le="120.0") == 0
    assert value(s, "pantheon_e2e_request_latency_seconds_bucket", model="tiny", le="+Inf") == 1
    assert value(s, "pantheon_queue_time_seconds_sum", model="tiny") == 0


def test_route_labels_are_bounded():
    m = Metrics()
    for i in range(MAX_ROUTES + 10):
        m.observe_request(f"/r{i}", 404)
    m.observe_request(None, 404)
    s = scrape(m)
    routes = {dict(k[1])["route"] for k in s if k[0] == "pantheon_http_requests_total"}
    assert len(routes) == MAX_ROUTES + 1 and "other" in routes
    assert value(s, "pantheon_http_requests_total", route="other", status="404") == 11


def test_backend_source_feeds_gauges_and_counters():
    info = {"mode": "batch", "slots": 8, "running": 2, "queued": 3, "prefix_hits": 4, "prefix_misses": 1,
            "reused_tokens": 100, "rejected_full": 2, "rejected_timeout": 1, "steps": 9}
    state = {"rows": [("tiny", dict(info)), ("tiny", dict(info, running=1)), ("solo", {"mode": "single",
                                                                                     "running": 1, "queued": 0})]}
    m = Metrics()
    m.set_backend_source(lambda: state["rows"])
    s = scrape(m)
    assert value(s, "pantheon_running_requests", model="tiny") == 3  # replicas are summed
    assert value(s, "pantheon_queued_requests", model="tiny") == 6
    assert value(s, "pantheon_batch_slots", model="tiny") == 16
    assert value(s, "pantheon_running_requests", model="solo") == 1
    assert value(s, "pantheon_prefix_cache_hits_total", model="tiny") == 8
    assert value(s, "pantheon_prefix_cache_misses_total", model="tiny") == 2
    assert value(s, "pantheon_prefix_cache_reused_tokens_total", model="tiny") == 200
    assert value(s, "pantheon_prefix_cache_hits_total", model="solo") is None
    assert value(s, "pantheon_scheduler_rejections_total", model="tiny", reason="queue_full") == 4
    assert value(s, "pantheon_scheduler_rejections_total", model="tiny", reason="queue_timeout") == 2
    state["rows"] = [("tiny", dict(info, prefix_hits=10))]  # read again at every scrape
    assert value(scrape(m), "pantheon_prefix_cache_hits_total", model="tiny") == 10


def test_die_source_and_failing_callbacks():
    m = Metrics()
    m.set_die_source(lambda: [{"id": 0, "budget_bytes": 1000, "used_bytes": 250},
                              {"die": 1, "budget_bytes": 2000, "used_bytes": 0}])
    s = scrape(m)
    assert value(s, "pantheon_die_budget_bytes", die="0") == 1000
    assert value(s, "pantheon_die_used_bytes", die="0") == 250
    assert value(s, "pantheon_die_budget_bytes", die="1") == 2000

    def boom():
        raise RuntimeError("registry gone")

    m.set_die_source(boom)
    m.set_backend_source(boom)
    m.observe_request("/", 200)
    s = scrape(m)  # still renders the rest
    assert value(s, "pantheon_http_requests_total", route="/", status="200") == 1
    assert value(s, "pantheon_scrape_errors_total") == 2
    assert value(s, "pantheon_die_budget_bytes", die="0") is None


def test_compile_count_is_reported():
    from pantheon.runtime import compile_guard

    s = scrape(Metrics())
    assert value(s, "pantheon_jax_compilations_total") == compile_guard.compile_count()
