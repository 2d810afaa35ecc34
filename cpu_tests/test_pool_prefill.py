"""The host pool (`host_pool_bytes`) in `PrefillConnector`: a request added with its block
hashes leaves its full prompt blocks in P's staging once D has read it, and a later prompt
whose hash chain starts the same loads them into its own device blocks instead of
prefilling them: byte for byte, checked against the sums P took when it staged them, on
both backends. A finished request given to `keep_finished` (a D's) leaves its full blocks
there too."""

import os
import sys

import numpy as np
import pytest

import kvxfer.connector.prefill as prefill
from kvxfer.connector.config import ConnectorConfig
from kvxfer.device.staging import TAG_WORDS, tags_of
from kvxfer.errors import InvalidInputError
from kvxfer.nixl.agent import TransportConfig
from kvxfer.nixl.wire import bound_secret, hash_hex
from kvxfer.plan.save_plan import ScheduledRequest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from procs.pair import as_bits, d_request, rewrite_blocks  # noqa: E402

SLOT = 2 * 16 * 4 * 2 * 32 * 2  # bytes of one staging slot: 2 layers of [16, 4, 2, 32] bf16


def _read_by_d(pr, req_id, hashes, p_table, d_table, tokens=40):
    """P prefills `req_id` with `block_hashes`, D reads it, P lets it go (into its pool)."""
    pr.p.add_request(req_id, tokens, block_hashes=hashes)
    pr.save(ScheduledRequest(req_id, 0, tokens, (p_table,), full_table=True))
    params = pr.p.request_finished(req_id)
    pr.serve()
    freed = len(pr.freed)  # before D's done: P may free it before the load returns
    assert pr.load(req_id, params, d_table, hashes=hashes) == ([req_id], [])
    assert req_id in pr.wait_freed(freed + 1)


def test_a_prompt_whose_hash_chain_p_pooled_loads_its_blocks_instead_of_prefilling(pair, backend):
    pr = pair(pool_bytes=8 * SLOT)
    _read_by_d(pr, "a", [["h0", "h1"]], [5, 9, 12], [20, 21, 22])  # 2 full blocks, 1 partial
    pooled = [as_bits(c)[[5, 9]].copy() for c in pr.p_caches[0]]
    pr.p_caches[0] = [rewrite_blocks(c, [5, 9, 3, 4], seed=7) for c in pr.p_caches[0]]
    assert pr.p.pooled_tokens([["h0", "h1", "h2"]]) == 32
    assert pr.p.pooled_tokens([["h0", "hX", "h2"]]) == 16  # a chain: the run from the first
    assert pr.p.pooled_tokens([["hX", "h1"]]) == 0
    assert pr.p.pooled_tokens([["h0", "h1"]], num_computed_tokens=16) == 16  # past a device hit
    with pr._lock:  # P's serving thread polls P too
        caches, ok = pr.p.load_pooled(pr.p_caches[0], "b", [["h0", "h1", "h2"]], 0, 32,
                                      [[3, 4, 8]])
    pr.p_caches[0] = caches
    assert ok
    for cache, want in zip(pr.p_caches[0], pooled):
        assert (as_bits(cache)[[3, 4]] == want).all()
    assert pr.p.stats().counters["p_pool_load_blocks"] == 2
    pr.p.add_request("b", 40)  # the request goes on as any other, pool or not
    assert pr.p.scheduler.pools.entries() == 2


def test_a_corrupted_pooled_block_fails_the_load_and_the_engine_computes_it(pair):
    pr = pair(pool_bytes=8 * SLOT)
    _read_by_d(pr, "a", [["h0", "h1"]], [5, 9, 12], [20, 21, 22])
    with pr._lock:
        slot = pr.p.scheduler.pools.pools[0]._entries["h1"].slots[0]
        pr.p.stagings[0].regions[1][slot].view(np.uint8).reshape(-1)[11] ^= 0x20
        _, ok = pr.p.load_pooled(pr.p_caches[0], "b", [["h0", "h1"]], 0, 32, [[3, 4]])
    assert not ok


def test_the_pool_stays_within_its_budget_least_recently_used_first(pair):
    pr = pair(pool_bytes=2 * SLOT)  # two blocks
    _read_by_d(pr, "a", [["a0", "a1"]], [5, 9, 12], [20, 21, 22])
    assert pr.p.pooled_tokens([["a0", "a1"]]) == 32
    _read_by_d(pr, "b", [["b0", "b1"]], [6, 10, 13], [23, 24, 25])
    assert pr.p.pooled_tokens([["a0", "a1"]]) == 0 and pr.p.pooled_tokens([["b0", "b1"]]) == 32


def test_without_a_pool_or_hashes_nothing_is_kept(pair):
    pr = pair()
    _read_by_d(pr, "a", [["h0", "h1"]], [5, 9, 12], [20, 21, 22])
    assert pr.p.pooled_tokens([["h0", "h1"]]) == 0
    assert pr.p.scheduler.pools.pools == [] and pr.p.slot_map.reclaim is None  # no pool: no work
    pr2 = pair(pool_bytes=8 * SLOT)
    pr2.p.add_request("a", 40)  # no hashes: nothing to key its blocks by
    pr2.save(ScheduledRequest("a", 0, 40, ([5, 9, 12],), full_table=True))
    params = pr2.p.request_finished("a")
    pr2.serve()
    assert pr2.load("a", params, [20, 21, 22]) == (["a"], [])
    pr2.wait_freed(1)
    assert pr2.p.scheduler.pools.entries() == 0


def test_a_bad_pool_setting_is_refused_by_name(pair, monkeypatch):
    with pytest.raises(InvalidInputError, match="host_pool_bytes must be a non-negative int"):
        ConnectorConfig(TransportConfig("P-pool"), host_pool_bytes=-1)
    with pytest.raises(InvalidInputError, match="host_pool_bytes must be a non-negative int"):
        ConnectorConfig(TransportConfig("P-pool"), host_pool_bytes=1.5)
    with pytest.raises(InvalidInputError, match="more than staging_blocks 32: the pool lives in"):
        pair(pool_bytes=33 * SLOT)
    assert prefill.available_memory() > 0  # Linux: MemAvailable
    monkeypatch.setattr(prefill, "available_memory", lambda: 4 * SLOT)  # less than the pool
    with pytest.raises(InvalidInputError, match=f"host_pool_bytes {8 * SLOT} is more than "
                                                f"this host's available memory"):
        pair(pool_bytes=8 * SLOT)
    with pytest.raises(InvalidInputError, match="serve must be a bool, got 'no'"):
        prefill.PrefillWorker(ConnectorConfig(TransportConfig("P-pool")), [], serve="no")


def test_bad_hashes_and_token_counts_are_refused_by_name_before_any_change(pair):
    pr = pair(pool_bytes=8 * SLOT)
    _read_by_d(pr, "a", [["h0", "h1"]], [5, 9, 12], [20, 21, 22])
    with pytest.raises(InvalidInputError, match="a 40-token prompt has 2 full ones"):
        pr.p.add_request("b", 40, block_hashes=[["h0", "h1", "h2"]])  # would pool a partial block
    assert not pr.p.scheduler.holds("b")
    for bad in ("h0", [["h0"], ["h1"]], [[["unhashable"]]], None):
        with pytest.raises(InvalidInputError, match="one list of hashable values per KV cache group"):
            pr.p.pooled_tokens(bad)
    with pytest.raises(InvalidInputError, match="num_computed_tokens must be a non-negative int"):
        pr.p.pooled_tokens([["h0"]], -16)
    assert pr.p.pooled_tokens([["h0", "h1"]], 8) == 0  # not a block boundary: nothing to load
    before = [as_bits(c).copy() for c in pr.p_caches[0]]
    with pr._lock:
        for computed, tokens, match in ((0, 24, "whole blocks"), (8, 16, "whole blocks"),
                                        (0, -16, "num_tokens must be a non-negative int")):
            with pytest.raises(InvalidInputError, match=match):
                pr.p.load_pooled(pr.p_caches[0], "b", [["h0", "h1"]], computed, tokens, [[3, 4]])
        with pytest.raises(InvalidInputError, match="one block table per KV cache group"):
            pr.p.load_pooled(pr.p_caches[0], "b", [["h0", "h1"]], 0, 32, [3, 4])
    assert all((as_bits(c) == b).all() for c, b in zip(pr.p_caches[0], before))
    assert all(e.refs == 0 for e in pr.p.scheduler.pools.pools[0]._entries.values())


def _entry_slots(pr, hashes):
    entries = pr.p.scheduler.pools.pools[0]._entries
    return [s for h in hashes for s in entries[h].slots]


def test_a_prompt_starting_with_pooled_blocks_names_them_and_stages_only_the_rest(pair):
    pr = pair(pool_bytes=8 * SLOT)
    _read_by_d(pr, "a", [["h0", "h1"]], [5, 9, 12], [20, 21, 22])
    pr.p_caches[0] = [rewrite_blocks(c, [7], seed=3) for c in pr.p_caches[0]]  # b's own block
    want = [as_bits(c)[[5, 9, 7]].copy() for c in pr.p_caches[0]]
    pr.p.add_request("b", 40, block_hashes=[["h0", "h1"]])
    with pr._lock:
        meta = pr.save(ScheduledRequest("b", 0, 40, ([3, 4, 7],), full_table=True))
        params = pr.p.request_finished("b")
    assert meta.blocks["b"][0] == [(2, 7)]  # the pooled two are not copied again
    assert params["groups"][0]["slots"][:2] == _entry_slots(pr, ["h0", "h1"])
    assert [k for k, _ in params["groups"][0]["entries"]] == [0, 1]
    assert pr.load("b", params, [25, 26, 27], hashes=[["h0", "h1"]]) == (["b"], [])
    for cache, expected in zip(pr.d_caches[0], want):
        assert (as_bits(cache)[[25, 26, 27]] == expected).all()


def test_requests_sharing_a_pooled_prefix_read_the_same_slots_and_each_gets_its_own_rest(pair):
    pr = pair(pool_bytes=8 * SLOT)
    _read_by_d(pr, "a", [["h0", "h1"]], [5, 9, 12], [20, 21, 22])
    params = {}
    for req_id, table in (("b", [3, 4, 7]), ("c", [3, 4, 8])):
        pr.p.add_request(req_id, 40, block_hashes=[["h0", "h1"]])
        with pr._lock:
            pr.save(ScheduledRequest(req_id, 0, 40, (table,), full_table=True))
            params[req_id] = pr.p.request_finished(req_id)
    assert params["b"]["groups"][0]["slots"][:2] == params["c"]["groups"][0]["slots"][:2]
    pool = pr.p.scheduler.pools.pools[0]
    assert [pool._entries[h].refs for h in ("h0", "h1")] == [2, 2]  # each lease holds them
    finished, failed = pr.load_all({"b": d_request(params["b"], [25, 26, 27], [["h0", "h1"]]),
                                    "c": d_request(params["c"], [28, 29, 30], [["h0", "h1"]])}, 2)
    assert sorted(finished) == ["b", "c"] and failed == []
    for cache in pr.d_caches[0]:
        bits = as_bits(cache)
        assert (bits[[25, 26]] == bits[[28, 29]]).all() and (bits[[25, 26]] == bits[[20, 21]]).all()
    pr.wait_freed(3)
    assert [pool._entries[h].refs for h in ("h0", "h1")] == [0, 0]  # the leases let go


def test_params_whose_entry_secret_or_slot_is_not_the_entrys_fail_and_never_read_as_success(pair):
    pr = pair(pool_bytes=8 * SLOT)
    _read_by_d(pr, "a", [["h0", "h1"]], [5, 9, 12], [20, 21, 22])
    _read_by_d(pr, "x", [["x0"]], [6, 10], [23, 24], tokens=20)
    pr.p.add_request("b", 40, block_hashes=[["h0", "h1"]])
    with pr._lock:
        pr.save(ScheduledRequest("b", 0, 40, ([3, 4, 7],), full_table=True))
        params = pr.p.request_finished("b")
    other = _entry_slots(pr, ["x0"])[0]
    forged_secret = {**params, "groups": [{**params["groups"][0], "entries": [
        [0, "0" * 32], params["groups"][0]["entries"][1]]}]}
    forged_slot = {**params, "groups": [{**params["groups"][0],
                                         "slots": [other, *params["groups"][0]["slots"][1:]]}]}
    assert pr.load("b", params, [25, 26, 27], hashes=[["h0", "h1"]]) == (["b"], [])  # real
    for i, forged in enumerate((forged_secret, forged_slot)):
        assert pr.load(f"b{i}", forged, [28, 29, 30], hashes=[["h0", "h1"]]) == ([], [f"b{i}"])


def test_pooled_blocks_read_for_a_prompt_whose_hashes_differ_fail_their_tags(pair):
    """Params P really issued, naming pool entries h0 and h1, given to a D whose own prompt
    hashes its blocks otherwise (another prompt, cache salt or LoRA adapter): the entries'
    tags are bound to their block hashes and D checks them under its own, so the read fails
    and nothing is written; a D that knows no hashes reads no entry as good either."""
    pr = pair(pool_bytes=8 * SLOT)
    _read_by_d(pr, "a", [["h0", "h1"]], [5, 9, 12], [20, 21, 22])
    pr.p.add_request("b", 40, block_hashes=[["h0", "h1"]])
    with pr._lock:
        pr.save(ScheduledRequest("b", 0, 40, ([3, 4, 7],), full_table=True))
        params = pr.p.request_finished("b")
    before = [as_bits(c)[[25, 26, 27]].copy() for c in pr.d_caches[0]]
    assert pr.load("b1", params, [25, 26, 27], hashes=[["y0", "h1"]]) == ([], ["b1"])
    assert pr.load("b2", params, [25, 26, 27], hashes=[["h0", "y1"]]) == ([], ["b2"])
    assert pr.load("b3", params, [25, 26, 27]) == ([], ["b3"])
    for cache, bits in zip(pr.d_caches[0], before):
        assert (as_bits(cache)[[25, 26, 27]] == bits).all()
    assert pr.load("b", params, [25, 26, 27], hashes=[["h0", "h1"]]) == (["b"], [])


def _kept(pr, req_id, table, hashes, **kw):
    """A finished request kept in the pool (`keep_finished`): the save that gathers it, and
    what `get_finished` reported after it."""
    delay = pr.p.keep_finished(req_id, [table], hashes, **kw)
    meta = pr.save()
    return delay, meta, pr.p.get_finished()


def test_a_finished_requests_full_blocks_enter_the_pool_once_gathered_and_load_byte_exact(pair):
    pr = pair(pool_bytes=8 * SLOT)  # an instance that pools what it decoded (a D's pool)
    want = [as_bits(c)[[5, 9]].copy() for c in pr.p_caches[0]]
    assert pr.p.pooled_tokens([["g0", "g1"]]) == 0
    delay, meta, freed = _kept(pr, "a", [5, 9, 12], [["g0", "g1"]])
    # The engine keeps a's device blocks until this save gathered them; then they are free.
    assert delay and meta.keeps == ["a"] and freed == ["a"]
    assert [pos for pos, _ in meta.blocks["a"][0]] == [0, 1]  # the full blocks only
    assert pr.p.scheduler.held() == [] and pr.p.pooled_tokens([["g0", "g1", "g2"]]) == 32
    pr.p_caches[0] = [rewrite_blocks(c, [5, 9, 3, 4], seed=3) for c in pr.p_caches[0]]
    caches, ok = pr.p.load_pooled(pr.p_caches[0], "b", [["g0", "g1"]], 0, 32, [[3, 4]])
    assert ok
    for cache, bits in zip(caches, want):
        assert (as_bits(cache)[[3, 4]] == bits).all()


def test_a_kept_request_gathers_only_what_the_pool_lacks(pair):
    pr = pair(pool_bytes=8 * SLOT)
    _kept(pr, "a", [5, 9, 12], [["g0", "g1"]])
    delay, meta, freed = _kept(pr, "b", [5, 9, 12, 13], [["g0", "g1", "g2"]])
    assert delay and [pos for pos, _ in meta.blocks["b"][0]] == [2] and freed == ["b"]
    assert pr.p.scheduler.pools.entries() == 3
    # Everything pooled already: nothing to gather, the device blocks need not wait.
    delay, meta, freed = _kept(pr, "c", [5, 9, 12], [["g0", "g1", "g2"]])
    assert not delay and meta.keeps == [] and freed == []
    assert pr.p.scheduler.held() == [] and pr.p.scheduler.pools.entries() == 3


def test_keeping_needs_a_pool_and_refuses_bad_tables_by_name(pair):
    assert not pair().p.keep_finished("a", [[5, 9]], [["g0", "g1"]])  # no pool: nothing kept
    pr = pair(pool_bytes=8 * SLOT)
    assert not pr.p.keep_finished("a", [[5, 9]], [[]])  # no full block
    with pytest.raises(InvalidInputError, match="one block table per KV cache group"):
        pr.p.keep_finished("a", [[5, 9], [1, 2]], [["g0", "g1"]])
    with pytest.raises(InvalidInputError, match="block_hashes must hold one list"):
        pr.p.keep_finished("a", [[5, 9]], "g0")
    # A table shorter than the hashes it is kept under: not pooled, nothing held.
    assert not pr.p.keep_finished("a", [[5]], [["g0", "g1"]])
    assert pr.p.scheduler.held() == [] and pr.p.slot_map.num_free_slots == pr.p.slot_map.num_slots


def test_a_cache_reset_keeps_out_of_the_pool_what_was_computed_before_it(pair):
    """vLLM's cache reset (new weights) clears the pool; a finished request whose blocks are
    still being gathered, and a request P still holds for D, were computed before it: neither
    enters the pool once freed."""
    pr = pair(pool_bytes=8 * SLOT)
    assert pr.p.keep_finished("a", [[5, 9, 12]], [["g0", "g1"]])
    pr.p.add_request("b", 40, block_hashes=[["b0", "b1"]])
    pr.save(ScheduledRequest("b", 0, 40, ([6, 10, 13],), full_table=True))  # a's gather too
    assert pr.p.request_finished("b") is not None
    pr.p.scheduler.pools.clear()  # the reset, while a is gathered and b is held for D
    pr.serve()
    assert "a" in pr.wait_freed(1)
    pr.p.scheduler.release(["b"])  # as if D had read it
    assert pr.p.scheduler.pools.entries() == 0
    assert pr.p.pooled_tokens([["g0", "g1"]]) == 0 and pr.p.pooled_tokens([["b0", "b1"]]) == 0
    assert pr.p.slot_map.num_free_slots == pr.p.slot_map.num_slots  # nothing stays


def test_a_hashed_block_staged_in_part_is_tagged_as_the_requests_until_it_is_whole(pair):
    """A chunk that ends inside a hashed block stages it under the request's secret: only the
    chunk that completes it tags it from its entry secret, so params naming that entry (stale
    ones, after the entry was evicted and its slot taken by this request) fail on it."""
    pr = pair(pool_bytes=8 * SLOT)
    pr.p.add_request("a", 40, block_hashes=[["h0", "h1"]])
    entries = {pos: s for pos, (s, _) in pr.p.scheduler._entries["a"][0].items()}
    first = pr.save(ScheduledRequest("a", 0, 24, ([5, 9],), full_table=True))
    assert first.entries["a"] == ({0: entries[0]},)  # block 1 holds 8 of its 16 tokens
    second = pr.save(ScheduledRequest("a", 24, 16, ([12],)))
    assert second.entries["a"] == ({1: entries[1]},)  # whole now, staged again: its entry's
    slots = second.slots["a"][0]
    bound = bound_secret(entries[1], hash_hex("h1"))
    assert (pr.p.stagings[0].tags[list(slots)][0, :TAG_WORDS] == tags_of([bound], 0, [1])[0]).all()


def test_a_cache_reset_revokes_every_block_staged_or_lent_before_it(pair):
    """After a reset (new weights), params issued before it fail, whether they name pooled
    blocks lent to them or blocks of their own, though nothing about them changed; a request
    staged after it is read as any other."""
    pr = pair(pool_bytes=8 * SLOT)
    _read_by_d(pr, "a", [["h0", "h1"]], [5, 9, 12], [20, 21, 22])
    pr.p.add_request("b", 40, block_hashes=[["h0", "h1"]])
    with pr._lock:
        pr.save(ScheduledRequest("b", 0, 40, ([3, 4, 7],), full_table=True))
        params = pr.p.request_finished("b")  # h0 and h1 lent to it, its third block its own
        pr.p.scheduler.reset()
        assert pr.save().revoke and not pr.save().revoke  # once, before anything is staged
    before = [as_bits(c)[[25, 26, 27]].copy() for c in pr.d_caches[0]]
    assert pr.load("b", params, [25, 26, 27], hashes=[["h0", "h1"]]) == ([], ["b"])
    for cache, bits in zip(pr.d_caches[0], before):
        assert (as_bits(cache)[[25, 26, 27]] == bits).all()
    assert pr.p.stats().counters["p_failed_revoked"] == 1
    assert pr.p.pooled_tokens([["h0", "h1"]]) == 0
    _read_by_d(pr, "c", [["h0", "h1"]], [5, 9, 12], [28, 29, 30])  # staged after: read
