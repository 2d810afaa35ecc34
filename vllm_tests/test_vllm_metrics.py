"""kvxfer's stats through vLLM: `KvxferStats` aggregation and `KvxferPromMetrics` series."""

import functools
import pickle
import time

import msgspec
import pytest
import test_vllm_connector
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from test_vllm_connector import POOL_SLOT, _pool_pair, _prompt, _released, decode
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorLogging,
    KVConnectorProm,
)
from vllm.v1.metrics.stats import PrefixCacheStats

from kvxfer.vllm import TPUConnector
from kvxfer.vllm.fallbacks import counter_name
from kvxfer.vllm.metrics import HISTOGRAMS, KvxferStats

LABELS = ["model_name", "engine"]
pd = test_vllm_connector.pd  # the P/D pair fixture


def _report(counters=None, series=None, gauges=None):
    return KvxferStats({"counters": dict(counters or {}), "series": dict(series or {}),
                        "gauges": dict(gauges or {})})


def test_aggregate_adds_counters_extends_series_and_keeps_each_sources_latest_gauge():
    worker0_step1 = _report({"d_requests_ok": 2, "d_bytes": 100}, {"d_read_s": [0.1, 0.2]},
                            {"D-0": {"d_staging_slots_in_use": 8}})
    worker1_step1 = _report({"d_requests_ok": 1, "d_bytes": 50}, {"d_read_s": [0.3]},
                            {"D-1": {"d_staging_slots_in_use": 4}})
    worker0_step2 = _report({"d_failed_deadline": 1}, {"d_read_s": [0.4]},
                            {"D-0": {"d_staging_slots_in_use": 2}})
    total = TPUConnector.build_kv_connector_stats()
    for report in (worker0_step1, worker1_step1, worker0_step2):
        total = total.aggregate(report)
    assert total.data["counters"] == {"d_requests_ok": 3, "d_bytes": 150, "d_failed_deadline": 1}
    assert sorted(total.data["series"]["d_read_s"]) == [0.1, 0.2, 0.3, 0.4]
    assert total.gauge("d_staging_slots_in_use") == 2 + 4  # worker 0's latest, plus worker 1's
    assert not total.is_empty()
    total.reset()
    assert total.is_empty() and TPUConnector.build_kv_connector_stats().is_empty()


def test_reduce_summarizes_the_interval_for_the_log_line():
    stats = _report({"d_requests_ok": 4, "d_requests_failed": 1, "d_bytes": 4 * 2**20,
                     "d_failed_peer_gone": 1},
                    {"d_read_s": [0.001, 0.002, 0.003, 0.002], "d_wall_s": [0.01] * 4})
    summary = stats.reduce()
    assert summary["D transfers"] == 4 and summary["D failed"] == 1 and summary["D MB"] == 4.0
    assert summary["Avg read (ms)"] == 2.0 and summary["Read throughput (MB/s)"] == 500.0
    assert summary["Failed peer_gone (D)"] == 1 and "P transfers" not in summary


def test_the_payload_is_plain_data_that_crosses_processes():
    stats = _report({"p_requests_ok": 1}, {"p_gather_s": [0.5]}, {"P": {"p_requests_held": 3}})
    for codec in (pickle, msgspec.msgpack):
        back = TPUConnector.build_kv_connector_stats(codec.decode(codec.encode(stats.data))
                                                     if codec is msgspec.msgpack else
                                                     codec.loads(codec.dumps(stats.data)))
        assert back.data == stats.data


def _registry_metric_types():
    registry = CollectorRegistry()
    return registry, {cls: functools.partial(cls, registry=registry)
                      for cls in (Gauge, Counter, Histogram)}


def test_build_prom_metrics_registers_and_observes_with_the_engine_labels(model_dir, engines):
    engine = engines(model_dir, kv_role="kv_consumer", extra_config={"staging_blocks": 8})
    registry, types = _registry_metric_types()
    prom = TPUConnector.build_prom_metrics(engine.vllm_config, types, LABELS,
                                           {0: ["m", "0"], 1: ["m", "1"]})
    prom.observe(_report({"d_requests_ok": 2, "d_bytes": 4096, "d_failed_corruption": 1},
                         {"d_read_s": [0.002, 0.004], "d_request_bytes": [2048, 2048]},
                         {"D-0": {"d_requests_waiting": 3}}).data, engine_idx=1)
    prom.observe(_report(gauges={"D-1": {"d_requests_waiting": 1}}).data, engine_idx=1)
    one = {"model_name": "m", "engine": "1"}
    value = registry.get_sample_value
    assert value("vllm:kvxfer_read_time_seconds_count", one) == 2
    assert value("vllm:kvxfer_read_time_seconds_sum", one) == pytest.approx(0.006)
    assert value("vllm:kvxfer_bytes_transferred_sum", one) == 4096
    assert value("vllm:kvxfer_num_transfers_total", {**one, "role": "D"}) == 2
    assert value("vllm:kvxfer_kv_bytes_total", {**one, "role": "D"}) == 4096
    assert value("vllm:kvxfer_num_failed_transfers_total",
                 {**one, "role": "D", "reason": "corruption"}) == 1
    assert value("vllm:kvxfer_requests_waiting", {**one, "role": "D"}) == 3 + 1
    assert value("vllm:kvxfer_read_time_seconds_count", {"model_name": "m", "engine": "0"}) is None
    names = {m.name for m in registry.collect()}
    assert {f"vllm:kvxfer_{n}" for n in HISTOGRAMS} <= names


def test_messages_dropped_from_peers_reach_metrics_by_role(model_dir, engines):
    engine = engines(model_dir, kv_role="kv_consumer", extra_config={"staging_blocks": 8})
    registry, types = _registry_metric_types()
    prom = TPUConnector.build_prom_metrics(engine.vllm_config, types, LABELS, {0: ["m", "0"]})
    prom.observe(_report({"p_messages_dropped": 700}).data)
    prom.observe(_report({"p_messages_dropped": 5}).data)
    one = {"model_name": "m", "engine": "0"}
    value = registry.get_sample_value
    assert value("vllm:kvxfer_num_dropped_messages_total", {**one, "role": "P"}) == 705
    assert value("vllm:kvxfer_num_dropped_messages_total", {**one, "role": "D"}) is None


def _stats_of(steps):
    """Every step's kv_connector_stats (worker and scheduler side, as vLLM's scheduler
    aggregated them), folded into one."""
    total = TPUConnector.build_kv_connector_stats()
    for r in steps:
        data = r.scheduler_stats.kv_connector_stats if r.scheduler_stats else None
        if data:
            total = total.aggregate(TPUConnector.build_kv_connector_stats(data))
    return total


def test_through_vllm_counts_and_bytes_equal_what_was_moved(pd):
    p, d = pd(log_stats=True, d=dict(log_stats=True))
    prompts = {"a": _prompt(30, 50), "b": _prompt(31, 33), "c": _prompt(32, 70)}
    steps = []
    for req_id, prompt in prompts.items():
        params = p.prefill(req_id, prompt)
        steps += decode(d, f"{req_id}-d", prompt, params)
    blocks = sum(-(-len(prompt) // d.block_size) for prompt in prompts.values())
    staging = d.worker._worker._decode.staging
    block = staging.block_bytes * staging.num_layers
    got = _stats_of(steps).data["counters"]
    assert got["d_requests_ok"] == 3 and got["d_blocks"] == blocks
    assert got["d_bytes"] == blocks * block
    deadline = time.monotonic() + 10
    while p.call(p.engine.connector.has_pending_push_work):
        assert time.monotonic() < deadline, "P never learned that D read its staging"
        time.sleep(0.01)
    time.sleep(0.05)  # a step after the release reports it
    p_got = _stats_of(p.call(list, p.steps)).data
    assert p_got["counters"]["p_requests_ok"] == 3
    assert p_got["counters"]["p_bytes"] == p_got["counters"]["p_blocks"] * block
    assert p_got["counters"]["p_blocks"] >= blocks
    # P's scheduler side reports its staging: every slot back once D has read them all.
    assert KvxferStats(p_got).gauge("p_staging_slots_in_use") == 0
    assert KvxferStats(p_got).gauge("p_requests_held_for_d") == 0
    # vLLM's own consumers of the payload: the periodic log line and /metrics.
    logging = KVConnectorLogging(d.vllm_config.kv_transfer_config)
    for r in steps:
        if r.scheduler_stats and r.scheduler_stats.kv_connector_stats:
            logging.observe(r.scheduler_stats.kv_connector_stats)
    lines = []
    logging.log(lambda fmt, *args: lines.append(fmt % args))
    assert len(lines) == 1 and "D transfers=3" in lines[0]
    registry, types = _registry_metric_types()

    class Prom(KVConnectorProm):
        _gauge_cls, _counter_cls, _histogram_cls = types[Gauge], types[Counter], types[Histogram]

    prom = Prom(d.vllm_config, LABELS, {0: ["toy", "0"]})
    for r in steps:
        if r.scheduler_stats and r.scheduler_stats.kv_connector_stats:
            prom.observe(r.scheduler_stats.kv_connector_stats, 0)
    labels = {"model_name": "toy", "engine": "0"}
    assert registry.get_sample_value("vllm:kvxfer_kv_bytes_total",
                                     {**labels, "role": "D"}) == blocks * block
    assert registry.get_sample_value("vllm:kvxfer_read_time_seconds_count", labels) == 3


def test_through_vllm_a_p_gone_counts_as_a_failure_with_its_reason(pd):
    p, d = pd(d=dict(log_stats=True, extra={"transfer_timeout_s": 3.0}))
    prompt = _prompt(33, 40)
    params = p.prefill("r", prompt)
    p.stop()
    p.engine.close()
    steps = decode(d, "r-d", prompt, params)
    got = _stats_of(steps).data["counters"]
    # NIXL (UCX) reports a READ from a closed agent as failed, or, on a loaded machine, not
    # before transfer_timeout_s, when D gives up on it (seen once in CI): either is this reason
    reasons = {k: n for k, n in got.items() if k.startswith("d_failed_") and n}
    assert got["d_requests_failed"] == 1
    assert reasons in ({"d_failed_peer_gone": 1}, {"d_failed_deadline": 1}), reasons
    assert got["d_recompute_blocks"] == -(-len(prompt) // d.block_size)
    # A fallback; D never completed a handshake with that P (it was gone), so the P engine
    # its params name is not a label: clients may name anything.
    assert got[counter_name("load_failed", "unverified")] == 1
    assert counter_name("load_failed", params["peer"]) not in got


def test_through_vllm_the_pool_reports_its_blocks_bytes_hits_and_evictions(pd):
    p, d = _pool_pair(pd, slots=2, log_stats=True)
    prefill = p.engine.connector._scheduler.prefill
    for i in range(3):
        prompt = _prompt(40 + i, 33)  # two full blocks each
        decode(d, f"r{i}-d", prompt, p.prefill(f"r{i}", prompt))
        _released(p)
        assert p.call(prefill.pools.entries) <= 2  # the budget: two blocks
    decode(d, "b-d", _prompt(42, 33), p.prefill("b", _prompt(42, 33)))  # r2's, from the pool
    time.sleep(0.05)  # a step after the last change reports it
    got = _stats_of(p.call(list, p.steps))
    assert got.data["counters"]["p_pool_evicted_blocks"] == 4  # r0's and r1's blocks
    assert got.data["counters"]["p_pool_hit_tokens"] == 32
    assert got.gauge("p_pool_blocks") == 2 and got.gauge("p_pool_bytes") == 2 * POOL_SLOT
    assert len(got.data["series"]["p_pool_load_s"]) == 1
    # vLLM 0.33 splits the connector's hits by tier: P's pool is host memory.
    tiers: dict[str, int] = {}
    for r in p.call(list, p.steps):
        hits = getattr(r.scheduler_stats, "connector_prefix_cache_stats", None)
        for tier, n in getattr(hits, "hits_by_source", {}).items():
            tiers[str(tier.value)] = tiers.get(str(tier.value), 0) + n
    if hasattr(PrefixCacheStats(), "hits_by_source"):  # 0.32 has no tiers
        assert tiers == {"host": 32}
    registry, types = _registry_metric_types()

    class Prom(KVConnectorProm):
        _gauge_cls, _counter_cls, _histogram_cls = types[Gauge], types[Counter], types[Histogram]

    prom = Prom(p.engine.vllm_config, LABELS, {0: ["toy", "0"]})
    prom.observe(got.data, 0)
    labels = {"model_name": "toy", "engine": "0", "role": "P"}
    assert registry.get_sample_value("vllm:kvxfer_pool_hit_tokens_total",
                                     {**labels, "source": "own_pool"}) == 32
    assert registry.get_sample_value("vllm:kvxfer_pool_evicted_blocks_total", labels) == 4
    assert registry.get_sample_value("vllm:kvxfer_pool_blocks", labels) == 2
    assert registry.get_sample_value("vllm:kvxfer_pool_bytes", labels) == 2 * POOL_SLOT


def test_a_d_with_a_pool_that_names_its_agent_counts_each_workers_counters_once(model_dir, engines):
    """A D with a host pool runs two connectors in its worker (its pool's, its loads'), both
    named after the agent `name` it was given: each one's counters reach vLLM once, not again
    at every step."""
    engine = engines(model_dir, kv_role="kv_consumer", extra_config={
        "name": "kvxfer-D-named", "staging_blocks": 8, "host_pool_bytes": 4 * POOL_SLOT,
        "precompile": False})
    worker = engine.worker._worker
    worker._prefill.recorder.count("p_pool_load_blocks", 4)
    worker._decode.recorder.count("d_recompute_blocks", 2)
    first = engine.worker.get_kv_connector_stats()
    assert first.data["counters"] == {"p_pool_load_blocks": 4, "d_recompute_blocks": 2}
    later = engine.worker.get_kv_connector_stats()  # nothing counted since
    assert later is None or not later.data["counters"], later.data
