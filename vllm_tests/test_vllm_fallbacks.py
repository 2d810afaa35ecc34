"""D's fallbacks through vLLM: requests D computes itself are counted by reason and P engine,
reach vLLM's log line and /metrics, and are warned of at most once per interval; prompts
below `kv_recompute_threshold` are not transferred."""

from __future__ import annotations

import logging
import time

import jax
import test_vllm_connector
from test_vllm_connector import _prompt, assert_prompt_kv, decode, scheduled_tokens
from test_vllm_metrics import LABELS, _registry_metric_types, _stats_of

from kvxfer.vllm import TPUConnector
from kvxfer.vllm.fallbacks import Fallbacks, counter_name

pd = test_vllm_connector.pd  # the P/D pair fixture


def test_requests_sent_to_d_without_params_are_counted_and_reach_metrics(model_dir, engines,
                                                                           caplog):
    """What a router that falls back silently does (vllm-router, when P returns no params):
    D computes the prompt; each such request is counted once, the warning is rate-limited."""
    d = engines(model_dir, kv_role="kv_consumer", extra_config={"staging_blocks": 8},
                devices=jax.devices()[:1], log_stats=True)
    steps = []
    with caplog.at_level(logging.WARNING, logger="kvxfer.vllm.fallbacks"):
        for req_id in ("a", "b", "c"):
            d.add_request(req_id, _prompt(40, 30), max_tokens=3)  # no kv_transfer_params
            steps += d.run_until(lambda r, req_id=req_id: req_id in r.finished, max_steps=100)
    assert scheduled_tokens(steps, "a") == (0, 30 + 2)  # D computed the whole prompt
    stats = _stats_of(steps)
    assert stats.data["counters"][counter_name("no_params", "none")] == 3
    assert stats.reduce()["Fallback no_params (D)"] == 3  # vLLM's periodic log line
    warnings = [r.getMessage() for r in caplog.records if r.name == "kvxfer.vllm.fallbacks"]
    assert len(warnings) == 1 and "no kv_transfer_params from P" in warnings[0], warnings
    registry, types = _registry_metric_types()
    prom = TPUConnector.build_prom_metrics(d.vllm_config, types, LABELS, {0: ["m", "0"]})
    prom.observe(stats.data)
    assert registry.get_sample_value("vllm:kvxfer_num_fallbacks_total", {
        "model_name": "m", "engine": "0", "reason": "no_params", "p_engine": "none"}) == 3


def test_below_the_threshold_d_computes_the_prompt_at_it_d_loads_it(pd):
    p, d = pd(d=dict(log_stats=True, extra={"kv_recompute_threshold": 40}))
    below, at = _prompt(41, 39), _prompt(42, 40)
    params = p.prefill("below", below)
    steps = decode(d, "below-d", below, params)
    assert scheduled_tokens(steps, "below-d") == (0, 39 + 1)  # D computed all of it
    engine = params["peer"]
    got = _stats_of(steps).data["counters"]
    assert got[counter_name("below_threshold", engine)] == 1 and "d_requests_ok" not in got
    # P lets go of the staging D will not read at once (D cancels P's lease), not at lease end.
    deadline = time.monotonic() + 10
    while p.call(p.engine.connector.has_pending_push_work):
        assert time.monotonic() < deadline, "P still holds what D chose not to read"
        time.sleep(0.01)

    other = _prompt(43, 40)  # P's params of one prompt, sent with another of the same length
    steps = decode(d, "other-d", other, p.prefill("other", _prompt(44, 40)))
    assert scheduled_tokens(steps, "other-d")[0] == 0
    assert _stats_of(steps).data["counters"][counter_name("other_prompt", engine)] == 1

    steps = decode(d, "at-d", at, p.prefill("at", at))
    assert scheduled_tokens(steps, "at-d")[0] == 39  # loaded from P
    got = _stats_of(steps).data["counters"]
    assert got["d_requests_ok"] == 1 and not any(k.startswith("d_fallback_") for k in got)
    assert_prompt_kv(d, "at-d", at)


def test_warnings_are_rate_limited_per_reason_and_p_engines_bounded(caplog):
    now = [0.0]
    fallbacks = Fallbacks(warn_interval_s=60.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="kvxfer.vllm.fallbacks"):
        for i in range(100):
            fallbacks.count("load_failed", f"P{i}", f"r{i}", "its KV load failed")
        fallbacks.count("below_threshold", "P0", "t", "3 tokens")  # another reason: warned
        now[0] = 61.0
        fallbacks.count("load_failed", "P0", "late", "its KV load failed")
    messages = [r.getMessage() for r in caplog.records if r.name == "kvxfer.vllm.fallbacks"]
    assert len(messages) == 3
    assert "'load_failed' since this reason's last warning: 100" in messages[2]  # 99 unwarned
    assert fallbacks.counters[counter_name("load_failed", "P0")] == 2
    assert fallbacks.counters[counter_name("load_failed", "other")] == 100 - 64  # bounded labels
    fallbacks.arrived("x", None)
    fallbacks.arrived("x", {"do_remote_prefill": False})  # the same request again: once
    fallbacks.arrived("y", {"do_remote_prefill": True, "peer": "P0"})  # asks D to load
    assert fallbacks.counters[counter_name("no_params", "none")] == 1
