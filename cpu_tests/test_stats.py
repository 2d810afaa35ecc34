"""`kvxfer.stats` through the connectors: counters, series, failures by reason, traces."""

import json
import logging
import time

import numpy as np

from kvxfer.connector.scheduler import LoadRequest
from kvxfer.plan.save_plan import ScheduledRequest
from kvxfer.stats import Recorder, Trace


def _staged(pr, req_id, blocks, tokens=None):
    tokens = tokens or 16 * len(blocks)
    pr.p.add_request(req_id, tokens)
    pr.save(ScheduledRequest(req_id, 0, tokens, (list(blocks),), full_table=True))
    return pr.p.request_finished(req_id)


def test_bytes_counted_are_blocks_times_block_bytes_on_both_sides(pair):
    pr = pair()
    plan = {"a": ([1, 2, 3], [10, 11, 12]), "b": ([4], [13]), "c": ([5, 6], [14, 15])}
    params = {r: _staged(pr, r, p_ids) for r, (p_ids, _) in plan.items()}
    pr.serve()
    finished, failed = pr.load_all({r: (params[r], d_ids) for r, (_, d_ids) in plan.items()}, 3)
    assert sorted(finished) == ["a", "b", "c"] and failed == []
    staging = pr.d.staging
    blocks = sum(len(d) for _, d in plan.values())
    block = staging.block_bytes * staging.num_layers  # a block, every layer
    d = pr.d.stats()
    assert d.counters["d_requests_ok"] == 3 and d.counters["d_blocks"] == blocks
    assert d.counters["d_bytes"] == blocks * block
    # On the wire: the blocks, their fingerprint rows and their tags (the same slot rows).
    rows = staging.prints.strides[0] + staging.tags.strides[0]
    assert d.counters["d_wire_bytes"] == blocks * (block + rows)
    assert d.counters["d_read_s_count"] == 3 and d.totals["d_read_s"] > 0
    assert d.counters.get("d_requests_failed", 0) == 0
    pr.wait_freed(3)
    p = pr.p.stats()
    assert p.counters["p_requests_ok"] == 3 and p.counters["p_bytes"] == blocks * block
    assert p.counters["p_staged_s_count"] == 3 and p.gauges["p_staging_slots_in_use"] == 0


def test_taking_the_series_returns_each_observation_once(pair):
    pr = pair()
    params = _staged(pr, "r", [1, 2])
    pr.serve()
    assert pr.load("r", params, [3, 4]) == (["r"], [])
    taken = pr.d.stats(take=True)
    assert len(taken.series["d_read_s"]) == 1 and len(taken.series["d_wall_s"]) == 1
    assert taken.series["d_request_bytes"] == [taken.counters["d_bytes"]]
    assert pr.d.stats(take=True).series == {}
    assert pr.d.stats().counters == taken.counters  # counters stay, since start


def test_trace_of_a_request_has_every_stage_within_its_wall_time_scatter_during_the_ack(pair):
    pr = pair()
    params = _staged(pr, "r", [1, 2, 3])
    pr.serve()
    assert pr.load("r", params, [7, 8, 9]) == (["r"], [])
    (trace,) = pr.d.traces()
    assert (trace.req_id, trace.role, trace.outcome) == ("r", "D", "ok")
    assert trace.p == pr.p.transport.config.name and trace.d == pr.d.transport.config.name
    # D writes the blocks as soon as they are read and checked, while its `done` and P's
    # ack travel: scatter lies within the ack stage, both after the read.
    assert [s[0] for s in trace.phases] == ["connect", "read", "scatter", "ack"]
    (_, c0, cd), (_, r0, rd), (_, s0, sd), (_, a0, ad) = trace.phases
    assert r0 >= c0 + cd - 1e-6 and s0 >= r0 + rd - 1e-6 and a0 >= r0 + rd - 1e-6
    assert max(start + d for _, start, d in trace.phases) <= trace.wall + 1e-6
    assert trace.bytes == 3 * pr.d.staging.block_bytes * pr.d.staging.num_layers
    pr.wait_freed(1)
    (p_trace,) = pr.p.traces()
    assert [s[0] for s in p_trace.phases] == ["gather", "staged"]
    assert p_trace.outcome == "ok" and p_trace.d == pr.d.transport.config.name
    assert sum(d for _, _, d in p_trace.phases) <= p_trace.wall


def test_a_fingerprint_mismatch_counts_as_corruption(pair):
    pr = pair()
    params = _staged(pr, "r", [1, 2])
    slot = pr.p.slot_map.slot("r", 1)
    pr.p.staging.regions[0][slot].view(np.uint8).reshape(-1)[7] ^= 0x10
    pr.serve()
    assert pr.load("r", params, [3, 4]) == ([], ["r"])
    d = pr.d.stats()
    assert d.counters["d_failed_corruption"] == 1 and d.counters["d_requests_failed"] == 1
    assert d.counters["d_recompute_blocks"] == 2 and "d_requests_ok" not in d.counters
    assert pr.d.traces()[-1].outcome == "corruption"


def test_refused_params_and_altered_slots_count_by_reason(pair):
    pr = pair()
    params = _staged(pr, "r", [1, 2])
    pr.serve()
    pr.d.start_load_kv({"bad": LoadRequest({"nonsense": 1}, [5])})
    stolen = {**params, "secret": "0" * 32}  # r's slots under a made-up secret: tags differ
    finished, failed = pr.load_all({"stolen": (stolen, [6, 7])}, 2)
    assert sorted(failed) == ["bad", "stolen"]
    d = pr.d.stats()
    assert d.counters["d_failed_refused"] == 1 and d.counters["d_failed_binding"] == 1
    assert {t.req_id: t.outcome for t in pr.d.traces()} == {"bad": "refused",
                                                            "stolen": "binding"}


def test_a_p_that_is_gone_counts_as_peer_gone(pair):
    pr = pair(deadline=3.0, handshake=1.0)
    params = _staged(pr, "r", [1, 2])
    pr.p.close()  # before D ever connects
    assert pr.load("r", params, [3, 4], timeout=10) == ([], ["r"])
    d = pr.d.stats()
    assert d.counters["d_failed_peer_gone"] == 1 and d.counters["d_handshake_failures"] >= 1


def test_an_expired_lease_is_counted_at_p(pair):
    pr = pair(lease=1.0, heartbeat=0.5)
    _staged(pr, "r", [1, 2])
    assert pr.p.transport.poll(now=time.monotonic() + 2.0) == ["r"]  # no D ever came
    p = pr.p.stats()
    assert p.counters["p_failed_lease_expired"] == 1 and p.gauges["p_requests_held"] == 0
    assert pr.p.traces()[-1].outcome == "lease_expired"


def test_stats_off_collects_nothing_but_logs_traces(pair, caplog):
    pr = pair(stats=False)
    params = _staged(pr, "r", [1])
    pr.serve()
    with caplog.at_level(logging.DEBUG, logger="kvxfer.stats"):
        assert pr.load("r", params, [2]) == (["r"], [])
        deadline = time.monotonic() + 10  # P logs its trace on its own thread, once acked
        while True:
            logged = [json.loads(r.getMessage().split(" ", 2)[2]) for r in caplog.records
                      if r.getMessage().startswith("kvxfer trace ")]
            if len(logged) >= 2 or time.monotonic() > deadline:
                break
            time.sleep(0.01)
    assert pr.d.stats().counters == {} and pr.d.traces() == []
    assert sorted((t["req_id"], t["role"], t["outcome"]) for t in logged) == [
        ("r", "D", "ok"), ("r", "P", "ok")]


def test_recorder_caps_each_series_between_takes_but_not_its_totals():
    rec = Recorder()
    for _ in range(5000):
        rec.observe("x", 1.0)
    stats = rec.stats(take=True)
    assert len(stats.series["x"]) == 4096 and stats.counters["series_dropped"] == 904
    assert stats.totals["x"] == 5000.0 and stats.counters["x_count"] == 5000


def test_trace_ring_keeps_the_last_records():
    rec = Recorder(ring=2)
    for r in "abc":
        rec.finish(Trace(r, "D"))
    assert [t.req_id for t in rec.traces()] == ["b", "c"]
