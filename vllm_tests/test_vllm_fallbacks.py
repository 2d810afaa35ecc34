"""D's fallbacks through vLLM: requests D computes itself are counted by reason and P engine
(named only once D's worker completed a handshake with it), reach vLLM's log line and
/metrics, and are warned of at most once per interval; prompts below
`kv_recompute_threshold` are not transferred."""

from __future__ import annotations

import logging
import time
from types import SimpleNamespace

import jax
import pytest
import test_vllm_connector
from engine import listen_port
from test_vllm_connector import _prompt, assert_prompt_kv, decode, scheduled_tokens
from test_vllm_metrics import LABELS, _registry_metric_types, _stats_of
from vllm.v1.outputs import KVConnectorOutput

from kvxfer.errors import InvalidInputError
from kvxfer.vllm import TPUConnector
from kvxfer.vllm.connector import _WorkerSide
from kvxfer.vllm.fallbacks import LOCAL, Fallbacks, counter_name
from kvxfer.vllm.reports import VERIFIED_PER_REPORT, WorkerReport

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
    # Decided before D ever connected to that P: its name, from the params, is not verified.
    assert got[counter_name("below_threshold", "unverified")] == 1 and "d_requests_ok" not in got
    # P lets go of the staging D will not read at once (D cancels P's lease), not at lease end.
    deadline = time.monotonic() + 10
    while p.call(p.engine.connector.has_pending_push_work):
        assert time.monotonic() < deadline, "P still holds what D chose not to read"
        time.sleep(0.01)

    steps = decode(d, "at-d", at, p.prefill("at", at))
    assert scheduled_tokens(steps, "at-d")[0] == 39  # loaded from P
    got = _stats_of(steps).data["counters"]
    assert got["d_requests_ok"] == 1 and not any(k.startswith("d_fallback_") for k in got)
    assert_prompt_kv(d, "at-d", at)
    assert engine in d.connector._scheduler.fallbacks._verified  # D's worker reported it

    other = _prompt(43, 40)  # P's params of one prompt, sent with another of the same length
    steps = decode(d, "other-d", other, p.prefill("other", _prompt(44, 40)))
    assert scheduled_tokens(steps, "other-d")[0] == 0
    assert _stats_of(steps).data["counters"][counter_name("other_prompt", engine)] == 1
    # D will never read them: P lets go of that staging at once too, not at its lease's end
    deadline = time.monotonic() + 10
    while p.call(p.engine.connector.has_pending_push_work):
        assert time.monotonic() < deadline, "P still holds what D refused as another prompt's"
        time.sleep(0.01)


def test_warnings_are_rate_limited_per_reason_and_p_engines_bounded(caplog):
    now = [0.0]
    fallbacks = Fallbacks(warn_interval_s=60.0, clock=lambda: now[0])
    fallbacks.verified(f"P{i}" for i in range(100))  # D's workers connected to all of them
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
    # a kv_both instance's prefills for a peer (a lookup, P's work with a source): neither
    fallbacks.arrived("z", {"do_remote_decode": True})
    fallbacks.arrived("w", {"do_remote_decode": True, "kv_source": {"num_prompt_tokens": 9}})
    assert fallbacks.counters[counter_name("no_params", "none")] == 1 and LOCAL not in fallbacks.counters


def test_made_up_p_names_in_clients_params_count_as_unverified_not_as_labels(model_dir, engines):
    """Before, the first 64 names any client sent took every label for the process's life."""
    d = engines(model_dir, kv_role="kv_consumer", extra_config={"staging_blocks": 8},
                devices=jax.devices()[:1], log_stats=True)
    steps = []
    for i in range(100):
        prompt = _prompt(50 + i, 20)
        d.add_request(f"r{i}", prompt, max_tokens=1, kv_transfer_params={
            "do_remote_prefill": True, "peer": f"made-up-{i}", "num_prompt_tokens": 7})
        steps += d.run_until(lambda r, i=i: f"r{i}" in r.finished, max_steps=100)
    got = {k: n for k, n in _stats_of(steps).data["counters"].items() if "fallback" in k}
    assert got == {counter_name("other_prompt", "unverified"): 100}


def test_a_load_failed_on_the_step_its_handshake_completed_names_its_p(model_dir, engines):
    """The worker's report of a step comes with that step's failed loads: the P agents it
    names are learned first."""
    d = engines(model_dir, kv_role="kv_consumer", extra_config={"port": listen_port()})
    fallbacks = d.connector._scheduler.fallbacks
    for req_id, peer in (("r", "real-p"), ("s", "made-up")):
        fallbacks.loading(req_id, {"peer": peer})
    d.connector.update_connector_output(KVConnectorOutput(
        finished_recving={"r", "s"}, failed_recving={"r", "s"},
        kv_connector_worker_meta=WorkerReport({}, verified=("real-p",))))
    assert fallbacks.counters == {counter_name("load_failed", "real-p"): 1,
                                  counter_name("load_failed", "unverified"): 1}


def test_a_d_worker_reports_each_p_agent_it_connected_to_once_a_few_a_step():
    names = [f"p{i}" for i in range(2 * VERIFIED_PER_REPORT + 3)]
    peers = SimpleNamespace(verified_names=lambda: list(names))
    worker = _WorkerSide.__new__(_WorkerSide)  # only what report() reads
    worker._freed, worker._verified, worker._prefill = set(), set(), None
    worker._pool_failed, worker._read_failed, worker._pool_reset = set(), set(), False
    worker._decode = SimpleNamespace(transport=SimpleNamespace(peers=peers))
    reports = [worker.report() for _ in range(4)]
    assert [r.verified for r in reports[:3]] == [
        tuple(names[:16]), tuple(names[16:32]), tuple(names[32:])]
    assert reports[3] is None  # nothing new: no report
    names.append("p-new")
    assert worker.report().verified == ("p-new",)


def test_worker_reports_add_up_their_verified_names_and_refuse_odd_ones():
    one = WorkerReport({"r": 1}, verified=("p-0", "p-1"))
    both = one.aggregate(WorkerReport({"r": 1}, verified=("p-1", "q")))
    assert both.verified == ("p-0", "p-1", "q") and both.freed == {"r": 2}
    for bad in (["p"], ("",), (7,), "p"):
        with pytest.raises(InvalidInputError, match="WorkerReport verified"):
            WorkerReport({}, verified=bad)
    with pytest.raises(InvalidInputError, match="WorkerReport pool_failed must be a tuple of "
                                                "request ids, got \\['r'\\]"):
        WorkerReport({}, pool_failed=["r"])
    with pytest.raises(InvalidInputError, match="WorkerReport read_failed must be a tuple of "
                                                "request ids, got \\{'r'\\}"):
        WorkerReport({}, read_failed={"r"})
    merged = WorkerReport({}, pool_failed=("r",), read_failed=("s",)).aggregate(
        WorkerReport({}, pool_failed=("r", "s"), read_failed=("t",)))
    assert merged.pool_failed == ("r", "s") and merged.read_failed == ("s", "t")
    assert not merged.pool_reset
    assert WorkerReport({}).aggregate(WorkerReport({}, pool_reset=True)).pool_reset
    with pytest.raises(InvalidInputError, match="WorkerReport pool_reset must be a bool, got 1"):
        WorkerReport({}, pool_reset=1)


def test_a_local_prefill_reuses_the_prompt_d_loaded_and_is_counted_as_one_not_as_a_fallback(pd):
    """`kvxfer proxy`'s local choice: the next turn goes to D alone, marked `local_prefill`; D
    computes only what its prefix cache lacks and counts a local prefill, no fallback."""
    from kvxfer.serve.proxy import LOCAL_PARAMS

    p, d = pd(d=dict(log_stats=True))
    first = _prompt(50, 48)  # 3 whole blocks of 16
    steps = decode(d, "turn1", first, p.prefill("turn1", first))
    later = first + _prompt(51, 20)
    steps += decode(d, "turn2", later, dict(LOCAL_PARAMS))
    assert scheduled_tokens(steps, "turn2") == (48, 20 + 1), "D computed only the new 20 tokens"
    counters = _stats_of(steps).data["counters"]
    assert counters["d_local_prefills"] == 1
    assert not [k for k in counters if k.startswith("d_fallback_")], counters
    registry, types = _registry_metric_types()
    prom = TPUConnector.build_prom_metrics(d.vllm_config, types, LABELS, {0: ["m", "0"]})
    prom.observe(_stats_of(steps).data)
    assert registry.get_sample_value("vllm:kvxfer_num_local_prefills_total",
                                     {"model_name": "m", "engine": "0"}) == 1
