"""`kvxfer.vllm.TPUConnector` between two real vLLM schedulers: P (kv_producer) and D (kv_consumer).

Each engine loads the connector through vLLM's factory, on both roles, over
JAX caches on CPU devices (tpu-inference's layout and sharding). P is stepped
from a thread (as its engine loop would run), so it answers D's handshake
and reads while the test steps D. The simulated forward writes a stamp of
(layer, position, token) into every token's KV, so D's caches can be checked
byte for byte at D's own block ids.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import msgspec
import numpy as np
import pytest
from engine import Engine, kv_slot_shape, listen_port
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from kvxfer.device.seal import opened
from kvxfer.errors import InvalidInputError
from kvxfer.nixl.decode import DecodeTransport
from kvxfer.nixl.wire import new_stream_id
from kvxfer.vllm.connector import block_hashing
from kvxfer.vllm.fallbacks import counter_name
from kvxfer.vllm.settings import Settings
from kvxfer.vllm.worker_side import WorkerSide


def _prompt(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(10, 1000, size=n)]


class ServedP:
    """P's engine stepped from a thread; requests go in under a lock."""

    def __init__(self, engine: Engine):
        self.engine, self.finished, self.steps = engine, {}, []
        self._lock, self._stop = threading.Lock(), threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                res = self.engine.step()
            if res.scheduler_output is not None:
                self.steps.append(res)
                self.finished.update(res.finished)
            else:
                time.sleep(0.002)

    def call(self, fn, *args, **kw):
        with self._lock:
            return fn(*args, **kw)

    def prefill(self, req_id: str, prompt: list[int], timeout: float = 60.0,
                cache_salt: str | None = None, **params) -> dict | None:
        """Adds a remote-decode request (its `kv_transfer_params` also `params`) and waits for
        its params (None when P sends nothing)."""
        self.call(self.engine.add_request, req_id, prompt, max_tokens=1, cache_salt=cache_salt,
                  kv_transfer_params={"do_remote_decode": True, **params})
        return self.wait(req_id, timeout)

    def wait(self, req_id: str, timeout: float = 60.0) -> dict | None:
        """Waits until the engine finished `req_id`; returns its params."""
        self.until(lambda: req_id in self.finished, timeout, f"never finished {req_id}")
        return self.finished[req_id]

    def until(self, predicate, timeout: float = 10.0, what: str = "never") -> None:
        deadline = time.monotonic() + timeout
        while not self.call(predicate):
            assert time.monotonic() < deadline, what
            time.sleep(0.005)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.fixture
def pd(model_dir, engines):
    """`make(**p_kw, d=dict(**d_kw)) -> (ServedP, D engine)`: P on devices 0-3, D on 4-7 by default."""
    served = []

    def make(p_devices=(0, 1, 2, 3), d_devices=(4, 5, 6, 7), d=None, model=None, **p_kw):
        devices = jax.devices()
        p_extra = {"port": listen_port(), "staging_blocks": 64, "lease_s": 30.0}
        p_extra.update(p_kw.pop("extra", {}))
        p = engines(model or model_dir, kv_role="kv_producer", extra_config=p_extra,
                    devices=[devices[i] for i in p_devices], **p_kw)
        d_kw = dict(d or {})
        d_extra = {"staging_blocks": 64, "transfer_timeout_s": 10.0, "handshake_timeout_s": 3.0}
        d_extra.update(d_kw.pop("extra", {}))
        dec = engines(model or model_dir, kv_role="kv_consumer", extra_config=d_extra,
                      devices=[devices[i] for i in d_devices], **d_kw)
        served.append(ServedP(p))
        return served[-1], dec

    yield make
    for s in served:
        s.stop()


def decode(d: Engine, req_id: str, prompt: list[int], params: dict, max_tokens: int = 2):
    """Adds the request on D with P's params; steps D until it finishes. Returns every step."""
    d.add_request(req_id, prompt, max_tokens=max_tokens, kv_transfer_params=params)
    return d.run_until(lambda r: req_id in r.finished, max_steps=400, min_s=30.0)


def assert_prompt_kv(d: Engine, req_id: str, prompt: list[int], window: int | None = None):
    """Every prompt token's KV (for sliding-window layers, the last `window`) is P's stamp."""
    for layer in range(d.num_layers):
        lo = 0
        if window is not None and d.layer_group[f"model.layers.{layer}.self_attn.attn"] == 1:
            lo = len(prompt) - window
        for pos in range(lo, len(prompt)):
            block, row = d.slot_of(req_id, layer, pos)
            np.testing.assert_array_equal(d.read_token_kv(layer, block, row),
                                          d.stamp(layer, pos, prompt[pos]),
                                          err_msg=f"layer {layer} position {pos}")


def scheduled_tokens(steps, req_id):
    """(num_computed_tokens at the first scheduling, tokens D computed for `req_id` in all)."""
    first, total = None, 0
    for r in steps:
        so = r.scheduler_output
        if so is None or req_id not in so.num_scheduled_tokens:
            continue
        if first is None:
            new = {n.req_id: n for n in so.scheduled_new_reqs}
            first = new[req_id].num_computed_tokens if req_id in new else None
        total += so.num_scheduled_tokens[req_id]
    return first, total


def test_chunked_prefill_moves_every_prompt_token_byte_exact_tp4_to_tp2(pd):
    p, d = pd(d_devices=(4, 5), max_num_batched_tokens=24)  # chunks of 24 straddle 16-token blocks
    prompt = _prompt(1, 70)
    params = p.prefill("r", prompt)
    assert params["do_remote_prefill"] and params["num_prompt_tokens"] == 70
    steps = decode(d, "r-d", prompt, params)
    # D's forward computed only the last prompt token and the decode: the rest came from P.
    first, total = scheduled_tokens(steps, "r-d")
    assert first == 69
    # The request was not scheduled before the step that reported its KV received.
    received = next(i for i, r in enumerate(steps)
                    if r.connector_output and "r-d" in (r.connector_output.finished_recving or ()))
    assert all("r-d" not in (r.scheduler_output.num_scheduled_tokens if r.scheduler_output else {})
               for r in steps[: received + 1])
    assert_prompt_kv(d, "r-d", prompt)


def test_p_frees_device_blocks_at_once_and_staging_once_d_has_read(pd):
    p, d = pd()
    pool = p.engine.scheduler.kv_cache_manager.block_pool
    free_before = p.call(pool.get_num_free_blocks)
    params = p.prefill("r", _prompt(2, 50))
    # Finished on P: its device blocks are back in the pool although D has not read yet.
    assert p.call(pool.get_num_free_blocks) == free_before
    assert p.call(p.engine.connector.has_pending_push_work)
    decode(d, "r-d", _prompt(2, 50), params)
    deadline = time.monotonic() + 10
    while p.call(p.engine.connector.has_pending_push_work):
        assert time.monotonic() < deadline, "P never learned that D read its staging"
        time.sleep(0.01)
    slot_map = p.engine.connector._scheduler.prefill.slot_maps[0]
    assert slot_map.num_free_slots == slot_map.num_slots
    assert_prompt_kv(d, "r-d", _prompt(2, 50))


def test_speculative_lookahead_on_p_and_d(pd):
    p, d = pd(num_speculative_lookahead=2, d=dict(num_speculative_lookahead=2))
    prompt = _prompt(3, 45)
    params = p.prefill("r", prompt)
    decode(d, "r-d", prompt, params, max_tokens=5)
    assert_prompt_kv(d, "r-d", prompt)


def test_prefix_cache_hit_on_p_still_sends_the_whole_prompt(pd):
    p, d = pd()
    shared = _prompt(4, 32)
    first, second = shared + _prompt(5, 10), shared + _prompt(6, 20)
    decode(d, "a-d", first, p.prefill("a", first))
    params = p.prefill("b", second)  # P computes only 20 of its tokens
    b_steps = [r for r in p.steps if r.scheduler_output and "b" in r.scheduler_output.num_scheduled_tokens]
    assert sum(r.scheduler_output.num_scheduled_tokens["b"] for r in b_steps) == 20
    assert params["groups"][0]["keys"] == [0, 1, 2, 3]
    # (D holds "a"'s first two blocks too and reads only the rest: the next test checks that.)
    decode(d, "b-d", second, params)
    assert_prompt_kv(d, "b-d", second)


POOL_SLOT = 2 * 16 * int(np.prod(kv_slot_shape(4, 32, jnp.bfloat16))) * 2
"""Bytes of one staging slot: 2 layers x 16 tokens of [4, 2, 32] bf16."""


def _pool_pair(pd, slots: int = 8, **p_kw):
    """P with a host pool of `slots` blocks and D, neither with a device prefix cache (so every
    hit is the pool's)."""
    return pd(enable_prefix_caching=False, kv_load_failure_policy="recompute",
              extra={"host_pool_bytes": slots * POOL_SLOT}, d=dict(enable_prefix_caching=False),
              **p_kw)


def _released(p, n: int = 0) -> None:
    """Waits until P holds no more than `n` requests for D (the rest went into its pool)."""
    deadline = time.monotonic() + 10
    while len(p.call(p.engine.connector._scheduler.prefill.held)) > n:
        assert time.monotonic() < deadline, "P never learned that D read its staging"
        time.sleep(0.01)


def gathered(p: ServedP, transfer: str) -> list[int]:
    """The kernel positions P's steps gathered into staging for `transfer` (group 0)."""
    out = []
    for r in p.call(list, p.steps):
        save = getattr(r.scheduler_output.kv_connector_metadata, "save", None)
        if save is not None and transfer in save.blocks:
            out += [pos for pos, _ in save.blocks[transfer][0]]
    return out


def test_p_loads_what_its_host_pool_holds_instead_of_prefilling_it(pd):
    p, d = _pool_pair(pd)
    shared = _prompt(21, 48)
    first, second = shared + _prompt(22, 10), shared + _prompt(23, 20)
    decode(d, "a-d", first, p.prefill("a", first))
    _released(p)
    prefill = p.engine.connector._scheduler.prefill
    assert p.call(prefill.pools.entries) == 3  # a's full blocks; its partial one went
    params = p.prefill("b", second)
    # P computed only the 20 tokens past the pooled 48; they came from the pool, and P
    # still sent D every block of the prompt, the pooled ones included.
    first_computed, total = scheduled_tokens(p.steps, "b")
    assert (first_computed, total) == (48, 20)
    assert p.call(prefill.pools.counters)["p_pool_hit_tokens"] == 48
    assert params["groups"][0]["keys"] == [0, 1, 2, 3, 4]
    # The pooled blocks are named where the pool holds them, not copied again: P gathered
    # only b's last two blocks, and its four whole ones are tagged as pool entries.
    assert gathered(p, "b") == [3, 4]
    assert [k for k, _ in params["groups"][0]["entries"]] == [0, 1, 2, 3]
    decode(d, "b-d", second, params)
    assert_prompt_kv(d, "b-d", second)
    # A prompt that differs in its first block shares no chain with the pool: nothing loads.
    other = _prompt(24, 16) + shared[16:]
    p.prefill("c", other)
    assert scheduled_tokens(p.steps, "c") == (0, len(other))


def test_p_loads_no_more_than_leaves_the_last_prompt_token_to_compute(pd):
    p, d = _pool_pair(pd)
    prompt = _prompt(25, 48)  # three whole blocks, all pooled
    decode(d, "a-d", prompt, p.prefill("a", prompt))
    _released(p)
    params = p.prefill("b", prompt)
    assert scheduled_tokens(p.steps, "b") == (32, 16)  # the last block holds the last token
    decode(d, "b-d", prompt, params)
    assert_prompt_kv(d, "b-d", prompt)


def test_a_corrupted_pooled_block_is_recomputed_on_p_and_d_gets_the_right_kv(pd):
    p, d = _pool_pair(pd)
    shared = _prompt(26, 32)
    decode(d, "a-d", shared + [7], p.prefill("a", shared + [7]))
    _released(p)
    pool = p.engine.connector._scheduler.prefill.pools.pools[0]
    staging = p.engine.worker._worker._prefill.stagings[0]
    with p._lock:
        slot = next(iter(pool._entries.values())).slots[0]
        staging.regions[1][slot].view(np.uint8).reshape(-1)[5] ^= 0x10
    second = shared + _prompt(27, 9)
    params = p.prefill("b", second)
    received = [r for r in p.steps if r.connector_output
                and "b" in (r.connector_output.failed_recving or ())]
    assert received, "P's load of the corrupted block was not reported failed"
    assert scheduled_tokens(p.steps, "b")[1] == len(second)  # P computed all of it again
    decode(d, "b-d", second, params)
    assert_prompt_kv(d, "b-d", second)


def test_with_seal_kv_p_stages_ciphertext_and_d_and_ps_pool_load_every_token_byte_exact(pd):
    """`seal_kv` on P: what P's staging holds (where NIXL reads it) is not the KV, yet D
    decodes on P's KV, and a later prompt loads the pooled blocks on P byte exact."""
    p, d = pd(enable_prefix_caching=False, kv_load_failure_policy="recompute",
              extra={"host_pool_bytes": 8 * POOL_SLOT, "seal_kv": True},
              d=dict(enable_prefix_caching=False))
    shared = _prompt(28, 48)
    first, second = shared + _prompt(29, 5), shared + _prompt(30, 9)
    params = p.prefill("a", first)
    staging = p.engine.worker._worker._prefill.stagings[0]
    with p._lock:
        slots = params["groups"][0]["slots"]
        assert staging.tags[slots, 2:].any(axis=1).all()  # every slot sealed, under a nonce
        lying = [r[slots].astype(np.float32) for r in staging.regions]
        clear, rows, _ = opened(staging, 0, slots)
        clear = [r[rows].astype(np.float32) for r in clear.regions]
    # The simulated model's KV is small integers (|v| <= 119): opened, every value is one;
    # as NIXL serves it, about all are not.
    assert all((np.abs(c) <= 119).all() for c in clear)
    assert all((~(np.abs(c) <= 119)).mean() > 0.4 for c in lying)
    steps = decode(d, "a-d", first, params)
    assert scheduled_tokens(steps, "a-d")[0] == len(first) - 1  # read from P, not recomputed
    assert_prompt_kv(d, "a-d", first)
    _released(p)
    params = p.prefill("b", second)
    assert scheduled_tokens(p.steps, "b") == (48, 9)  # the pool's blocks, opened on P
    decode(d, "b-d", second, params)
    assert_prompt_kv(d, "b-d", second)


def test_requests_loading_the_same_pooled_blocks_in_one_step_each_get_them(pd):
    """A shared system prompt: two requests of one step load the same pooled blocks (one
    scatter would read each slot twice, which it refuses: P loads them one after the
    other), and each lets go of them once D has read it."""
    p, d = _pool_pair(pd)
    shared = _prompt(44, 48)
    a, b, c = shared + _prompt(45, 5), shared + _prompt(46, 9), shared + _prompt(47, 11)
    decode(d, "a-d", a, p.prefill("a", a))
    _released(p)

    def both():
        for req_id, prompt in (("b", b), ("c", c)):
            p.engine.add_request(req_id, prompt, max_tokens=1,
                                 kv_transfer_params={"do_remote_decode": True})
    p.call(both)
    deadline = time.monotonic() + 30
    while not {"b", "c"} <= set(p.finished):
        assert time.monotonic() < deadline, "P never finished b and c"
        time.sleep(0.01)
    assert scheduled_tokens(p.steps, "b") == (48, 9)
    assert scheduled_tokens(p.steps, "c") == (48, 11)
    for req_id, prompt in (("b", b), ("c", c)):
        decode(d, f"{req_id}-d", prompt, p.finished[req_id])
        assert_prompt_kv(d, f"{req_id}-d", prompt)
    _released(p)
    pools = p.engine.connector._scheduler.prefill.pools.pools
    assert all(e.refs == 0 for pool in pools for e in pool._entries.values())


def test_a_pool_smaller_than_a_prompt_keeps_its_head_which_a_prefix_can_reach(pd):
    p, d = _pool_pair(pd, slots=2)
    prompt = _prompt(43, 56)  # three whole blocks, the pool holds two: the first two
    decode(d, "a-d", prompt, p.prefill("a", prompt))
    _released(p)
    params = p.prefill("b", prompt)
    assert scheduled_tokens(p.steps, "b") == (32, 24)
    decode(d, "b-d", prompt, params)
    assert_prompt_kv(d, "b-d", prompt)


def _d_pool_pair(pd, slots: int = 8):
    """P and a D with a host pool of `slots` blocks, neither with a device prefix cache (so
    every hit on D is its pool's)."""
    return pd(enable_prefix_caching=False, d=dict(enable_prefix_caching=False,
                                                  extra={"host_pool_bytes": slots * POOL_SLOT}))


def _pooled_turn(p, d, seed: int) -> list[int]:
    """Turn 1 of a conversation through P, 20 tokens decoded on D; returns its prompt and
    answer once D's pool holds their whole blocks (3 of them)."""
    first = _prompt(seed, 40)
    steps = decode(d, "a-d", first, p.prefill("a", first), max_tokens=20)
    answer = [t for r in steps for t in r.new_tokens.get("a-d", [])]
    d.run_until(lambda: not d.connector.has_pending_push_work(), max_steps=5)
    assert len(answer) == 20 and d.connector._scheduler.prefill.pools.entries() == 3
    return first + answer


def _spy_reads(monkeypatch) -> dict[str, list[list[int]]]:
    """From now on, each read D starts: its request -> the block keys it reads, per group."""
    read = {}
    real = DecodeTransport.start_read

    def spy(self, req_id, params, logical_ids, *rest):
        read[req_id] = [list(k) for k in params.keys]
        return real(self, req_id, params, logical_ids, *rest)

    monkeypatch.setattr(DecodeTransport, "start_read", spy)
    return read


def test_d_pools_what_it_decoded_and_the_next_turn_loads_it_instead_of_prefilling(pd):
    p, d = _d_pool_pair(pd)
    first = _prompt(41, 40)
    steps = decode(d, "a-d", first, p.prefill("a", first), max_tokens=20)
    answer = [t for r in steps for t in r.new_tokens.get("a-d", [])]
    assert len(answer) == 20
    # a's device blocks stay until the step after it finished has gathered them; then the
    # engine frees them (the pool's copy is in host staging).
    pools = d.connector._scheduler.prefill.pools
    d.run_until(lambda: not d.connector.has_pending_push_work(), max_steps=5)
    assert pools.entries() == 3  # 59 tokens computed (the last one never is): 3 full blocks
    assert d.scheduler.kv_cache_manager.block_pool.get_num_free_blocks() == d.kv_cache_config.num_blocks - 1
    # The next turn resends the conversation: D alone (a local prefill) loads its first 48
    # tokens, the answer's included, from its pool and computes only the rest.
    second = first + answer + _prompt(42, 10)
    d.add_request("b", second, max_tokens=1,
                  kv_transfer_params={"local_prefill": True, "do_remote_prefill": False})
    steps = d.run_until(lambda r: "b" in r.finished, max_steps=100)
    assert scheduled_tokens(steps, "b") == (48, len(second) - 48)
    assert pools.counters()["p_pool_hit_tokens"] == 48
    assert_prompt_kv(d, "b", second)  # the pooled answer's KV is what D computed for it


def test_d_loads_what_its_pool_holds_and_reads_only_the_rest_from_p(pd, monkeypatch):
    """The next turn goes through P: D loads the conversation so far (its answer included)
    from its own pool and reads from P only the blocks past it."""
    p, d = _d_pool_pair(pd)
    history = _pooled_turn(p, d, 47)
    pools = d.connector._scheduler.prefill.pools
    read = _spy_reads(monkeypatch)
    second = history + _prompt(48, 10)  # 70 tokens: 3 blocks pooled, 2 more from P
    steps = decode(d, "b-d", second, p.prefill("b", second))
    assert read["b-d"] == [[3, 4]]
    assert pools.counters()["p_pool_hit_tokens"] == 48
    assert scheduled_tokens(steps, "b-d")[0] == len(second) - 1  # all of it loaded
    assert_prompt_kv(d, "b-d", second)
    outs = [r.connector_output for r in steps if r.connector_output]
    assert [r for o in outs for r in o.finished_recving or ()] == ["b-d"]  # reported once


def test_params_for_another_prompt_leave_d_its_own_pool(pd):
    """D computes a request whose params P made for another prompt itself (a fallback), but
    still loads what its own pool holds of the prompt it has."""
    p, d = _d_pool_pair(pd)
    history = _pooled_turn(p, d, 51)
    second = history + _prompt(52, 10)
    others = p.prefill("o", _prompt(53, len(second)))  # the same length, another prompt
    steps = decode(d, "b-d", second, others)
    assert d.connector._scheduler.fallbacks.counters[counter_name("other_prompt", others["peer"])] == 1
    assert d.connector._scheduler.prefill.pools.counters()["p_pool_hit_tokens"] == 48
    assert scheduled_tokens(steps, "b-d") == (48, len(second) - 48 + 1)
    assert_prompt_kv(d, "b-d", second)


def test_a_failed_read_from_p_after_a_load_from_ds_pool_fails_the_request_once_and_is_recomputed(pd):
    """D loaded half a request from its pool and reads the rest from a P that is gone: the
    request is reported failed once, naming P's blocks alone, and vLLM recomputes it; the
    entries D loaded stay in its pool."""
    p, d = _d_pool_pair(pd)
    history = _pooled_turn(p, d, 49)
    second = history + _prompt(50, 10)
    params = p.prefill("b", second)
    p.stop()
    p.engine.close()  # P is gone before D reads
    steps = decode(d, "b-d", second, params)
    outs = [r.connector_output for r in steps if r.connector_output]
    assert [r for o in outs for r in o.failed_recving or ()] == ["b-d"]
    assert len(set().union(*(o.invalid_block_ids for o in outs))) == 2  # P's two blocks
    # The pool's half checked out: its entries stay pooled (not dropped; no hit either: vLLM
    # computes the failed request whole), and vLLM's recompute of the request loads them
    # again, a hit: D computes only P's part.
    assert d.connector._scheduler.prefill.pools.counters()["p_pool_hit_tokens"] == 48
    assert scheduled_tokens(steps, "b-d")[1] == len(second) - 48 + 1
    assert d.connector._scheduler.fallbacks.counters == {counter_name("load_failed", params["peer"]): 1}
    assert_prompt_kv(d, "b-d", second)


def _reallocated(engine) -> None:
    """What tpu-inference's `reinitialize_kv_cache` does (after a weight sync): fresh, empty
    caches, then the connector's `register_runner` again."""
    engine.runner.kv_caches = [jnp.zeros_like(c) for c in engine.runner.kv_caches]
    engine.worker.register_runner(engine.runner)


def test_caches_reallocated_on_d_drop_its_pool_and_its_next_turn_is_computed_right(pd):
    """D's caches are reallocated (a weight sync): the blocks its pool held may not come back
    (their KV is of the old weights, and its slots would pass an all-zero block's check).
    The next turn computes its prompt right, and the pool's index is cleared."""
    p, d = _d_pool_pair(pd)
    history = _pooled_turn(p, d, 57)
    pools = d.connector._scheduler.prefill.pools
    prefill, decode_ = d.worker._worker._prefill, d.worker._worker._decode
    _reallocated(d)
    assert d.worker._worker._prefill is prefill and d.worker._worker._decode is decode_  # kept
    second = history + _prompt(58, 10)
    d.add_request("b", second, max_tokens=1,
                  kv_transfer_params={"local_prefill": True, "do_remote_prefill": False})
    d.run_until(lambda r: "b" in r.finished, max_steps=100)
    assert_prompt_kv(d, "b", second)
    assert pools.counters()["p_pool_hit_tokens"] == 0  # nothing loaded as a hit


def test_caches_reallocated_on_p_keep_its_agent_and_p_still_serves_d(pd):
    """P's runner registered again (its caches reallocated) keeps its NIXL agent, and the
    next request through P reaches D with the right KV."""
    p, d = _pool_pair(pd)
    first = _prompt(59, 40)
    decode(d, "a-d", first, p.prefill("a", first))
    _released(p)
    p.call(lambda: _reallocated(p.engine))
    params = p.prefill("b", first + [5])
    decode(d, "b-d", first + [5], params)
    assert_prompt_kv(d, "b-d", first + [5])
    assert p.call(p.engine.connector._scheduler.prefill.pools.counters)["p_pool_hit_tokens"] == 0


def test_caches_registered_again_laid_out_otherwise_are_refused_by_name(pd):
    p, d = _d_pool_pair(pd)
    d.runner.kv_caches = [c[:-1] for c in d.runner.kv_caches]  # a block fewer
    with pytest.raises(InvalidInputError, match="registered again with caches laid out otherwise"):
        d.worker.register_runner(d.runner)


def test_a_failed_load_from_ds_own_pool_is_not_counted_against_p(pd):
    """D loads half a request from its pool, whose entry was corrupted in host memory, and
    reads the rest from P, which goes well: the request is recomputed, and the fallback is
    counted as D's pool's (`pool_failed`, no P engine), not as a failed load from P."""
    p, d = _d_pool_pair(pd)
    history = _pooled_turn(p, d, 55)
    pool = d.connector._scheduler.prefill.pools.pools[0]
    staging = d.worker._worker._prefill.stagings[0]
    slot = next(iter(pool._entries.values())).slots[0]
    staging.regions[1][slot].view(np.uint8).reshape(-1)[5] ^= 0x10
    second = history + _prompt(56, 10)
    params = p.prefill("b", second)
    steps = decode(d, "b-d", second, params)
    outs = [r.connector_output for r in steps if r.connector_output]
    assert [r for o in outs for r in o.failed_recving or ()] == ["b-d"]
    counters = d.connector._scheduler.fallbacks.counters
    assert counters == {counter_name("pool_failed", "none"): 1}, counters
    assert_prompt_kv(d, "b-d", second)


@given(st.lists(st.tuples(st.booleans(), st.integers(0, 3), st.booleans(), st.integers(0, 3),
                          st.booleans()), min_size=1, max_size=6))
@settings(max_examples=200, deadline=None)
def test_a_request_loaded_from_the_pool_and_read_from_p_is_reported_once_when_both_are_in(plans):
    """Over any order of the two halves' results (each request: split or not, the poll its
    pool half and its read end at, whether each failed): every request is reported once,
    a split one at the poll its second half ends, failed if either half failed, and its
    pool half's failure alone named in the report (`pool_failed`)."""
    side = WorkerSide(Settings.from_extra({}, "e"), None, {}, False, True)
    side._decode = SimpleNamespace(start_load_kv=lambda loads: None, expect=None, cancel=None)
    ids = [f"r{i}" for i in range(len(plans))]
    side.start_load(SimpleNamespace(
        pool_loads={r: () for r, (split, *_) in zip(ids, plans) if split},
        loads={r: () for r in ids}, expects=[], cancels=[]))
    side._pool_loads = {}
    reported: dict[str, tuple[int, bool]] = {}
    for poll in range(4):
        ends = list(zip(ids, plans))
        pooled = {r for r, (split, at, _, _, _) in ends if split and at == poll}
        pool_failed = {r for r, (split, at, bad, _, _) in ends if split and at == poll and bad}
        read = {r for r, (_, _, _, at, _) in ends if at == poll}
        read_failed = {r for r, (_, _, _, at, bad) in ends if at == poll and bad}
        received, failed = side._whole(pooled - pool_failed, pool_failed, read - read_failed,
                                       read_failed)
        assert failed <= received and not received & reported.keys()
        reported.update((r, (poll, r in failed)) for r in received)
    pool_failed, read_failed = side._pool_failed, side._read_failed  # the next report's
    for r, (split, pool_at, pool_bad, read_at, read_bad) in zip(ids, plans):
        ends = max(pool_at, read_at) if split else read_at
        assert reported[r] == (ends, read_bad or (split and pool_bad))
        assert (r in pool_failed) == (split and pool_bad)
        assert (r in read_failed) == (split and read_bad)
    assert not side._halves


def test_d_pools_what_an_aborted_request_computed_and_then_frees_its_blocks(pd):
    """A request aborted mid-decode (a stop string, a client gone: vLLM aborts both) keeps
    the whole blocks it computed, as one that stopped does."""
    p, d = _d_pool_pair(pd)
    prompt = _prompt(43, 40)
    d.add_request("a-d", prompt, max_tokens=30, kv_transfer_params=p.prefill("a", prompt))
    d.run_until(lambda r: len(r.new_tokens.get("a-d", ())) > 0, max_steps=400, min_s=30.0)
    d.run_until(lambda: d.scheduler.requests["a-d"].num_computed_tokens >= 50, max_steps=20)
    d.abort("a-d")
    d.run_until(lambda: not d.scheduler.has_requests(), max_steps=5)
    assert d.connector._scheduler.prefill.pools.entries() == 3  # 48 of its 50 computed
    assert not d.connector.has_pending_push_work()
    pool = d.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == d.kv_cache_config.num_blocks - 1


def test_a_request_aborted_while_its_kv_is_loading_is_not_pooled_and_freed_once(pd):
    """Aborted while D waits for P's KV (here a P that never answers), a request holds blocks
    whose KV never came: none enters D's pool, and its blocks are freed once."""
    p, d = _d_pool_pair(pd)
    prompt = _prompt(44, 40)
    params = dict(p.prefill("a", prompt), port=listen_port())  # nobody listens there
    d.add_request("a-d", prompt, max_tokens=2, kv_transfer_params=params)
    d.run_until(lambda: d.connector._scheduler._receiving, max_steps=20)
    d.abort("a-d")
    d.run_until(lambda: not d.scheduler.has_requests(), max_steps=400, min_s=5.0)
    assert d.connector._scheduler.prefill.pools.entries() == 0
    assert not d.connector.has_pending_push_work()
    pool = d.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == d.kv_cache_config.num_blocks - 1


def test_a_pool_and_a_peer_that_hashes_blocks_otherwise_are_refused_at_handshake_by_name(
        pd, caplog):
    """D keeps a host pool; P hashes with another --prefix-caching-hash-algo, so the two
    would key one block differently. D refuses P at handshake, naming both algorithms, and
    computes the request itself; a P hashing alike is read as before."""
    p, d = pd(prefix_caching_hash_algo="sha256_cbor",
              d=dict(extra={"host_pool_bytes": 8 * POOL_SLOT}))
    prompt = _prompt(46, 40)
    with caplog.at_level(logging.WARNING):
        steps = decode(d, "a-d", prompt, p.prefill("a", prompt))
    assert "algo: peer='sha256_cbor' local='sha256'" in caplog.text
    outs = [r.connector_output for r in steps if r.connector_output]
    assert any("a-d" in o.failed_recving for o in outs)
    assert scheduled_tokens(steps, "a-d")[1] >= len(prompt)  # recomputed on D
    assert_prompt_kv(d, "a-d", prompt)

    p2, d2 = pd(d=dict(extra={"host_pool_bytes": 8 * POOL_SLOT}))  # both sha256
    steps = decode(d2, "b-d", prompt, p2.prefill("b", prompt))
    assert scheduled_tokens(steps, "b-d")[0] == len(prompt) - 1  # read from P
    assert_prompt_kv(d2, "b-d", prompt)


_CANARIES = """
import json, os, sys, types
from kvxfer.vllm.connector import block_hashing
out = {}
for algo in sys.argv[1:]:
    config = types.SimpleNamespace(cache_config=types.SimpleNamespace(prefix_caching_hash_algo=algo))
    for seed in (None, "7", "8"):
        os.environ.pop("PYTHONHASHSEED", None) if seed is None else os.environ.update(PYTHONHASHSEED=seed)
        out[f"{algo}/{seed}"] = block_hashing(config, 16, True)["canary"]
print(json.dumps(out))
"""


def test_block_hashing_canaries_agree_across_processes_exactly_when_vllms_hashes_do(monkeypatch):
    """A canary is vLLM's hash of one fixed block under this process's seed: the same in
    another process for the algorithms vLLM seeds alike (and under PYTHONHASHSEED set
    alike), different under another seed, None where vLLM draws the seed at random."""
    import xxhash  # noqa: F401  (vLLM's xxhash algorithms need it: the test envs install it)

    algos = ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    theirs = json.loads(subprocess.run([sys.executable, "-c", _CANARIES, *algos], env=env,
                                       capture_output=True, text=True, check=True).stdout)
    for algo in algos:
        config = SimpleNamespace(cache_config=SimpleNamespace(prefix_caching_hash_algo=algo))
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
        ours = block_hashing(config, 16, True)
        if algo.startswith("xxhash"):
            assert ours["seed"] == "random" and ours["canary"] is None
        else:
            assert ours == {"algo": algo, "block_size": 16, "seed": "default", "pool": True,
                            "canary": theirs[f"{algo}/None"]}
        monkeypatch.setenv("PYTHONHASHSEED", "7")
        seeded = block_hashing(config, 16, True)["canary"]
        assert seeded == theirs[f"{algo}/7"] != theirs[f"{algo}/8"]
        assert seeded != ours["canary"]


def test_a_pool_of_less_than_one_slot_is_refused_at_start_by_name(engines, model_dir):
    with pytest.raises(InvalidInputError, match=f"host_pool_bytes {POOL_SLOT - 1} is less than "
                                                f"one staging slot of {POOL_SLOT} bytes"):
        engines(model_dir, kv_role="kv_producer", devices=jax.devices()[:1],
                extra_config={"port": listen_port(), "host_pool_bytes": POOL_SLOT - 1})


def _published(p: ServedP) -> list:
    """Every KV event P's vLLM scheduler publishes from now on, as a ZMQ subscriber decodes
    them (msgpack, vLLM's own `KVEventBatch`)."""
    from vllm.distributed.kv_events import KVEventBatch

    got, encode = [], msgspec.msgpack.Encoder().encode
    decode = msgspec.msgpack.Decoder(type=KVEventBatch).decode
    p.engine.scheduler.kv_event_publisher.publish = lambda batch: got.extend(
        decode(encode(batch)).events)
    return got


def test_the_pool_publishes_its_stores_and_removals_as_vllm_kv_events_of_medium_cpu(pd):
    p, d = _pool_pair(pd, slots=3, kv_events=True)
    events = _published(p)
    prompt = _prompt(51, 50)  # three whole blocks
    decode(d, "a-d", prompt, p.prefill("a", prompt))
    _released(p)
    time.sleep(0.05)  # a step after the release publishes it
    hashes = p.call(lambda: p.engine.connector._scheduler.prefill.pools.pools[0]._entries.copy())
    (stored,) = [e for e in events if type(e).__name__ == "BlockStored"]
    assert (stored.medium, stored.block_size, stored.parent_block_hash) == ("CPU", 16, None)
    # the chain, in prompt order, as vLLM's own events give block hashes
    assert stored.block_hashes == [maybe_convert_block_hash(h) for h in reversed(list(hashes))]
    assert stored.token_ids == prompt[:48] and stored.group_idx == 0
    other = _prompt(52, 20)  # one whole block: the pool evicts a's tail to hold it
    decode(d, "b-d", other, p.prefill("b", other))
    _released(p)
    time.sleep(0.05)
    (removed,) = [e for e in events if type(e).__name__ == "BlockRemoved"]
    assert removed.medium == "CPU" and removed.block_hashes == [stored.block_hashes[-1]]
    # vLLM's cache reset (new weights): the pool lets go of everything, and says so.
    assert p.call(p.engine.scheduler.reset_prefix_cache, reset_connector=True)
    time.sleep(0.05)
    assert p.call(p.engine.connector._scheduler.prefill.pools.entries) == 0
    params = p.prefill("c", prompt)
    assert scheduled_tokens(p.steps, "c") == (0, 50)  # nothing stale is loaded
    cleared = [e for e in events if type(e).__name__ == "BlockRemoved"][1:]
    assert sorted(h for e in cleared for h in e.block_hashes) == sorted(
        [*stored.block_hashes[:2], *[e for e in events if type(e).__name__ == "BlockStored"][1]
         .block_hashes])
    decode(d, "c-d", prompt, params)
    assert_prompt_kv(d, "c-d", prompt)


def test_without_kv_cache_events_enabled_the_pool_makes_none(pd):
    """vLLM publishes nothing unless `--kv-events-config` enables KV cache events: the pool
    then builds no event (nor copies a prompt's token ids for one), and still pools."""
    p, d = _pool_pair(pd, slots=3)
    events = _published(p)
    prompt = _prompt(51, 50)
    decode(d, "a-d", prompt, p.prefill("a", prompt))
    _released(p)
    time.sleep(0.05)
    pools = p.call(lambda: p.engine.connector._scheduler.prefill.pools)
    assert p.call(pools.entries) == 3 and not pools.events
    assert events == [] and p.call(pools.take_events) == [] and pools._tokens == {}
    params = p.prefill("b", prompt)
    assert scheduled_tokens(p.steps, "b") == (48, 2)  # its three blocks loaded from the pool
    decode(d, "b-d", prompt, params)
    assert_prompt_kv(d, "b-d", prompt)


def test_prefix_cache_hit_on_d_reads_only_what_d_lacks(pd, monkeypatch):
    p, d = pd()
    shared = _prompt(7, 32)
    first, second = shared + _prompt(8, 10), shared + _prompt(9, 20)
    decode(d, "a-d", first, p.prefill("a", first))
    read = _spy_reads(monkeypatch)
    steps = decode(d, "b-d", second, p.prefill("b", second))
    assert read["b-d"] == [[2, 3]]  # entries 0 and 1 are D's local hit
    first_computed, _ = scheduled_tokens(steps, "b-d")
    assert first_computed == len(second) - 1
    assert_prompt_kv(d, "b-d", second)


def test_preemption_and_resume_on_p(pd):
    # A local request decodes while "a" prefills in chunks; when the 11 usable blocks run out,
    # vLLM preempts the newest running request ("a", mid-prefill) and resumes it later.
    p, d = pd(num_blocks=12, max_num_batched_tokens=32)
    p.call(p.engine.add_request, "x", _prompt(10, 16), max_tokens=40)
    prompt = _prompt(11, 150)
    params = p.prefill("a", prompt)
    assert any("a" in r.scheduler_output.scheduled_cached_reqs.resumed_req_ids for r in p.steps), \
        "no preemption happened; the test no longer covers resume"
    decode(d, "a-d", prompt, params)
    assert_prompt_kv(d, "a-d", prompt)


def test_abort_on_p_mid_prefill_sends_nothing_and_frees_staging(pd):
    p, d = pd(max_num_batched_tokens=16)

    def one_chunk_then_abort():  # under P's lock: its thread cannot step in between
        p.engine.add_request("r", _prompt(12, 100), max_tokens=1,
                             kv_transfer_params={"do_remote_decode": True})
        assert p.engine.step().scheduler_output.num_scheduled_tokens["r"] == 16
        p.engine.abort("r")

    p.call(one_chunk_then_abort)
    prefill = p.engine.connector._scheduler.prefill
    assert p.call(lambda: "r" not in prefill.tracker and not prefill.held())
    assert p.call(lambda: all(m.num_free_slots == m.num_slots for m in prefill.slot_maps))
    # The id is free for a new prefill, which goes through.
    prompt = _prompt(13, 40)
    params = p.prefill("r", prompt)
    decode(d, "r-d", prompt, params)
    assert_prompt_kv(d, "r-d", prompt)


@pytest.mark.parametrize("when", ["before_the_read", "mid_read"])
def test_p_gone_is_recomputed_by_vllm(pd, monkeypatch, when):
    p, d = pd(d=dict(extra={"transfer_timeout_s": 3.0}))
    prompt = _prompt(14, 60)
    params = p.prefill("r", prompt)

    def kill_p():
        p.stop()
        p.engine.close()  # P's worker goes away with its NIXL agent and staging

    if when == "before_the_read":
        kill_p()
    else:  # D has handshaken and posted its READ; P dies before it can ack
        real = DecodeTransport.start_read

        def start_then_kill(self, *args):
            real(self, *args)
            kill_p()

        monkeypatch.setattr(DecodeTransport, "start_read", start_then_kill)
    steps = decode(d, "r-d", prompt, params)
    outs = [r.connector_output for r in steps if r.connector_output]
    assert any("r-d" in o.failed_recving for o in outs)
    invalid = set().union(*(o.invalid_block_ids for o in outs))
    assert invalid == set(d.table("r-d")[0][: -(-len(prompt) // d.block_size)])
    # vLLM recomputed exactly those blocks on D: every prompt token was scheduled on D.
    _, total = scheduled_tokens(steps, "r-d")
    assert total >= len(prompt)
    assert_prompt_kv(d, "r-d", prompt)


def test_hybrid_full_and_sliding_window_groups(pd, hybrid_model_dir, caplog):
    """A model with a sliding-window group; D is given a host pool, which such a model
    cannot keep: D says so at start and allocates none."""
    from engine import SLIDING_WINDOW

    with caplog.at_level(logging.WARNING, logger="kvxfer.vllm.connector"):
        p, d = pd(model=hybrid_model_dir, hybrid=True, max_num_batched_tokens=32,
                  d=dict(hybrid=True, extra={"host_pool_bytes": 8 * POOL_SLOT}))
    assert d.worker._worker._prefill is None
    assert any("host_pool_bytes is ignored" in r.getMessage() for r in caplog.records)
    prompt = _prompt(15, 100)
    params = p.prefill("h", prompt)
    assert len(params["groups"]) == 2
    # The sliding-window group sends only the blocks its window reaches from the last token.
    assert len(params["groups"][1]["keys"]) < len(params["groups"][0]["keys"]) == 7
    decode(d, "h-d", prompt, params)
    assert_prompt_kv(d, "h-d", prompt, window=SLIDING_WINDOW)


def test_a_failed_load_on_a_hybrid_model_is_recomputed_not_an_engine_error(pd, hybrid_model_dir):
    """vLLM 0.33 raises on block-level failures (invalid_block_ids) for a model with several
    KV cache groups: kvxfer reports such failures in failed_recving only."""
    from engine import SLIDING_WINDOW

    p, d = pd(model=hybrid_model_dir, hybrid=True, max_num_batched_tokens=32,
              d=dict(hybrid=True, extra={"transfer_timeout_s": 3.0}))
    prompt = _prompt(16, 100)
    params = p.prefill("h", prompt)
    p.stop()
    p.engine.close()  # P is gone before D reads
    steps = decode(d, "h-d", prompt, params)
    outs = [r.connector_output for r in steps if r.connector_output]
    assert any("h-d" in o.failed_recving for o in outs)
    assert set().union(*(o.invalid_block_ids for o in outs)) == set()
    _, total = scheduled_tokens(steps, "h-d")
    assert total >= len(prompt)  # recomputed on D
    assert_prompt_kv(d, "h-d", prompt, window=SLIDING_WINDOW)


def test_a_request_id_p_still_holds_gets_a_transfer_of_its_own(pd):
    """A proxy that reuses X-Request-Id, or a client retry: P prefills the id again while D
    has not yet read the first; P's engine goes on and each D request gets its own KV."""
    p, d = pd()
    first, second = _prompt(17, 40), _prompt(18, 50)
    params_1 = p.prefill("r", first)
    del p.finished["r"]
    params_2 = p.prefill("r", second)  # the first is still held for D
    assert params_1["req_id"] == "r" and params_2["req_id"] not in ("r", None)
    decode(d, "r-d2", second, params_2)
    assert_prompt_kv(d, "r-d2", second)  # before D frees its blocks for another request
    decode(d, "r-d1", first, params_1)
    assert_prompt_kv(d, "r-d1", first)


def test_streamed_request_is_read_while_p_prefills_and_lands_byte_exact(pd, monkeypatch):
    """The router sends the request to D and P at once with one stream id: D allocates,
    subscribes, and reads each chunk's final blocks as P saves them (chunks of 24 straddle
    16-token blocks), then decodes from them as from P's params."""
    streams, real = [], DecodeTransport.start_stream

    def spy(self, req_id, params, *rest):
        streams.append((req_id, params.stream))
        return real(self, req_id, params, *rest)

    monkeypatch.setattr(DecodeTransport, "start_stream", spy)
    p, d = pd(d_devices=(4, 5), max_num_batched_tokens=24)
    learned = p.prefill("warm", _prompt(30, 20))  # as the proxy learns P's kvxfer address
    address = {key: learned[key] for key in ("peer", "host", "port")}
    prompt, stream = _prompt(31, 70), new_stream_id()
    d.add_request("s-d", prompt, max_tokens=2, kv_transfer_params={
        "do_remote_prefill": True, "do_remote_decode": False, "stream": stream, **address})
    d.step()  # D has allocated and subscribed before P starts
    p.call(p.engine.add_request, "s", prompt, max_tokens=1,
           kv_transfer_params={"do_remote_decode": True, "stream": stream})
    steps = d.run_until(lambda r: "s-d" in r.finished, max_steps=400, min_s=30.0)
    first, _ = scheduled_tokens(steps, "s-d")
    assert first == 69  # D computed only the last prompt token: the rest came by the stream
    assert_prompt_kv(d, "s-d", prompt)
    assert streams == [("s-d", stream)]


def test_a_streamed_prompt_enters_ps_pool_once_d_read_it_and_a_later_request_loads_it(pd):
    """P with a host pool streams a prompt to D; once D has read it its four whole blocks
    are P's pool entries (their tags from entry secrets, which the stream's chunks named),
    and the same prompt again is loaded from the pool instead of prefilled."""
    p, d = _pool_pair(pd, slots=8, max_num_batched_tokens=24)
    warm = _prompt(30, 20)
    learned = p.prefill("warm", warm)  # as the proxy learns P's kvxfer address
    decode(d, "warm-d", warm, learned)
    address = {key: learned[key] for key in ("peer", "host", "port")}
    prompt, stream = _prompt(34, 70), new_stream_id()
    d.add_request("s-d", prompt, max_tokens=2, kv_transfer_params={
        "do_remote_prefill": True, "do_remote_decode": False, "stream": stream, **address})
    d.step()
    p.call(p.engine.add_request, "s", prompt, max_tokens=1,
           kv_transfer_params={"do_remote_decode": True, "stream": stream})
    steps = d.run_until(lambda r: "s-d" in r.finished, max_steps=400, min_s=30.0)
    assert scheduled_tokens(steps, "s-d")[0] == 69  # by the stream
    assert_prompt_kv(d, "s-d", prompt)
    _released(p)
    params = p.prefill("t", prompt)
    assert scheduled_tokens(p.steps, "t") == (64, 6)  # its four whole blocks from the pool
    decode(d, "t-d", prompt, params)
    assert_prompt_kv(d, "t-d", prompt)


def test_a_stream_for_another_prompt_is_recomputed_on_d(pd):
    p, d = pd()
    learned = p.prefill("warm", _prompt(32, 20))
    address = {key: learned[key] for key in ("peer", "host", "port")}
    stream = new_stream_id()
    prompt = _prompt(33, 40)
    d.add_request("x-d", prompt, max_tokens=2, kv_transfer_params={
        "do_remote_prefill": True, "stream": stream, **address})
    d.step()
    p.call(p.engine.add_request, "x", _prompt(34, 40), max_tokens=1,
           kv_transfer_params={"do_remote_decode": True, "stream": stream})
    steps = d.run_until(lambda r: "x-d" in r.finished, max_steps=400, min_s=30.0)
    _, total = scheduled_tokens(steps, "x-d")
    assert total >= 40  # D computed the whole prompt itself (and the decode)
    assert_prompt_kv(d, "x-d", prompt)  # its own KV, not the other prompt's


@pytest.fixture
def etcd():
    """A throwaway etcd server; requested before `pd`, so it outlives both engines."""
    from kvxfer.bench.hosts import EtcdServer

    server = EtcdServer()
    yield server.endpoint
    server.stop()


def test_p_and_d_find_each_other_through_etcd(etcd, pd):
    via_etcd = {"etcd_endpoints": etcd}
    p, d = pd(extra=via_etcd, d=dict(extra=via_etcd))
    prompt = _prompt(12, 50)
    params = p.prefill("e", prompt)
    assert params["port"] == 0  # P listens nowhere: D finds its agent in etcd by name
    steps = decode(d, "e-d", prompt, params)
    assert scheduled_tokens(steps, "e-d")[0] == 49
    assert_prompt_kv(d, "e-d", prompt)


@pytest.mark.parametrize("extra, named", [
    ({"stagign_blocks": 8}, r"unknown keys \['stagign_blocks'\]"),
    ({"port": 0}, r"'port' must be an int in \[1, 65535\], got 0"),
    ({"staging_blocks": -1}, "staging_blocks must be a positive int, got -1"),
    ({"lease_s": "x"}, "lease_s must be a positive finite number of seconds, got 'x'"),
    ({"verify_fingerprints": "yes"}, "verify_fingerprints must be a bool, got 'yes'"),
    ({"stage_units": 1}, "stage_units must be a bool, got 1"),
    ({"host_pool_bytes": -1}, "host_pool_bytes must be a non-negative int .*got -1"),
    ({"etcd_endpoints": "etcd:2379"}, "etcd_endpoints must be None or comma-separated"),
    ({"progress_wake_us": -5}, r"progress_wake_us must be an int in \[0, 10_000_000\], got -5"),
    ({"kv_recompute_threshold": -1}, "'kv_recompute_threshold' must be an int >= 0 .*got -1"),
    ({"kv_recompute_threshold": 64.0}, "'kv_recompute_threshold' must be an int >= 0 .*got 64.0"),
])
@pytest.mark.parametrize("role", ["kv_producer", "kv_consumer"])
def test_bad_extra_config_is_refused_by_name_on_both_roles(model_dir, engines, extra, named, role):
    with pytest.raises(InvalidInputError, match=named):
        engines(model_dir, kv_role=role, extra_config=extra, devices=jax.devices()[:1])


def test_importing_the_connector_module_loads_neither_jax_nor_nixl():
    # vLLM's API process imports the module too: it must stay light.
    import subprocess
    import sys

    code = ("import sys, kvxfer.vllm; print(sorted(m for m in ('jax', 'nixl_cu12', "
            "'kvxfer.connector.prefill', 'kvxfer.connector.decode', 'kvxfer.device.gather') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("value, asks", [(True, True), ("no", False), (1, False), (None, False)])
def test_only_true_asks_d_to_load_from_p(value, asks, caplog):
    from types import SimpleNamespace

    from kvxfer.nixl.wire import prompt_digest
    from kvxfer.plan.save_plan import GroupSpec
    from kvxfer.vllm.connector import Settings, _SchedulerSide

    d = _SchedulerSide(Settings.from_extra({}), [GroupSpec(16)], producer=False, consumer=True)
    request = SimpleNamespace(request_id="r", num_prompt_tokens=32, prompt_token_ids=list(
        range(32)), kv_transfer_params={"do_remote_prefill": value, "num_prompt_tokens": 32,
                                        "prompt": prompt_digest(list(range(32)))})
    assert d.matched_tokens(request, 0) == ((32, True) if asks else (0, False))
    assert ("must be true or false, got 'no'" in caplog.text) == (value == "no")


@pytest.mark.parametrize("name", ["", 5])
def test_an_empty_or_non_str_agent_name_is_refused_not_replaced_by_the_default(name):
    from kvxfer.vllm import Settings

    with pytest.raises(InvalidInputError, match=f"'name' must be a non-empty str .* got {name!r}"):
        Settings.from_extra({"name": name})



def test_a_host_that_does_not_resolve_is_refused_at_start_up():
    from kvxfer.vllm import Settings

    with pytest.raises(InvalidInputError, match="'host' 'p.invalid' does not resolve here"):
        Settings.from_extra({"host": "p.invalid"})
    assert Settings.from_extra({"host": "localhost"}).host == "localhost"


def test_params_for_another_prompt_of_the_same_length_make_d_compute_it_itself(caplog):
    from types import SimpleNamespace

    from kvxfer.nixl.wire import prompt_digest
    from kvxfer.plan.save_plan import GroupSpec
    from kvxfer.vllm.connector import Settings, _SchedulerSide

    d = _SchedulerSide(Settings.from_extra({}), [GroupSpec(16)], producer=False, consumer=True)
    for sent in (prompt_digest(list(range(1, 33))), None):
        request = SimpleNamespace(request_id="r", num_prompt_tokens=32,
                                  prompt_token_ids=list(range(32)), kv_transfer_params={
                                      "do_remote_prefill": True, "num_prompt_tokens": 32,
                                      "prompt": sent})
        assert d.matched_tokens(request, 0) == (0, False)
        assert request.kv_transfer_params["do_remote_prefill"] is False
    assert "are for another prompt" in caplog.text


def test_d_keeps_p_lease_of_a_queued_request_and_releases_it_when_aborted():
    from types import SimpleNamespace

    from kvxfer.nixl.wire import prompt_digest
    from kvxfer.plan.save_plan import GroupSpec
    from kvxfer.vllm.connector import Settings, _SchedulerSide

    d = _SchedulerSide(Settings.from_extra({}), [GroupSpec(16)], producer=False, consumer=True)
    params = {"do_remote_prefill": True, "num_prompt_tokens": 32, "req_id": "p-r",
              "prompt": prompt_digest(list(range(32)))}
    request = SimpleNamespace(request_id="r", num_prompt_tokens=32,
                              prompt_token_ids=list(range(32)), kv_transfer_params=params)
    assert d.matched_tokens(request, 0) == (32, True)
    assert d.matched_tokens(request, 0) == (32, True)  # still no blocks: asked again
    so = SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={})
    first = d.build(so)
    assert [p["req_id"] for p in first.expects] == ["p-r"] and first.cancels == []
    assert d.build(so).expects == []  # expected once
    d.finished(request)  # aborted while waiting in D's queue
    assert [p["req_id"] for p in d.build(so).cancels] == ["p-r"]


def test_default_p_names_under_etcd_differ_per_engine_and_agree_within_one():
    from kvxfer.vllm import Settings

    via_etcd = {"etcd_endpoints": "http://127.0.0.1:2379"}
    one, other = (Settings.from_extra(via_etcd, engine_id).p_name for engine_id in ("e1", "e2"))
    assert one != other  # the port, the same for every P, no longer tells them apart
    # The scheduler and the worker build their Settings apart; both name P the same.
    assert Settings.from_extra(via_etcd, "e1").transport(True).name == one
    assert Settings.from_extra({}, "e1").p_name == Settings.from_extra({}, "e2").p_name
    with pytest.raises(InvalidInputError, match="made of kv_transfer_config.engine_id, which is "
                                                "None: give an engine_id, or a 'name'"):
        Settings.from_extra(via_etcd)
    assert Settings.from_extra({**via_etcd, "name": "P7"}).p_name == "P7"


@pytest.mark.parametrize("bad", ["port", "staging_blocks"])
def test_p_fails_at_start_up_naming_a_setting_it_cannot_serve_with(engines, model_dir, bad):
    """P's worker starts its NIXL agent and staging with the runner, not at its first step:
    a port in use or staging too large for the machine stops the engine's start, by name."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        extra = {"port": taken.getsockname()[1], "staging_blocks": 64} if bad == "port" else {
            "port": listen_port(), "staging_blocks": 10**9}
        with pytest.raises(InvalidInputError, match=str(extra[bad]) if bad == "port"
                           else "lower staging_blocks"):
            engines(model_dir, kv_role="kv_producer", extra_config=extra,
                    devices=jax.devices()[:4])


def test_p_scheduler_names_the_p_processes_its_workers_report_and_logs_bad_ones(
        caplog, engines, model_dir):
    """A P across hosts: vLLM aggregates every worker's metadata; the scheduler side takes
    the sources from it and names them in the params of requests completed from then on.
    Sources the params could not name are logged, not raised (the engine goes on)."""
    from kvxfer.nixl.wire import Source
    from kvxfer.plan.save_plan import GroupSpec
    from kvxfer.vllm.connector import Settings, WorkerReport, _SchedulerSide

    halves = (Source("p-0", 0, 2), Source("p-1", 2, 4))
    merged = WorkerReport({"a": 1}).aggregate(WorkerReport({"b": 1}, halves, 4))
    assert merged == WorkerReport({"a": 1, "b": 1}, halves, 4)
    assert WorkerReport({"c": 1}, halves, 4).aggregate(WorkerReport({"d": 1})).sources == halves

    p = _SchedulerSide(Settings.from_extra({}), [GroupSpec(16)], producer=True, consumer=False)
    assert p.prefill.sources == () and p.prefill.units == 0
    p.learn_sources(merged.sources, merged.units)
    assert (p.prefill.sources, p.prefill.units) == (halves, 4)
    p.learn_sources((Source("p-0", 0, 2),), 4)  # half the units: D could not read the rest
    assert "sources the params cannot name" in caplog.text and "do not tile" in caplog.text
    assert (p.prefill.sources, p.prefill.units) == (halves, 4)
    p.learn_sources((Source("p-0", 0, 2),), 4)  # the same report again: logged once
    assert caplog.text.count("sources the params cannot name") == 1

    # Through the connector, as vLLM hands it the aggregated worker output each step; the
    # params of a request completed afterwards name them.
    from vllm.v1.outputs import KVConnectorOutput

    engine = engines(model_dir, kv_role="kv_producer",
                     extra_config={"port": listen_port(), "staging_blocks": 8})
    engine.connector.update_connector_output(
        KVConnectorOutput(kv_connector_worker_meta=WorkerReport({}, halves, 4)))
    prefill = engine.connector._scheduler.prefill
    assert (prefill.sources, prefill.units) == (halves, 4)
    engine.add_request("r", list(range(10, 30)), kv_transfer_params={"do_remote_decode": True})
    params = engine.run_until(lambda r: "r" in r.finished).pop().finished["r"]
    assert params["sources"] == [{"peer": "p-0", "units": [0, 2]},
                                 {"peer": "p-1", "units": [2, 4]}] and params["units"] == 4


def test_a_save_step_that_only_cancels_a_stream_reaches_p_worker():
    """A streamed request aborted mid-prefill on a P with nothing else to save: the step that
    carries only its cancel must still reach the worker, or the stream is held for ever and
    its staging slots never come back."""
    from kvxfer.connector.scheduler import SaveMeta
    from kvxfer.vllm.connector import KvxferMetadata, Settings, _WorkerSide

    side = _WorkerSide(Settings.from_extra({}), None, {}, producer=True, consumer=False)
    seen = []

    class Worker:
        def save(self, caches, meta):
            seen.append(meta.cancels)

    side._prefill, side.runner, side._indices = Worker(), type("R", (), {"kv_caches": []}), []
    side.save(KvxferMetadata(save=SaveMeta(instance="p", cancels=["s"])))
    side.save(KvxferMetadata(save=SaveMeta(instance="p")))  # nothing at all: nothing to do
    assert seen == [["s"]]
