"""Connectors in one process: P on devices 0-3, D on devices 4-7, two NIXL agents. The first
two tests run on both backends of `kvxfer.device.gather` (`KVXFER_BACKEND`): `numpy`, and `xla`,
the jitted programs an accelerator runs."""

import os
import subprocess
import sys
import threading
import time
import warnings

import numpy as np
import pytest

from kvxfer.connector.config import ConnectorConfig
from kvxfer.connector.scheduler import LoadRequest
from kvxfer.errors import InvalidInputError
from kvxfer.nixl.agent import TransportConfig
from kvxfer.plan.save_plan import ScheduledRequest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from procs.pair import as_bits, copy_block  # noqa: E402


def test_d_receives_newest_copy_of_block_rewritten_by_later_chunk(pair, backend):
    pr = pair()
    pr.p.add_request("r", 40)
    pr.save(ScheduledRequest("r", 0, 24, ([5, 9],), full_table=True))
    # The next chunk writes the rest of block 9 (tokens 24-31) and block 12.
    pr.p_caches[0] = [copy_block(c, 9, 7) for c in pr.p_caches[0]]
    meta = pr.save(ScheduledRequest("r", 24, 16, ([12],)))
    assert meta.kernel_ids == {"r": [9, 12]} and meta.completed == {"r"}
    params = pr.p.request_finished("r")
    pr.serve()
    finished, failed = pr.load("r", params, [20, 21, 22])
    assert (finished, failed) == (["r"], [])
    for p_cache, d_cache in zip(pr.p_caches[0], pr.d_caches[0]):
        assert (as_bits(d_cache)[[20, 21, 22]] == as_bits(p_cache)[[5, 9, 12]]).all()
        assert (as_bits(d_cache)[21] == as_bits(p_cache)[7]).all()
    assert pr.d.get_block_ids_with_load_errors() == set()


def test_corrupted_host_block_fails_request_in_logical_ids_and_leaves_other_blocks(pair, backend):
    pr = pair(kernel_ratio=2, block_size=32)  # logical blocks of 32 tokens = 2 kernel blocks
    pr.p.add_request("r", 50)
    meta = pr.save(ScheduledRequest("r", 0, 50, ([3, 7],), full_table=True))
    assert meta.kernel_ids == {"r": [6, 7, 14, 15]}
    params = pr.p.request_finished("r")
    # One bit flips in P's staged copy of kernel block 14 (kernel position 2: the first half of table
    # entry 1), after its fingerprint was taken. Staging is keyed by position.
    slot = pr.p.slot_map.slot("r", 2)
    pr.p.staging.regions[1][slot].view(np.uint8).reshape(-1)[100] ^= 0x01
    before = [as_bits(c).copy() for c in pr.d_caches[0]]
    pr.serve()
    finished, failed = pr.load("r", params, [10, 11])
    assert (finished, failed) == ([], ["r"])
    assert pr.d.get_block_ids_with_load_errors() == {10, 11}
    # D verifies after the scatter: only the failed request's own blocks (kernel 20-23,
    # recomputed by the engine) may have changed.
    others = np.setdiff1d(np.arange(before[0].shape[0]), [20, 21, 22, 23])
    for b, c in zip(before, pr.d_caches[0]):
        assert (as_bits(c)[others] == b[others]).all()


def test_resumed_request_restages_from_scratch(pair):
    pr = pair()
    pr.p.add_request("r", 40)
    pr.save(ScheduledRequest("r", 0, 24, ([5, 9],), full_table=True))
    # Preempted, then rescheduled with a new table: old blocks must not be sent.
    pr.save(ScheduledRequest("r", 0, 40, ([2, 3, 4],), full_table=True))
    params = pr.p.request_finished("r")
    assert params["groups"][0]["keys"] == [0, 1, 2]  # table positions, staged afresh
    pr.serve()
    finished, _ = pr.load("r", params, [1, 2, 3])
    assert finished == ["r"]
    for p_cache, d_cache in zip(pr.p_caches[0], pr.d_caches[0]):
        assert (as_bits(d_cache)[[1, 2, 3]] == as_bits(p_cache)[[2, 3, 4]]).all()


def test_abort_mid_prefill_frees_staging(pair):
    pr = pair()
    pr.p.add_request("r", 100)
    pr.save(ScheduledRequest("r", 0, 24, ([5, 9],), full_table=True))
    assert "r" in pr.p.slot_map
    pr.p.abort("r")
    assert "r" not in pr.p.slot_map and "r" not in pr.p.tracker
    assert pr.p.request_finished("r") is None


def test_corrupt_request_does_not_spoil_a_good_one_finished_in_the_same_poll(pair):
    pr = pair()
    for req_id, ids in (("bad", [4, 5]), ("good", [8, 9])):
        pr.p.add_request(req_id, 32)
        pr.save(ScheduledRequest(req_id, 0, 32, (ids,), full_table=True))
    params = {r: pr.p.request_finished(r) for r in ("bad", "good")}
    pr.p.staging.regions[0][pr.p.slot_map.slot("bad", 1)].view(np.uint8)[0] ^= 0x80
    before = [as_bits(c).copy() for c in pr.d_caches[0]]
    pr.serve()
    # The two may finish in one poll (rows share one buffer) or in two.
    finished, failed = pr.load_all({"bad": (params["bad"], [1, 2]),
                                    "good": (params["good"], [3, 4])}, 2)
    assert (finished, failed) == (["good"], ["bad"])
    assert pr.d.get_block_ids_with_load_errors() == {1, 2}
    for b, p_cache, d_cache in zip(before, pr.p_caches[0], pr.d_caches[0]):
        assert (as_bits(d_cache)[[3, 4]] == as_bits(p_cache)[[8, 9]]).all()
        # bad's own blocks (1, 2) were written and are recomputed; the rest is untouched.
        assert (as_bits(d_cache)[[0, 5, 6]] == b[[0, 5, 6]]).all()


def test_scheduler_side_params_exist_before_the_worker_saves_and_worker_serves_them(pair):
    # vLLM asks for the params (request_finished) before the worker's output of the completing
    # step is processed: the scheduler side must have made them when it planned that step.
    pr = pair()
    pr.p.add_request("r", 40)
    meta = pr.p.build_connector_meta([ScheduledRequest("r", 0, 40, ([4, 6, 8],), full_table=True)])
    params = pr.p.request_finished("r")
    assert params is not None and params["instance"] == meta.instance
    assert meta.holds == {"r": params["generation"]}
    assert "r" not in pr.p.transport.held()  # not yet saved by the worker
    pr.p.wait_for_save(pr.caches("p"), meta)
    assert pr.p.transport.held() == ["r"]
    pr.serve()
    assert pr.load("r", params, [1, 2, 3]) == (["r"], [])
    for p_cache, d_cache in zip(pr.p_caches[0], pr.d_caches[0]):
        assert (as_bits(d_cache)[[1, 2, 3]] == as_bits(p_cache)[[4, 6, 8]]).all()


def test_slots_are_reused_only_after_the_worker_reports_them_freed(pair):
    pr = pair()  # 32 staging slots
    pr.p.add_request("a", 16 * 20)
    pr.save(ScheduledRequest("a", 0, 16 * 20, (list(range(1, 21)),), full_table=True))
    params = pr.p.request_finished("a")
    assert pr.p.scheduler.held() == ["a"] and pr.p.slot_map.num_free_slots == 12
    pr.serve()
    assert pr.load("a", params, list(range(1, 21))) == (["a"], [])
    deadline = time.monotonic() + 10
    while pr.p.scheduler.held() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pr.p.scheduler.held() == [] and pr.p.slot_map.num_free_slots == 32


def test_request_that_does_not_fit_staging_is_dropped_not_raised(pair, caplog):
    pr = pair()  # 32 staging slots
    pr.p.add_request("big", 16 * 40)
    pr.p.add_request("small", 32)
    meta = pr.save(ScheduledRequest("big", 0, 16 * 40, (list(range(1, 41)),), full_table=True),
                   ScheduledRequest("small", 0, 32, ([3, 4],), full_table=True))
    assert "big" not in meta.blocks and "big" not in pr.p.tracker
    assert "P drops request big: " in caplog.text
    assert pr.p.request_finished("big") is None  # D computes its prompt itself
    assert pr.p.request_finished("small")["groups"][0]["keys"] == [0, 1]
    assert pr.p.slot_map.num_free_slots == 30


def test_d_reads_only_the_entries_it_does_not_hold_locally(pair):
    pr = pair()
    pr.p.add_request("r", 64)
    pr.save(ScheduledRequest("r", 0, 64, ([2, 3, 4, 5],), full_table=True))
    params = pr.p.request_finished("r")
    before = [as_bits(c).copy() for c in pr.d_caches[0]]
    pr.serve()
    # D's local prefix cache holds the first two entries (blocks 10 and 11): only 12, 13 are read.
    finished, failed = pr.load_all({"r": (params, [10, 11, 12, 13], [2])}, 1)
    assert (finished, failed) == (["r"], [])
    for b, p_cache, d_cache in zip(before, pr.p_caches[0], pr.d_caches[0]):
        assert (as_bits(d_cache)[[12, 13]] == as_bits(p_cache)[[4, 5]]).all()
        assert (as_bits(d_cache)[[10, 11]] == b[[10, 11]]).all()


def test_d_holding_every_entry_finishes_without_a_read(pair):
    pr = pair()
    pr.p.add_request("r", 32)
    pr.save(ScheduledRequest("r", 0, 32, ([2, 3],), full_table=True))
    params = pr.p.request_finished("r")
    pr.d.start_load_kv({"r": LoadRequest(params, [10, 11], [2])})
    assert pr.d.pending() == []
    assert pr.get_finished() == (["r"], [])


def test_bad_have_fails_the_request_alone(pair):
    pr = pair()
    pr.p.add_request("r", 32)
    pr.save(ScheduledRequest("r", 0, 32, ([2, 3],), full_table=True))
    params = pr.p.request_finished("r")
    pr.d.start_load_kv({"r": LoadRequest(params, [10, 11], [-1])})
    assert pr.get_finished() == ([], ["r"])
    assert pr.d.get_block_ids_with_load_errors() == {10, 11}


def test_a_load_that_is_not_a_load_request_fails_alone(pair, caplog):
    pr = pair()
    pr.p.add_request("r", 32)
    pr.save(ScheduledRequest("r", 0, 32, ([2, 3],), full_table=True))
    params = pr.p.request_finished("r")
    pr.serve()
    pr.d.start_load_kv({"old": (params, [12, 13]), "r": LoadRequest(params, [10, 11])})
    assert "expected a LoadRequest, got (" in caplog.text
    assert pr.wait(2) == (["r"], ["old"])
    assert pr.d.get_block_ids_with_load_errors() == set()  # no table D could read


def test_worker_refuses_metadata_of_another_p_instance(pair):
    pr = pair()
    pr.p.add_request("r", 32)
    meta = pr.p.build_connector_meta([ScheduledRequest("r", 0, 32, ([2, 3],), full_table=True)])
    meta.instance = "someone-else"
    with pytest.raises(InvalidInputError, match="someone-else"):
        pr.p.wait_for_save(pr.caches("p"), meta)


def test_import_kvxfer_pulls_in_neither_vllm_nor_torch():
    code = ("import sys, kvxfer, kvxfer.connector, kvxfer.cli; "
            "print(sorted(m for m in ('vllm', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_d_reads_under_its_own_request_id_and_names_p_s_id_to_p(pair):
    # vLLM's request ids differ between P and D (a random suffix): D's done and heartbeats must
    # name P's id from the params, or P never frees the request and D never gets its ack.
    pr = pair()
    pr.p.add_request("p-side", 32)
    pr.save(ScheduledRequest("p-side", 0, 32, ([2, 3],), full_table=True))
    params = pr.p.request_finished("p-side")
    pr.serve()
    assert pr.load("d-side", params, [10, 11]) == (["d-side"], [])
    deadline = time.monotonic() + 10
    while "p-side" not in pr.freed:
        assert time.monotonic() < deadline, "P never freed its request"
        time.sleep(0.01)


def test_lease_refuses_a_generation_that_is_not_fresh_or_a_bad_secret(pair):
    pr = pair()
    secret = "0123456789abcdef" * 2
    pr.p.transport.lease("a", 5, secret)
    for stale in (5, 3, 0, "6"):
        with pytest.raises(InvalidInputError, match=f"generation {stale!r} is not fresh"):
            pr.p.transport.lease("b", stale, secret)
    for bad in ("xyz", secret[:-1], None):
        with pytest.raises(InvalidInputError, match="a request secret is 32 hex digits"):
            pr.p.transport.lease("b", 6, bad)
    pr.p.transport.lease("b", 6, secret)
    assert sorted(pr.p.transport.held()) == ["a", "b"]


def _posts_held_until(monkeypatch, release, seen):
    """Patch D's READ posting: note the thread each post runs on, wait for `release`."""
    import kvxfer.nixl.reads as reads

    real = reads.post

    def post(*args):
        seen.append(threading.current_thread().name)
        assert release.wait(10), "the test never released the post"
        return real(*args)

    monkeypatch.setattr(reads, "post", post)


def test_start_load_kv_returns_while_the_read_is_posted_on_a_thread_of_its_own(pair,
                                                                            monkeypatch):
    """Over UCX `cma` posting a READ copies its bytes; the engine's thread must not wait."""
    pr = pair()
    pr.p.add_request("r", 32)
    pr.save(ScheduledRequest("r", 0, 32, ([4, 5],), full_table=True))
    params = pr.p.request_finished("r")
    pr.serve()
    pr.d.transport.handshakes.connect(params["peer"], params["host"], params["port"])  # posts at once
    release, seen = threading.Event(), []
    _posts_held_until(monkeypatch, release, seen)
    pr.d.start_load_kv({"r": LoadRequest(params, [1, 2])})
    assert seen and seen[0] != threading.current_thread().name
    assert seen[0].startswith("kvxfer-post-")
    # While NIXL posts (over cma: copies, holding the agent), polls leave the agent alone.
    agent, touched = pr.d.transport.agent, []
    real_notifs = agent.get_new_notifs
    agent.get_new_notifs = lambda: touched.append(1) or real_notifs()
    assert pr.get_finished() == ([], [])  # not posted yet: nothing to scatter
    assert pr.d.pending() == ["r"] and touched == []
    release.set()
    finished, failed = pr.wait(1)
    assert (finished, failed) == (["r"], [])
    for p_cache, d_cache in zip(pr.p_caches[0], pr.d_caches[0]):
        assert (as_bits(d_cache)[[1, 2]] == as_bits(p_cache)[[4, 5]]).all()


def test_a_post_that_raises_fails_its_request_in_logical_ids_and_d_goes_on(pair, monkeypatch):
    pr = pair()
    for req_id, ids in (("bad", [4, 5]), ("good", [8, 9])):
        pr.p.add_request(req_id, 32)
        pr.save(ScheduledRequest(req_id, 0, 32, (ids,), full_table=True))
    params = {r: pr.p.request_finished(r) for r in ("bad", "good")}
    pr.serve()
    import kvxfer.nixl.reads as reads

    real = reads.post

    def post_once_failing(*args):
        monkeypatch.setattr(reads, "post", real)
        raise RuntimeError("NIXL_ERR_BACKEND")

    monkeypatch.setattr(reads, "post", post_once_failing)
    assert pr.load("bad", params["bad"], [1, 2]) == ([], ["bad"])
    assert pr.d.get_block_ids_with_load_errors() == {1, 2}
    assert "bad" not in pr.d.staging  # nothing was posted: its slots are free at once
    assert pr.load("good", params["good"], [3, 4]) == (["good"], [])  # after a reconnect
    for p_cache, d_cache in zip(pr.p_caches[0], pr.d_caches[0]):
        assert (as_bits(d_cache)[[3, 4]] == as_bits(p_cache)[[8, 9]]).all()


@pytest.mark.parametrize("p_devices,d_devices", [((0, 1, 2, 3), (4,)), ((0,), (4, 5, 6, 7))],
                         ids=["P-TP4-to-D-TP1", "P-TP1-to-D-TP4"])
def test_one_process_instances_at_different_tp_pair_with_no_setting_and_deliver_every_byte(
        pair, backend, p_devices, d_devices):
    """Each side stages blocks unit-major as an instance across hosts does (one piece of
    every unit, along the heads even on one device), and D gets every byte."""
    pr = pair(p_devices=p_devices, d_devices=d_devices)
    assert pr.p.worker.processes.piece == pr.d.processes.piece == (0, 4, 4)
    pr.p.add_request("r", 40)
    pr.save(ScheduledRequest("r", 0, 40, ([5, 9, 12],), full_table=True))
    params = pr.p.request_finished("r")
    assert params["units"] == 4 and params["sources"] == [{"peer": pr.p.worker.transport.config.name,
                                                            "units": [0, 4]}]
    pr.serve()
    assert pr.load("r", params, [20, 21, 22]) == (["r"], [])
    for p_cache, d_cache in zip(pr.p_caches[0], pr.d_caches[0]):
        assert (as_bits(d_cache)[[20, 21, 22]] == as_bits(p_cache)[[5, 9, 12]]).all()
    assert pr.wait_freed(1) == ["r"]


@pytest.mark.parametrize("spec", ["dp", "dcp"])
@pytest.mark.parametrize("p_is_split", [True, False], ids=["P-split-D-TP4", "P-TP4-D-split"])
def test_data_parallel_and_dcp_caches_in_one_process_pair_with_tp_caches_byte_exact(
        pair, backend, spec, p_is_split):
    """Caches whose blocks one process splits along another axis too (the block axis over
    `data`, or the tokens under DCP, besides the heads over `model`) pair with TP-only caches:
    both cut along the heads, the last axis their specs name."""
    from jax.sharding import PartitionSpec

    split = (PartitionSpec("data", None, "model") if spec == "dp"
             else PartitionSpec(None, "data", "model"))
    specs, data = ((split, None), (2, 1)) if p_is_split else ((None, split), (1, 2))
    pr = pair(specs=specs, data=data)
    assert pr.p.worker.processes.piece == pr.d.processes.piece == (0, 4, 4)
    pr.p.add_request("r", 40)
    pr.save(ScheduledRequest("r", 0, 40, ([5, 20, 12],), full_table=True))
    params = pr.p.request_finished("r")
    pr.serve()
    assert pr.load("r", params, [30, 1, 17]) == (["r"], [])
    for p_cache, d_cache in zip(pr.p_caches[0], pr.d_caches[0]):
        assert (as_bits(d_cache)[[30, 1, 17]] == as_bits(p_cache)[[5, 20, 12]]).all()


def test_pieces_cut_along_different_block_axes_are_refused_by_name_not_transposed(pair, caplog):
    """P on one device whose caches name no inner axis cuts blocks along axis 0 (4 tokens); D
    at TP 4 cuts them along the heads (4 of them): the same number of units, of the same
    bytes, laid out differently. D must refuse P at the handshake, naming the axes, and leave
    its caches as they were (not write P's blocks transposed), fingerprints or not."""
    from jax.sharding import PartitionSpec

    pr = pair(p_devices=(0,), d_devices=(4, 5, 6, 7), block_size=4,
              shape=(32, 4, 4, 2, 32), specs=(PartitionSpec(), None), verify=False)
    assert pr.p.worker.processes.piece == pr.d.processes.piece == (0, 4, 4)
    pr.p.add_request("r", 8)
    pr.save(ScheduledRequest("r", 0, 8, ([5, 9],), full_table=True))
    params = pr.p.request_finished("r")
    pr.serve()
    before = [as_bits(c).copy() for c in pr.d_caches[0]]
    assert pr.load("r", params, [20, 21]) == ([], ["r"])
    assert pr.d.get_block_ids_with_load_errors() == {20, 21}
    assert "unit_axis: peer=0 local=1" in caplog.text
    assert all((as_bits(c) == b).all() for c, b in zip(pr.d_caches[0], before))


def test_stage_units_is_deprecated_and_ignored():
    """Every instance stages units now: the old setting still passes, with a warning saying
    so, and changes nothing about what the instance stages."""
    with pytest.warns(DeprecationWarning, match="stage_units is deprecated and ignored"):
        config = ConnectorConfig(TransportConfig("P-old"), stage_units=True)
    assert config.stage_units is True
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default warns about nothing
        ConnectorConfig(TransportConfig("P-new"))
