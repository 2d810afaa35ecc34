"""Connectors in one process: P on devices 0-3, D on devices 4-7, two NIXL agents.

P's transport is polled from a background thread once P's saves are done
(each transport is used from one thread at a time), so D's handshake and
reads get answers while the test drives D.
"""

import itertools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kvxfer.connector import ConnectorConfig, DecodeConnector, PrefillConnector
from kvxfer.scheduler import GroupSpec, ScheduledRequest
from kvxfer.transport import TransportConfig

SHAPE = (32, 16, 4, 2, 32)  # [blocks, tokens, heads*2/p, p, dim], bf16
_names = itertools.count()


def caches_on(devices, seed, layers=2):
    mesh = Mesh(np.array(devices).reshape(1, len(devices)), ("data", "model"))
    sharding = NamedSharding(mesh, PartitionSpec(None, None, "model"))
    rng = np.random.default_rng(seed)
    return [jax.device_put(jax.lax.bitcast_convert_type(
        jnp.asarray(rng.integers(0, 1 << 16, SHAPE, dtype=np.uint16)), jnp.bfloat16), sharding)
        for _ in range(layers)]


def as_bits(cache):
    return np.asarray(cache).view(np.uint16)


def copy_block(cache, dst, src):
    """`cache` with block `src` copied over `dst`, as bits (a float op could canonicalize NaNs)."""
    bits = jax.lax.bitcast_convert_type(cache, jnp.uint16)
    return jax.lax.bitcast_convert_type(bits.at[dst].set(bits[src]), jnp.bfloat16)


class Pair:
    """A P and a D connector; P is served from a thread after `serve()`."""

    def __init__(self, kernel_ratio=1, block_size=16, deadline=10.0):
        n = next(_names)
        cfg = dict(staging_blocks=SHAPE[0], kernel_ratio=kernel_ratio)
        devices = jax.devices()
        self.p_caches = caches_on(devices[:4], seed=1)
        self.d_caches = caches_on(devices[4:], seed=2)
        self.p = PrefillConnector(ConnectorConfig(TransportConfig(f"P{n}"), **cfg),
                                  [GroupSpec(block_size)], self.p_caches)
        self.d = DecodeConnector(ConnectorConfig(
            TransportConfig(f"D{n}", transfer_timeout_s=deadline), **cfg), self.d_caches)
        self.freed, self._stop, self._thread = [], threading.Event(), None

    def save(self, step):
        meta = self.p.build_connector_meta([step])
        self.p.wait_for_save(self.p_caches, meta)
        return meta

    def serve(self):
        def loop():
            while not self._stop.is_set():
                self.freed += self.p.get_finished()
                self._stop.wait(0.001)
        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def load(self, req_id, params, d_ids, timeout=20.0):
        self.d.start_load_kv({req_id: (params, d_ids)})
        finished, failed = [], []
        deadline = threading.Event()
        timer = threading.Timer(timeout, deadline.set)
        timer.start()
        try:
            while not (finished or failed or deadline.is_set()):
                self.d_caches, finished, failed = self.d.get_finished(self.d_caches)
        finally:
            timer.cancel()
        return finished, failed

    def close(self):
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)
        self.d.close()
        self.p.close()


@pytest.fixture
def pair():
    made = []

    def make(**kw):
        made.append(Pair(**kw))
        return made[-1]
    yield make
    for p in made:
        p.close()


def test_d_receives_newest_copy_of_block_rewritten_by_later_chunk(pair):
    pr = pair()
    pr.p.add_request("r", 40)
    pr.save(ScheduledRequest("r", 0, 24, ([5, 9],), full_table=True))
    # The next chunk writes the rest of block 9 (tokens 24-31) and block 12.
    pr.p_caches = [copy_block(c, 9, 7) for c in pr.p_caches]
    meta = pr.save(ScheduledRequest("r", 24, 16, ([12],)))
    assert meta.kernel_ids == {"r": [9, 12]} and meta.completed == {"r"}
    params = pr.p.request_finished("r")
    pr.serve()
    finished, failed = pr.load("r", params, [20, 21, 22])
    assert (finished, failed) == (["r"], [])
    for p_cache, d_cache in zip(pr.p_caches, pr.d_caches):
        assert (as_bits(d_cache)[[20, 21, 22]] == as_bits(p_cache)[[5, 9, 12]]).all()
        assert (as_bits(d_cache)[21] == as_bits(p_cache)[7]).all()
    assert pr.d.get_block_ids_with_load_errors() == set()


def test_corrupted_host_block_fails_request_in_logical_ids_and_leaves_caches(pair):
    pr = pair(kernel_ratio=2, block_size=32)  # logical blocks of 32 tokens = 2 kernel blocks
    pr.p.add_request("r", 50)
    meta = pr.save(ScheduledRequest("r", 0, 50, ([3, 7],), full_table=True))
    assert meta.kernel_ids == {"r": [6, 7, 14, 15]}
    params = pr.p.request_finished("r")
    # One bit flips in P's staged copy of kernel block 14 (kernel position 2: the first half of table
    # entry 1), after its fingerprint was taken. Staging is keyed by position.
    slot = pr.p.staging.slot("r", 2)
    pr.p.staging.regions[1][slot].view(np.uint8).reshape(-1)[100] ^= 0x01
    before = [as_bits(c).copy() for c in pr.d_caches]
    pr.serve()
    finished, failed = pr.load("r", params, [10, 11])
    assert (finished, failed) == ([], ["r"])
    assert pr.d.get_block_ids_with_load_errors() == {10, 11}
    for b, c in zip(before, pr.d_caches):
        assert (as_bits(c) == b).all()


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
    for p_cache, d_cache in zip(pr.p_caches, pr.d_caches):
        assert (as_bits(d_cache)[[1, 2, 3]] == as_bits(p_cache)[[2, 3, 4]]).all()


def test_abort_mid_prefill_frees_staging(pair):
    pr = pair()
    pr.p.add_request("r", 100)
    pr.save(ScheduledRequest("r", 0, 24, ([5, 9],), full_table=True))
    assert "r" in pr.p.staging
    pr.p.abort("r")
    assert "r" not in pr.p.staging and "r" not in pr.p.tracker
    assert pr.p.request_finished("r") is None


def test_corrupt_request_does_not_spoil_a_good_one_finished_in_the_same_poll(pair):
    pr = pair()
    for req_id, ids in (("bad", [4, 5]), ("good", [8, 9])):
        pr.p.add_request(req_id, 32)
        pr.save(ScheduledRequest(req_id, 0, 32, (ids,), full_table=True))
    params = {r: pr.p.request_finished(r) for r in ("bad", "good")}
    pr.p.staging.regions[0][pr.p.staging.slot("bad", 1)].view(np.uint8)[0] ^= 0x80
    before = [as_bits(c).copy() for c in pr.d_caches]
    pr.serve()
    pr.d.start_load_kv({"bad": (params["bad"], [1, 2]), "good": (params["good"], [3, 4])})
    # The two may finish in one poll (rows share one buffer) or in two.
    deadline = threading.Event()
    timer = threading.Timer(20.0, deadline.set)
    timer.start()
    finished, failed = [], []
    while len(finished) + len(failed) < 2 and not deadline.is_set():
        pr.d_caches, f, x = pr.d.get_finished(pr.d_caches)
        finished, failed = finished + f, failed + x
    timer.cancel()
    assert (finished, failed) == (["good"], ["bad"])
    assert pr.d.get_block_ids_with_load_errors() == {1, 2}
    for b, p_cache, d_cache in zip(before, pr.p_caches, pr.d_caches):
        assert (as_bits(d_cache)[[3, 4]] == as_bits(p_cache)[[8, 9]]).all()
        assert (as_bits(d_cache)[[1, 2]] == b[[1, 2]]).all()
