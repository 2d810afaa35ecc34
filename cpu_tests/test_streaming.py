"""Streams: D reads each block as soon as P names it final, while P still prefills.

Connectors in one process (P on devices 0-3, D on 4-7), two NIXL agents; P's
steps and polls run on the test's thread, between D's polls.
"""

import os
import sys
import time

import numpy as np
import pytest

from kvxfer.connector.scheduler import LoadRequest
from kvxfer.errors import InvalidInputError
from kvxfer.nixl.wire import StreamParams, new_stream_id, prompt_digest
from kvxfer.plan.save_plan import GroupSpec, ScheduledRequest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from procs.pair import as_bits, copy_block, d_request  # noqa: E402


def _stream(pr, stream):
    a = pr.p.worker.address
    return StreamParams(a.name, a.host, a.port, stream).to_dict()


def _drive(pr, until, timeout=20.0):
    """Poll P and D on this thread until `until(finished, failed)`; `(finished, failed)`."""
    finished, failed = [], []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pr.freed += pr.p.get_finished()
        f, x = pr.get_finished()
        finished, failed = finished + f, failed + x
        if until(finished, failed):
            break
        time.sleep(0.001)
    return finished, failed


def _same(pr, d_ids, p_ids):
    return all((as_bits(d)[d_ids] == as_bits(p)[p_ids]).all()
               for p, d in zip(pr.p_caches[0], pr.d_caches[0]))


def test_d_writes_each_final_block_while_p_prefills_and_the_straddling_one_once_complete(pair):
    pr = pair()
    stream = new_stream_id()
    pr.p.add_request("r", 40, stream=stream)
    pr.d.start_load_kv({"r": LoadRequest(_stream(pr, stream), [20, 21, 22])})
    meta = pr.save(ScheduledRequest("r", 0, 24, ([5, 9],), full_table=True))
    assert meta.final == {"r": ([0],)}  # block 1 straddles the chunk's end: not yet final
    finished, failed = _drive(pr, lambda f, x: f or x or _same(pr, [20], [5]), timeout=10)
    assert (finished, failed) == ([], []) and _same(pr, [20], [5])
    assert not _same(pr, [21], [9])  # the half-written block is not read before it is final
    # The next chunk completes block 9 (new bytes) and writes block 12.
    pr.p_caches[0] = [copy_block(c, 9, 7) for c in pr.p_caches[0]]
    meta = pr.save(ScheduledRequest("r", 24, 16, ([12],)))
    assert meta.final == {"r": ([1, 2],)} and meta.completed == {"r"}
    finished, failed = _drive(pr, lambda f, x: f or x)
    assert (finished, failed) == (["r"], [])
    assert _same(pr, [20, 21, 22], [5, 7, 12])
    assert pr.d.get_block_ids_with_load_errors() == set()
    # P frees the request once D said done; its params, asked for later, name a freed hold.
    _drive(pr, lambda f, x: "r" in pr.freed, timeout=5)
    assert "r" in pr.freed and "r" not in pr.p.slot_map


def test_d_subscribing_late_gets_every_block_named_so_far(pair):
    pr = pair()
    stream = new_stream_id()
    pr.p.add_request("r", 64, stream=stream)
    pr.save(ScheduledRequest("r", 0, 40, ([3, 4, 5, 6],), full_table=True))
    pr.d.start_load_kv({"r": LoadRequest(_stream(pr, stream), [26, 27, 28, 29])})
    _drive(pr, lambda f, x: _same(pr, [26, 27], [3, 4]), timeout=10)
    pr.save(ScheduledRequest("r", 40, 24, None))
    finished, failed = _drive(pr, lambda f, x: f or x)
    assert (finished, failed) == (["r"], []) and _same(pr, [26, 27, 28, 29], [3, 4, 5, 6])


def test_p_giving_up_mid_stream_fails_d_in_logical_ids_and_frees_p_once_d_let_go(pair):
    pr = pair(kernel_ratio=2, block_size=32)
    stream = new_stream_id()
    pr.p.add_request("r", 100, stream=stream)
    pr.d.start_load_kv({"r": LoadRequest(_stream(pr, stream), [7, 8, 9, 10])})
    pr.save(ScheduledRequest("r", 0, 40, ([3, 4],), full_table=True))
    _drive(pr, lambda f, x: _same(pr, [14, 15], [6, 7]), timeout=10)
    pr.p.abort("r")
    assert "r" in pr.p.slot_map  # D may be reading its slots
    pr.save()  # the next step tells the worker
    finished, failed = _drive(pr, lambda f, x: x and "r" in pr.freed)
    assert (finished, failed) == ([], ["r"])
    assert pr.d.get_block_ids_with_load_errors() == {7, 8, 9, 10}
    assert "r" not in pr.p.slot_map and pr.p.request_finished("r") is None


def test_preempted_streamed_request_is_dropped_and_d_recomputes(pair):
    pr = pair()
    stream = new_stream_id()
    pr.p.add_request("r", 40, stream=stream)
    pr.d.start_load_kv({"r": LoadRequest(_stream(pr, stream), [1, 2, 3])})
    pr.save(ScheduledRequest("r", 0, 24, ([5, 9],), full_table=True))
    _drive(pr, lambda f, x: _same(pr, [1], [5]), timeout=10)
    meta = pr.save(ScheduledRequest("r", 0, 40, ([2, 3, 4],), full_table=True))
    assert meta.cancels == ["r"] and "r" not in meta.blocks
    finished, failed = _drive(pr, lambda f, x: x)
    assert (finished, failed) == ([], ["r"])
    assert pr.p.request_finished("r") is None


def test_stream_for_another_prompt_is_refused(pair):
    pr = pair()
    stream = new_stream_id()
    pr.p.add_request("r", 32, list(range(32)), stream=stream)
    pr.d.start_load_kv({"r": LoadRequest(_stream(pr, stream), [1, 2],
                                         prompt=prompt_digest(list(range(1, 33))))})
    pr.save(ScheduledRequest("r", 0, 32, ([5, 6],), full_table=True))
    finished, failed = _drive(pr, lambda f, x: f or x)
    assert (finished, failed) == ([], ["r"])
    assert not _same(pr, [1], [5])


def test_stream_p_never_had_fails_d_without_hanging(pair):
    pr = pair(lease=2.0, heartbeat=0.5)  # P waits a lease for the request, then refuses
    pr.d.start_load_kv({"r": LoadRequest(_stream(pr, new_stream_id()), [1, 2])})
    finished, failed = _drive(pr, lambda f, x: f or x, timeout=8)  # D's own deadline is 10 s
    assert (finished, failed) == ([], ["r"])
    assert pr.d.get_block_ids_with_load_errors() == {1, 2}


def test_d_that_does_not_stream_reads_a_streamed_request_by_its_params(pair):
    pr = pair()
    pr.p.add_request("r", 40, stream=new_stream_id())
    pr.save(ScheduledRequest("r", 0, 24, ([5, 9],), full_table=True))
    pr.save(ScheduledRequest("r", 24, 16, ([12],)))
    params = pr.p.request_finished("r")
    pr.d.start_load_kv({"r": LoadRequest(params, [20, 21, 22])})
    finished, failed = _drive(pr, lambda f, x: f or x)
    assert (finished, failed) == (["r"], []) and _same(pr, [20, 21, 22], [5, 9, 12])


def test_d_skips_blocks_it_holds_of_a_stream(pair):
    pr = pair()
    stream = new_stream_id()
    pr.p.add_request("r", 48, stream=stream)
    before = [as_bits(c)[[1]].copy() for c in pr.d_caches[0]]
    pr.d.start_load_kv({"r": LoadRequest(_stream(pr, stream), [1, 2, 3], have=[1])})
    pr.save(ScheduledRequest("r", 0, 48, ([5, 6, 7],), full_table=True))
    finished, failed = _drive(pr, lambda f, x: f or x)
    assert (finished, failed) == (["r"], []) and _same(pr, [2, 3], [6, 7])
    assert all((as_bits(c)[[1]] == b).all() for c, b in zip(pr.d_caches[0], before))


def test_a_stream_whose_blocks_d_holds_all_finishes_reading_none(pair):
    """Nothing to READ, so no params: D's `done` still carries the stream's token, and P
    acks it (D reports a request only after P's ok)."""
    pr = pair()
    stream = new_stream_id()
    pr.p.add_request("r", 48, stream=stream)
    before = [as_bits(c)[[1, 2, 3]].copy() for c in pr.d_caches[0]]
    pr.d.start_load_kv({"r": LoadRequest(_stream(pr, stream), [1, 2, 3], have=[3])})
    pr.save(ScheduledRequest("r", 0, 48, ([5, 6, 7],), full_table=True))
    finished, failed = _drive(pr, lambda f, x: f or x)
    assert (finished, failed) == (["r"], [])
    assert all((as_bits(c)[[1, 2, 3]] == b).all() for c, b in zip(pr.d_caches[0], before))


@pytest.mark.parametrize("bad", [
    {"peer": "P", "host": "127.0.0.1", "port": 1, "stream": "xyz"},
    {"peer": "", "host": "127.0.0.1", "port": 1, "stream": "0" * 32},
    {"peer": "P", "host": "127.0.0.1", "port": -1, "stream": "0" * 32},
])
def test_malformed_stream_params_fail_that_request_alone(pair, bad):
    pr = pair()
    with pytest.raises(InvalidInputError, match="stream params field"):
        StreamParams.parse(bad)
    pr.d.start_load_kv({"r": LoadRequest(bad, [1, 2])})
    assert pr.get_finished() == ([], ["r"])
    assert pr.d.get_block_ids_with_load_errors() == {1, 2}


def test_p_refuses_a_stream_id_that_is_not_one_or_taken(pair):
    pr = pair()
    with pytest.raises(InvalidInputError, match="stream must be"):
        pr.p.add_request("r", 16, stream="not-hex")
    stream = new_stream_id()
    pr.p.add_request("a", 16, stream=stream)
    with pytest.raises(InvalidInputError, match="another request"):
        pr.p.add_request("b", 16, stream=stream)


def test_final_blocks_follow_the_chunk_end_in_every_group_and_kernel_ratio():
    from kvxfer.connector.scheduler import PeerAddress, PrefillScheduler

    groups = [GroupSpec(16), GroupSpec(16, kind="mamba"), GroupSpec(16, dcp_size=2)]
    s = PrefillScheduler(groups, staging_blocks=64, kernel_ratio=2,
                         address=PeerAddress("P", "127.0.0.1", 1))
    s.add_request("r", 70, stream=new_stream_id())
    meta = s.build_connector_meta([ScheduledRequest("r", 0, 40, ([4, 5, 6], [7, 8, 9], [2, 3]),
                                                    full_table=True)])
    # Full attention: entries 0 and 1 (tokens 0-31) are whole, entry 2 straddles; kernel
    # positions 2i, 2i+1. Mamba: nothing before the end. DCP 2: 32 tokens per entry.
    assert meta.final["r"] == ([0, 1, 2, 3], [], [0, 1])
    meta = s.build_connector_meta([ScheduledRequest("r", 40, 30, ([10, 11], [10, 11], [4]))])
    assert meta.final["r"] == ([4, 5, 6, 7, 8, 9], [8, 9], [2, 3, 4, 5])
    assert np.array_equal(sorted(meta.holds), ["r"])


def test_p_gone_mid_stream_fails_d_within_its_deadline_in_logical_ids(pair):
    pr = pair(deadline=2.0)
    stream = new_stream_id()
    pr.p.add_request("r", 64, stream=stream)
    pr.d.start_load_kv({"r": LoadRequest(_stream(pr, stream), [1, 2, 3, 4])})
    pr.save(ScheduledRequest("r", 0, 32, ([5, 6, 7, 8],), full_table=True))
    _drive(pr, lambda f, x: _same(pr, [1, 2], [5, 6]), timeout=10)
    pr.p.close()  # P dies before its last chunk
    assert pr.wait(1, timeout=10) == ([], ["r"])
    assert pr.d.get_block_ids_with_load_errors() == {1, 2, 3, 4}


def test_a_streamed_request_no_d_reads_is_freed_when_its_lease_expires(pair):
    pr = pair(lease=2.0, heartbeat=0.5)
    pr.p.add_request("r", 32, stream=new_stream_id())
    pr.save(ScheduledRequest("r", 0, 16, ([5, 6],), full_table=True))
    time.sleep(2.5)  # no lease runs before the last chunk: P still prefills it
    _drive(pr, lambda f, x: "r" in pr.freed, timeout=1)
    assert "r" not in pr.freed and "r" in pr.p.slot_map
    pr.save(ScheduledRequest("r", 16, 16, None))
    assert pr.p.request_finished("r") is not None
    _drive(pr, lambda f, x: "r" in pr.freed, timeout=10)
    assert "r" in pr.freed and "r" not in pr.p.slot_map


def test_d_subscribing_after_p_freed_the_stream_is_refused_at_once(pair):
    # D queued the request past P's lease: P remembers the stream is gone and says so, rather
    # than wait `lease_s` for a request that will not come. P's clock is frozen below, so
    # only that answer can end D's read before D's own 60 s deadline.
    pr = pair(lease=2.0, heartbeat=0.5, deadline=60.0)
    stream = new_stream_id()
    pr.p.add_request("r", 16, stream=stream)
    pr.save(ScheduledRequest("r", 0, 16, ([5],), full_table=True))
    _drive(pr, lambda f, x: "r" in pr.freed, timeout=10)  # its lease lapsed
    assert "r" in pr.freed
    pr.d.start_load_kv({"r": LoadRequest(_stream(pr, stream), [1])})
    frozen = time.monotonic()
    finished, failed = [], []
    deadline = time.monotonic() + 30
    while not (finished or failed) and time.monotonic() < deadline:
        pr.p.transport.poll(now=frozen)
        finished, failed = pr.get_finished()
        time.sleep(0.001)
    assert (finished, failed) == ([], ["r"])


def test_a_stream_queued_on_p_longer_than_ds_deadline_is_read_once_p_prefills_it(pair):
    # D's deadline is 1 s; the request reaches P's scheduler 3 s after D subscribed. P's
    # `wait`, about every 0.25 s here, keeps D's read alive meanwhile.
    pr = pair(deadline=1.0, heartbeat=0.25)
    stream = new_stream_id()
    pr.d.start_load_kv({"r": LoadRequest(_stream(pr, stream), [1, 2])})
    assert _drive(pr, lambda f, x: f or x, timeout=3.0) == ([], [])
    pr.p.add_request("r", 32, stream=stream)
    pr.save(ScheduledRequest("r", 0, 32, ([5, 6],), full_table=True))
    finished, failed = _drive(pr, lambda f, x: f or x)
    assert (finished, failed) == (["r"], []) and _same(pr, [1, 2], [5, 6])


def test_a_p_that_only_ever_says_wait_is_followed_for_stream_wait_s_then_dropped(pair, caplog):
    """P keeps saying the stream is still coming (its request never leaves P's queue): D follows
    for `stream_wait_s` (2 s here) past its 1 s deadline, not for ever, then fails the request
    naming the setting and tells P to drop it; P's engine then stages nothing of it."""
    pr = pair(deadline=1.0, heartbeat=0.25, stream_wait=2.0)
    stream = new_stream_id()
    pr.d.start_load_kv({"r": LoadRequest(_stream(pr, stream), [1, 2])})
    started = time.monotonic()
    finished, failed = _drive(pr, lambda f, x: f or x, timeout=15.0)
    assert (finished, failed) == ([], ["r"])
    assert time.monotonic() - started >= 2.0  # P's waits were followed past the 1 s deadline
    assert "stream_wait_s=2 s" in caplog.text and pr.d.get_block_ids_with_load_errors() == {1, 2}
    _drive(pr, lambda f, x: stream in pr.p.worker.transport.streams._gone, timeout=5)
    assert stream in pr.p.worker.transport.streams._gone  # P heard D drop it
    pr.p.add_request("r", 48, stream=stream)  # P's scheduler gets to it only now
    pr.save(ScheduledRequest("r", 0, 16, ([5],), full_table=True))
    _drive(pr, lambda f, x: "r" in pr.freed, timeout=5)
    meta = pr.save(ScheduledRequest("r", 16, 32, ([6, 7],)))
    assert "r" in pr.freed and "r" not in meta.blocks and "r" not in pr.p.slot_map


def _d_alone(pr, until, timeout):
    """Poll D only (P's engine thread is busy) until `until(failed)`; the failed ids."""
    failed, deadline = [], time.monotonic() + timeout
    while not until(failed) and time.monotonic() < deadline:
        failed += pr.get_finished()[1]
        time.sleep(0.001)
    return failed


@pytest.mark.parametrize("when", ["queued", "prefilling"])
def test_p_stages_nothing_more_for_a_stream_whose_d_gave_up(pair, when):
    pr = pair(deadline=1.0, heartbeat=0.25)
    stream = new_stream_id()
    if when == "prefilling":
        pr.p.add_request("r", 48, stream=stream)
        pr.save(ScheduledRequest("r", 0, 16, ([5],), full_table=True))
    pr.d.start_load_kv({"r": LoadRequest(_stream(pr, stream), [1, 2, 3])})
    _drive(pr, lambda f, x: (read := pr.d.transport.reading("r")) is not None
           and not read.waiting and (when == "queued" or _same(pr, [1], [5])), timeout=10)
    # P stalls past D's deadline: D gives up and says so.
    assert _d_alone(pr, lambda failed: failed, timeout=5) == ["r"]
    if when == "queued":  # P gets to the request only now
        pr.p.add_request("r", 48, stream=stream)
        pr.save(ScheduledRequest("r", 0, 16, ([5],), full_table=True))
    _drive(pr, lambda f, x: "r" in pr.freed, timeout=5)
    assert "r" in pr.freed and "r" not in pr.p.slot_map
    meta = pr.save(ScheduledRequest("r", 16, 32, ([6, 7],)))  # P's engine prefills on
    assert "r" not in meta.blocks and "r" not in pr.p.slot_map
    assert pr.p.request_finished("r") is None


@pytest.mark.parametrize("p_devices,d_devices", [((0,), (4, 5, 6, 7)), ((0, 1, 2, 3), (4,))],
                         ids=["P-TP1-to-D-TP4", "P-TP4-to-D-TP1"])
def test_a_stream_between_instances_at_different_tp_delivers_every_byte(pair, backend, p_devices,
                                                                        d_devices):
    """Streams read pieces as any read does: D reads the units its staging holds from P's
    one agent, which holds every unit, whatever either side's TP."""
    pr = pair(p_devices=p_devices, d_devices=d_devices)
    assert pr.p.worker.processes.piece == pr.d.processes.piece == (0, 4, 4)
    stream = new_stream_id()
    pr.p.add_request("r", 40, stream=stream)
    pr.d.start_load_kv({"r": LoadRequest(_stream(pr, stream), [20, 21, 22])})
    pr.save(ScheduledRequest("r", 0, 24, ([5, 9],), full_table=True))
    _drive(pr, lambda f, x: f or x or _same(pr, [20], [5]), timeout=10)
    pr.save(ScheduledRequest("r", 24, 16, ([12],)))
    finished, failed = _drive(pr, lambda f, x: f or x)
    assert (finished, failed) == (["r"], [])
    assert _same(pr, [20, 21, 22], [5, 9, 12])


def test_a_streamed_prompt_is_pooled_once_d_read_it_its_blocks_checked_by_their_entry_secrets(pair):
    """With a host pool, a streamed request's whole prompt blocks are tagged from their pool
    entries' secrets, which the chunks name (to a D subscribing late too), and enter P's pool
    once D has read them, as a request that goes by params does."""
    slot = 2 * 16 * 4 * 2 * 32 * 2  # bytes of one staging slot: 2 layers of [16, 4, 2, 32] bf16
    pr = pair(pool_bytes=8 * slot)
    stream = new_stream_id()
    pr.p.add_request("s", 40, stream=stream, block_hashes=[["h0", "h1"]])
    pr.save(ScheduledRequest("s", 0, 24, ([5, 9],), full_table=True))  # block 0 final
    pr.d.start_load_kv({"s": d_request(_stream(pr, stream), [20, 21, 22], [["h0", "h1"]])})
    _drive(pr, lambda f, x: f or x or _same(pr, [20], [5]), timeout=10)
    pr.save(ScheduledRequest("s", 24, 16, ([12],)))
    finished, failed = _drive(pr, lambda f, x: f or x)
    assert (finished, failed) == (["s"], []) and _same(pr, [20, 21, 22], [5, 9, 12])
    assert pr.d.get_block_ids_with_load_errors() == set()
    _drive(pr, lambda f, x: "s" in pr.freed, timeout=5)  # D's done: P lets it go
    assert pr.p.pooled_tokens([["h0", "h1", "h2"]]) == 32  # its two whole blocks
    # A stream of a prompt that starts the same copies its blocks again (a stream's chunks
    # name the blocks it copies) and D checks them by the same entries.
    other = new_stream_id()
    pr.p.add_request("t", 40, stream=other, block_hashes=[["h0", "h1"]])
    pr.d.start_load_kv({"t": d_request(_stream(pr, other), [24, 25, 26], [["h0", "h1"]])})
    meta = pr.save(ScheduledRequest("t", 0, 40, ([6, 10, 13],), full_table=True))
    assert [pos for pos, _ in meta.blocks["t"][0]] == [0, 1, 2]
    finished, failed = _drive(pr, lambda f, x: f or x)
    assert (finished, failed) == (["t"], []) and _same(pr, [24, 25, 26], [6, 10, 13])


def test_a_streamed_pooled_block_read_for_a_prompt_hashed_otherwise_fails_its_tags(pair):
    """A stream's chunks name its whole blocks' pool entries; a D whose own prompt hashes
    block 1 otherwise (another prompt, salt or adapter under the same stream id) checks
    the entry's tag under its own hash, and the stream fails instead of loading it."""
    slot = 2 * 16 * 4 * 2 * 32 * 2
    pr = pair(pool_bytes=8 * slot)
    stream = new_stream_id()
    pr.p.add_request("s", 40, stream=stream, block_hashes=[["h0", "h1"]])
    pr.d.start_load_kv({"s": d_request(_stream(pr, stream), [20, 21, 22], [["h0", "y1"]])})
    pr.save(ScheduledRequest("s", 0, 40, ([5, 9, 12],), full_table=True))
    assert _drive(pr, lambda f, x: f or x) == ([], ["s"])


@pytest.mark.parametrize("how", ["aborted", "preempted"])
def test_a_stream_given_up_mid_prefill_leaves_nothing_in_the_pool(pair, how):
    """A block a stream staged part of (its chunk ended inside it) is tagged from its entry
    secret and sums as staged: were it pooled, a later prompt would load it as good. A
    stream aborted (client gone) or preempted before its last chunk pools none of it."""
    slot = 2 * 16 * 4 * 2 * 32 * 2
    pr = pair(pool_bytes=8 * slot)
    stream = new_stream_id()
    pr.p.add_request("s", 40, stream=stream, block_hashes=[["h0", "h1"]])
    pr.save(ScheduledRequest("s", 0, 24, ([5, 9],), full_table=True))  # block 1 half written
    if how == "aborted":
        assert pr.p.request_finished("s") is None
        pr.save()
    else:  # resumed from its first token: P gives the stream up
        assert pr.save(ScheduledRequest("s", 0, 40, ([2, 3, 4],), full_table=True)).cancels == ["s"]
    _drive(pr, lambda f, x: "s" in pr.freed, timeout=10)
    assert "s" in pr.freed and pr.p.pooled_tokens([["h0", "h1"]]) == 0
    assert pr.p.scheduler.pools.entries() == 0
