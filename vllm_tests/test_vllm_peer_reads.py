"""Reads from a peer by prefix (`kv_source`) between real vLLM schedulers.

A conversation's next turn goes through P, but the previous answer is only on the D that
decoded it. D (`kv_both`: it decodes and serves what it holds) is asked for the
conversation so far as a prefill of its own (`do_remote_decode`, one token), which its
host pool and device cache answer; P (`kv_both`: it prefills and reads) is given D's params
as `kv_source`, reads that prefix and computes only the new message; D then reads the turn
from P as usual. The forward stamps (layer, position, token) into every token's KV, so
every cache is checked byte for byte.
"""

from __future__ import annotations

import socket
import time

import jax
import pytest
from engine import listen_port
from test_vllm_connector import (
    POOL_SLOT,
    ServedP,
    _prompt,
    _spy_reads,
    assert_prompt_kv,
    scheduled_tokens,
)

from kvxfer.vllm.fallbacks import LOCAL, counter_name


def _both(engines, model_dir, devices, **extra):
    kw = {"port": listen_port(), "staging_blocks": 64, "lease_s": 30.0,
          "transfer_timeout_s": 10.0, "handshake_timeout_s": 3.0, **extra}
    return ServedP(engines(model_dir, kv_role="kv_both", extra_config=kw,
                           enable_prefix_caching=False, kv_load_failure_policy="recompute",
                           devices=[jax.devices()[i] for i in devices]))


@pytest.fixture
def fleet(model_dir, engines):
    """`make(p_pool=0) -> (P, D)`, both `kv_both` engines stepped from threads, without
    device prefix caches (every hit is a pool's or a peer's); D with a host pool."""
    served = []

    def make(p_pool: int = 0):
        served.append(_both(engines, model_dir, (0, 1, 2, 3), host_pool_bytes=p_pool * POOL_SLOT))
        served.append(_both(engines, model_dir, (4, 5, 6, 7), host_pool_bytes=8 * POOL_SLOT))
        return served[-2], served[-1]

    yield make
    for s in served:
        s.stop()


def _decode(d: ServedP, req_id: str, prompt: list[int], params: dict, max_tokens: int) -> list[int]:
    """D decodes with P's params; returns its answer."""
    before = len(d.steps)
    d.call(d.engine.add_request, req_id, prompt, max_tokens=max_tokens, kv_transfer_params=params)
    d.wait(req_id)
    return [t for r in d.steps[before:] for t in r.new_tokens.get(req_id, [])]


def _turn_one(p: ServedP, d: ServedP, seed: int) -> list[int]:
    """Turn 1 through P, 20 tokens decoded on D, whose pool then holds its 3 whole blocks;
    returns the conversation so far (60 tokens)."""
    first = _prompt(seed, 40)
    answer = _decode(d, "a-d", first, p.prefill("a", first), max_tokens=20)
    assert len(answer) == 20
    d.until(lambda: d.engine.connector._scheduler.prefill.pools.entries() == 3)
    return first + answer


def test_p_reads_the_previous_answer_from_d_and_computes_only_the_new_message(fleet, monkeypatch):
    p, d = fleet()
    history = _turn_one(p, d, 61)
    # the lookup: D prefills the conversation so far as P would, from its pool (48 tokens)
    source = d.prefill("look", history)
    assert source["num_prompt_tokens"] == 60 and source["chain"][0] is not None
    read = _spy_reads(monkeypatch)
    second = history + _prompt(62, 10)
    params = p.prefill("b", second, kv_source=source)
    assert read["b"] == [[0, 1, 2]]  # the prefix's whole blocks: a part block is computed
    assert scheduled_tokens(p.steps, "b") == (48, 22)  # P computed the rest alone
    p.call(assert_prompt_kv, p.engine, "b", second)  # what P read is what D computed
    answer = _decode(d, "b-d", second, params, max_tokens=2)
    assert len(answer) == 2
    d.call(assert_prompt_kv, d.engine, "b-d", second)



def test_p_loads_its_own_pool_first_and_reads_only_the_rest_from_d(fleet, monkeypatch):
    p, d = fleet(p_pool=8)
    history = _turn_one(p, d, 63)
    p.until(lambda: p.engine.connector._scheduler.prefill.pools.entries() == 2)  # turn 1's prompt
    source = d.prefill("look", history)
    read = _spy_reads(monkeypatch)
    second = history + _prompt(64, 10)
    params = p.prefill("b", second, kv_source=source)
    assert read["b"] == [[2]]  # blocks 0-1 from P's own pool: the answer's from D
    assert p.call(lambda: p.engine.connector._scheduler.prefill.pools.counters())[
        "p_pool_hit_tokens"] == 32
    assert scheduled_tokens(p.steps, "b") == (48, 22)
    p.call(assert_prompt_kv, p.engine, "b", second)
    _decode(d, "b-d", second, params, max_tokens=2)
    d.call(assert_prompt_kv, d.engine, "b-d", second)


def _refused(p: ServedP, d: ServedP, second: list[int], source, monkeypatch, **kw) -> None:
    """P takes nothing from `source`: it computes all of `second`, right, and D's lease on
    the lookup goes at once (not at its 30 s end) where the source was D's."""
    read = _spy_reads(monkeypatch)
    p.prefill("b", second, kv_source=source, **kw)
    assert "b" not in read
    assert scheduled_tokens(p.steps, "b") == (0, len(second))
    p.call(assert_prompt_kv, p.engine, "b", second)
    d.until(lambda: not d.engine.connector._scheduler.prefill.held(), 5.0,
            "D still holds the lookup P refused")


def test_a_source_for_another_prefix_is_refused_and_the_prompt_computed(fleet, monkeypatch):
    p, d = fleet()
    history = _turn_one(p, d, 65)
    source = d.prefill("look", history)
    other = _prompt(66, 60) + _prompt(67, 10)  # as long, other tokens
    _refused(p, d, other, source, monkeypatch)


def test_another_tenants_source_is_refused_though_the_tokens_are_the_same(fleet, monkeypatch):
    """The lookup was made without a cache salt; the request under one (another tenant)
    hashes its blocks otherwise, so the prefix is not its own to read."""
    p, d = fleet()
    history = _turn_one(p, d, 68)
    source = d.prefill("look", history)
    _refused(p, d, history + _prompt(69, 10), source, monkeypatch, cache_salt="tenant-b")


@pytest.mark.parametrize("bad", ["x", {}, {"num_prompt_tokens": 10**12}, {"num_prompt_tokens": -1},
                                 {"num_prompt_tokens": 16, "prompt": "0" * 32, "chain": [None]}])
def test_a_malformed_source_is_refused_by_name_and_the_prompt_computed(fleet, monkeypatch, caplog, bad):
    p, d = fleet()
    second = _prompt(70, 30)
    read = _spy_reads(monkeypatch)
    p.prefill("b", second, kv_source=bad)
    assert "b" not in read and scheduled_tokens(p.steps, "b") == (0, 30)
    assert any("kv_source" in r.getMessage() for r in caplog.records)


def test_a_source_spoiled_before_the_read_fails_its_check_and_is_recomputed(fleet):
    """D's staging changed under the lookup's params (its caches reallocated, say): P's read
    fails its check, and vLLM computes the prompt instead of taking the bytes."""
    from kvxfer.vllm.worker_side import SPOILED

    p, d = fleet()
    history = _turn_one(p, d, 71)
    source = d.prefill("look", history)
    for staging in d.call(lambda: d.engine.worker._worker._prefill.stagings):
        staging.prints[...] = SPOILED
    second = history + _prompt(72, 10)
    params = p.prefill("b", second, kv_source=source)
    first, total = scheduled_tokens(p.steps, "b")
    assert first + total >= len(second) and total > 10  # computed again, not taken
    p.call(assert_prompt_kv, p.engine, "b", second)
    _decode(d, "b-d", second, params, max_tokens=2)
    d.call(assert_prompt_kv, d.engine, "b-d", second)


@pytest.mark.parametrize("peer", ["refuses", "silent"])
def test_a_source_at_an_address_no_peer_answers_on_is_recomputed_within_the_handshake_timeout(
        fleet, peer):
    """A source naming an agent no one knows at an address where nothing listens (`refuses`)
    or where something takes the connection and never answers (`silent`): P's read fails
    within its handshake timeout (3 s here) and vLLM computes the prompt; nothing hangs."""
    p, d = fleet()
    history = _turn_one(p, d, 75)
    source = d.prefill("look", history)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        if peer == "silent":
            listener.listen()
        port = listener.getsockname()[1]
        nowhere = {**source, "peer": "nobody", "host": "127.0.0.1", "port": port,
                   "sources": [{**s, "peer": "nobody"} for s in source.get("sources") or []]}
        second = history + _prompt(76, 10)
        started = time.monotonic()
        params = p.prefill("b", second, kv_source=nowhere)
        assert time.monotonic() - started < 30.0
    first, total = scheduled_tokens(p.steps, "b")
    assert first + total >= len(second) and total > 10  # computed, nothing read
    p.call(assert_prompt_kv, p.engine, "b", second)
    _decode(d, "b-d", second, params, max_tokens=2)
    d.call(assert_prompt_kv, d.engine, "b-d", second)
    # P (kv_both) counts its failed read; D counts nothing: its lookup was a prefill for a peer
    assert p.call(lambda: dict(p.engine.connector._scheduler.fallbacks.counters)) == {
        counter_name("load_failed", "unverified"): 1}
    assert d.call(lambda: dict(d.engine.connector._scheduler.fallbacks.counters)) == {}


def test_a_d_reads_a_prefix_from_another_d_and_prefills_the_rest_alone(fleet, model_dir, engines,
                                                                      monkeypatch):
    """No P on the next turn at all: a second D, which never saw the conversation, reads it
    from the first D and computes the new message itself (a local prefill)."""
    p, d = fleet()
    history = _turn_one(p, d, 73)
    source = d.prefill("look", history)
    other = engines(model_dir, kv_role="kv_consumer", enable_prefix_caching=False,
                    extra_config={"staging_blocks": 64, "transfer_timeout_s": 10.0,
                                  "handshake_timeout_s": 3.0},
                    devices=jax.devices()[:2])
    read = _spy_reads(monkeypatch)
    second = history + _prompt(74, 10)
    other.add_request("b", second, max_tokens=2, kv_transfer_params={"kv_source": source})
    steps = other.run_until(lambda r: "b" in r.finished, max_steps=400, min_s=30.0)
    assert read["b"] == [[0, 1, 2]]
    assert scheduled_tokens(steps, "b")[0] == 48
    assert_prompt_kv(other, "b", second)
    fallbacks = other.connector._scheduler.fallbacks.counters
    assert fallbacks == {LOCAL: 1}  # a local prefill with a peer's prefix, not "no params"
    d.until(lambda: not d.engine.connector._scheduler.prefill.held(), 10.0,
            "D still holds the lookup the other D read")
