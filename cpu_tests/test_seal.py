"""Sealed staging (`seal_kv`, `kvxfer.device.seal`): P encrypts every block and fingerprint
row it stages where NIXL registers them, so a peer or a link sees ciphertext; D opens what
it read under the secrets its tags checked under, and P's own pool loads open a copy. Byte
for byte through the connectors, on both backends."""

import os
import sys

import numpy as np
import pytest

from kvxfer.connector.config import ConnectorConfig
from kvxfer.device.seal import nonces_of, opened, scratch, seal
from kvxfer.device.staging import TAG_WORDS, Staging
from kvxfer.errors import InvalidInputError
from kvxfer.nixl.agent import TransportConfig
from kvxfer.plan.save_plan import ScheduledRequest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from procs.pair import as_bits, copy_block, rewrite_blocks  # noqa: E402
from test_pool_prefill import SLOT, _read_by_d  # noqa: E402


def _same_bytes(a, b):
    """The fraction of bytes two arrays have in common, position by position."""
    return float((np.asarray(a).view(np.uint8) == np.asarray(b).view(np.uint8)).mean())


def _clear(staging, slots):
    """A scratch holding what `slots` hold now: what P gathered, to seal into them."""
    clear = scratch(staging, len(slots))
    for src, dst in zip((*staging.regions, staging.prints), (*clear.regions, clear.prints)):
        dst[...] = src[slots]
    return clear


def test_sealed_blocks_reach_d_byte_exact_while_p_staging_holds_only_ciphertext(pair, backend):
    pr = pair(seal=True)
    pr.p.add_request("r", 40)
    pr.save(ScheduledRequest("r", 0, 24, ([5, 9],), full_table=True))
    staging = pr.p.stagings[0]
    first = staging.tags[:, TAG_WORDS:].copy()
    pr.p_caches[0] = [copy_block(c, 9, 7) for c in pr.p_caches[0]]  # the next chunk rewrites 9
    pr.save(ScheduledRequest("r", 24, 16, ([12],)))
    params = pr.p.request_finished("r")
    slots = params["groups"][0]["slots"]
    nonces = staging.tags[slots, TAG_WORDS:]
    assert nonces.any(axis=1).all() and len({tuple(n) for n in nonces}) == 3
    assert (nonces[0] == first[slots[0]]).all() and (nonces[1] != first[slots[1]]).any()
    clear, rows, unknown = opened(staging, 0, slots)
    assert clear is not staging and unknown == []
    for layer, region in enumerate(staging.regions):  # ciphertext: about 1 byte in 256 alike
        assert _same_bytes(region[slots], clear.regions[layer][rows]) < 0.02
    assert _same_bytes(staging.prints[slots], clear.prints[rows]) < 0.1
    pr.serve()
    assert pr.load("r", params, [20, 21, 22]) == (["r"], [])  # D itself seals nothing
    for p_cache, d_cache in zip(pr.p_caches[0], pr.d_caches[0]):
        assert (as_bits(d_cache)[[20, 21, 22]] == as_bits(p_cache)[[5, 9, 12]]).all()
        assert (as_bits(d_cache)[21] == as_bits(p_cache)[7]).all()


def test_a_sealed_pooled_block_loads_on_p_from_a_copy_and_stays_sealed(pair):
    pr = pair(seal=True, pool_bytes=8 * SLOT)
    _read_by_d(pr, "a", [["h0", "h1"]], [5, 9, 12], [20, 21, 22])
    pooled = [as_bits(c)[[5, 9]].copy() for c in pr.p_caches[0]]
    staging = pr.p.stagings[0]
    lying = [region.copy() for region in staging.regions]
    pr.p_caches[0] = [rewrite_blocks(c, [5, 9, 3, 4], seed=7) for c in pr.p_caches[0]]
    with pr._lock:
        caches, ok = pr.p.load_pooled(pr.p_caches[0], "b", [["h0", "h1", "h2"]], 0, 32,
                                      [[3, 4, 8]])
    assert ok
    for cache, want in zip(caches, pooled):
        assert (as_bits(cache)[[3, 4]] == want).all()
    for region, before in zip(staging.regions, lying):  # never opened where it lies
        assert (region.view(np.uint16) == before.view(np.uint16)).all()


def test_a_sealed_block_whose_secret_is_wrong_or_unknown_fails_its_fingerprints(pair):
    pr = pair(seal=True)
    pr.p.add_request("r", 32)
    pr.save(ScheduledRequest("r", 0, 32, ([5, 9],), full_table=True))
    params = pr.p.request_finished("r")
    staging, slots = pr.p.stagings[0], params["groups"][0]["slots"]
    right, rows, _ = opened(staging, 0, slots)
    staging.secrets[slots[0]] = "0" * 32
    wrong, _, _ = opened(staging, 0, slots)
    assert _same_bytes(wrong.prints[0], right.prints[0]) < 0.1
    assert (wrong.prints[1] == right.prints[1]).all()
    del staging.secrets[slots[0]]
    _, _, unknown = opened(staging, 0, slots)
    assert unknown == [0]


def test_sealing_a_staging_round_trips_every_dtype_and_layout():
    import ml_dtypes  # noqa: F401 (bfloat16 as a numpy dtype)

    for dtype, shape in ((np.uint8, (3, 5)), ("bfloat16", (16, 4, 2, 32)), (np.float32, (7,))):
        staging = Staging(2, 6, shape, dtype, prints_per_layer=2)
        rng = np.random.default_rng(0)
        for region in staging.regions:
            region.view(np.uint8)[...] = rng.integers(0, 256, region.nbytes, np.uint8).reshape(
                region.view(np.uint8).shape)
        staging.prints[...] = rng.integers(0, 2**32, staging.prints.shape, np.uint32)
        want = [r[[1, 4]].copy() for r in staging.regions], staging.prints[[1, 4]].copy()
        seal(staging, 1, [1, 4], ["ab" * 16, "cd" * 16], count=3, clear=_clear(staging, [1, 4]))
        assert (staging.tags[[1, 4], TAG_WORDS:] == nonces_of(3, [1, 4])).all()
        clear, rows, unknown = opened(staging, 1, [4, 0, 1])
        assert unknown == [] and list(rows) == [0, 1, 2]
        for region, plain in zip(clear.regions, want[0]):
            assert (region[[2, 0]].view(np.uint8) == plain.view(np.uint8)).all()
        assert (clear.prints[[2, 0]] == want[1]).all()
        assert _same_bytes(clear.regions[0][1], staging.regions[0][0]) == 1.0  # not sealed: as it lies
        other, _, _ = opened(staging, 0, [1])  # the group is part of the counter block
        assert _same_bytes(other.regions[0][0], want[0][0][0]) < 0.1


def test_nonces_are_distinct_per_save_and_slot_and_bad_ones_are_refused_by_name():
    seen = {tuple(n) for c in (1, 2, 3) for n in nonces_of(c, range(64))}
    assert len(seen) == 3 * 64 and (0, 0) not in seen
    with pytest.raises(InvalidInputError, match="slot 16777216"):
        nonces_of(1, [2**24])
    with pytest.raises(InvalidInputError, match="save count"):
        nonces_of(0, [1])
    with pytest.raises(InvalidInputError, match="seal_kv must be a bool, got 'yes'"):
        ConnectorConfig(TransportConfig("x"), seal_kv="yes")


def test_a_piece_sealed_alone_is_the_same_ciphertext_as_its_units_of_the_whole_block():
    """Each unit takes the stream at its own place in the whole block: P processes that
    stage one unit each seal what one process staging both would, so a D whose processes
    split the units otherwise opens them."""
    rng = np.random.default_rng(1)
    whole = Staging(3, 4, (2, 5, 8), np.uint16, prints_per_layer=2)  # 2 units of [5, 8]
    for region in whole.regions:
        region[...] = rng.integers(0, 2**16, region.shape, np.uint16)
    whole.prints[...] = rng.integers(0, 2**32, whole.prints.shape, np.uint32)
    halves = [Staging(3, 4, (1, 5, 8), np.uint16, prints_per_layer=1) for _ in range(2)]
    for u, half in enumerate(halves):
        for region, full in zip(half.regions, whole.regions):
            region[...] = full[:, u : u + 1]
        half.prints[...] = whole.prints[:, u : u + 1]
        seal(half, 0, [2], ["ef" * 16], count=5, clear=_clear(half, [2]), first=u, units=2)
    seal(whole, 0, [2], ["ef" * 16], count=5, clear=_clear(whole, [2]))
    for u, half in enumerate(halves):
        for region, full in zip(half.regions, whole.regions):
            assert (region[2] == full[2, u : u + 1]).all()
        assert (half.prints[2] == whole.prints[2, u : u + 1]).all()


def test_p_gathers_outside_what_nixl_registers_so_its_staging_never_holds_the_clear_kv(
        pair, monkeypatch):
    """At the moment P seals, its staging slots do not hold the gathered KV (which a peer
    polling READs would otherwise catch between the gather and the seal): P gathered into a
    scratch NIXL never registered."""
    import kvxfer.connector.prefill as prefill

    seen = []

    def watching(staging, group, slots, secrets, count, clear, *rest):
        seen.append(max(_same_bytes(r[slots], c) for r, c in zip(staging.regions, clear.regions)))
        return seal(staging, group, slots, secrets, count, clear, *rest)

    monkeypatch.setattr(prefill, "seal", watching)
    pr = pair(seal=True)
    pr.p.add_request("r", 40)
    pr.save(ScheduledRequest("r", 0, 40, ([5, 9, 12],), full_table=True))
    assert len(seen) == 1 and seen[0] < 0.1
    pr.serve()
    assert pr.load("r", pr.p.request_finished("r"), [20, 21, 22]) == (["r"], [])
