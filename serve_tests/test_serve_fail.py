"""The host pools (P's and D's) on the real engine, and P's KV events over ZMQ; then D under
`kv_load_failure_policy=fail`: a load from a dead P is a clear error, and D serves on. (In
this order: the last test kills P.)"""

from __future__ import annotations

import os
import signal
import time

from conftest import EVENTS
from serve_stack import http_error, random_prompt
from test_serve import _complete_with_transfer, _metric, _proxy, _same_answer, _until


def test_a_prompt_p_pooled_is_loaded_not_prefilled_and_answers_alike(fail_stack):
    p = fail_stack.p_url
    prompt = random_prompt(300, seed=31)  # four whole 64-token blocks and a partial one
    first = fail_stack.complete(fail_stack.proxy_url, prompt)
    # Once D has read it, P keeps its four whole blocks in its pool (no device cache here).
    assert _until(lambda: _metric(p, "vllm:kvxfer_pool_blocks"), 4) == 4
    hits = _metric(p, "vllm:kvxfer_pool_hit_tokens_total", source="own_pool")
    computed = _metric(p, "vllm:prompt_tokens_total")
    again = fail_stack.complete(fail_stack.proxy_url, prompt)
    assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    # P loaded 256 tokens from its pool (the last token's block is computed: its logits).
    assert _until(lambda: _metric(p, "vllm:kvxfer_pool_hit_tokens_total", source="own_pool")
                  - hits, 256) == 256
    assert _metric(p, "vllm:prompt_tokens_total") - computed == 300  # every prompt token, counted
    assert _metric(fail_stack.d_url, "vllm:kvxfer_num_transfers_total") == 2


def test_p_publishes_its_pools_stores_as_vllm_kv_events_a_zmq_subscriber_decodes(fail_stack):
    """P runs with `--kv-events-config` (zmq on an ipc:// socket, `PD_KV_EVENTS`: no TCP port
    anyone else reaches): a subscriber gets `BlockStored` events with medium CPU for the
    whole blocks P pools, in vLLM's own event types."""
    import msgspec
    import zmq
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    try:
        sub.connect(f"ipc://{fail_stack.dir.resolve()}/{EVENTS}")
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        time.sleep(1.0)  # a subscription takes a moment to reach the publisher
        prompt = random_prompt(200, seed=41)  # three whole 64-token blocks and 8 tokens
        fail_stack.complete(fail_stack.proxy_url, prompt)
        decoder, stored = msgspec.msgpack.Decoder(type=KVEventBatch), []
        deadline = time.monotonic() + 60
        while sum(len(e.block_hashes) for e in stored) < 3 and time.monotonic() < deadline:
            if sub.poll(500):
                topic, _seq, payload = sub.recv_multipart()
                assert topic == b"kv"
                stored += [e for e in decoder.decode(payload).events
                           if isinstance(e, BlockStored) and e.medium == "CPU"]
    finally:
        sub.close(0)
        context.term()
    assert sum(len(e.block_hashes) for e in stored) == 3, stored
    assert all(e.block_size == 64 for e in stored)
    assert [t for e in stored for t in e.token_ids] == prompt[:192]


def test_d_pools_the_conversation_it_decoded_and_the_next_turn_loads_it_on_d_alone(fail_stack):
    """D keeps a host pool too (no device prefix cache here): turn 1 through P leaves D's
    whole blocks of prompt and answer in D's pool, and the routing proxy's turn 2 (a local
    prefill on D) loads them from there, answering as P alone; turn 3, through P, is loaded
    from D's pool as far as it holds and read from P past it."""
    d = fail_stack.d_url
    with _proxy(fail_stack, 8032) as proxy:
        turn1 = random_prompt(300, seed=8000)
        pooled = _metric(d, "vllm:kvxfer_pool_blocks", role="D")
        got1, how1, _ = _complete_with_transfer(fail_stack, proxy, turn1)
        assert how1 == "params"
        # 300 prompt and 8 answer tokens, 307 of them computed: four whole 64-token blocks.
        assert _until(lambda: _metric(d, "vllm:kvxfer_pool_blocks", role="D"), pooled + 4) \
            == pooled + 4
        assert _metric(d, "vllm:kvxfer_pool_capacity_tokens", role="D") > 0  # the proxy reads it
        turn2 = turn1 + got1["choices"][0]["token_ids"] + random_prompt(60, seed=8001)
        hits = _metric(d, "vllm:kvxfer_pool_hit_tokens_total", role="D", source="own_pool")
        got2, how2, route2 = _complete_with_transfer(fail_stack, proxy, turn2)
    assert how2 == "local", route2
    assert _until(lambda: _metric(d, "vllm:kvxfer_pool_hit_tokens_total", role="D",
                                  source="own_pool") - hits, 256) == 256
    _same_answer(got2, fail_stack.complete(fail_stack.p_url, turn2))
    # Turn 3 goes through P (the plain proxy): D loads the conversation so far from its pool
    # (turn 2's 375 computed tokens: five whole blocks) and reads only the rest from P.
    turn3 = turn2 + got2["choices"][0]["token_ids"] + random_prompt(60, seed=8002)
    hits = _metric(d, "vllm:kvxfer_pool_hit_tokens_total", role="D", source="own_pool")
    got3 = fail_stack.complete(fail_stack.proxy_url, turn3)
    assert _until(lambda: _metric(d, "vllm:kvxfer_pool_hit_tokens_total", role="D",
                                  source="own_pool") - hits, 320) == 320
    _same_answer(got3, fail_stack.complete(fail_stack.p_url, turn3))


def test_a_load_from_a_killed_p_is_an_error_and_d_keeps_serving(fail_stack):
    prompt = random_prompt(200, seed=5)
    before = fail_stack.complete(fail_stack.proxy_url, prompt)  # the pair works
    assert len(before["choices"][0]["token_ids"]) == 8
    prefill = fail_stack.complete(fail_stack.p_url, random_prompt(150, seed=6), max_tokens=1,
                                  kv_transfer_params={"do_remote_decode": True})
    os.killpg(fail_stack.pid("P"), signal.SIGKILL)

    try:
        answer = fail_stack.complete(fail_stack.d_url, random_prompt(150, seed=6),
                                     kv_transfer_params=prefill["kv_transfer_params"])
    except Exception as e:  # an error status: what a client should see
        assert getattr(e, "code", 0) >= 400, e
    else:  # or an answer that says it is not one
        assert answer["choices"][0]["finish_reason"] not in ("stop", "length"), answer

    # D serves on: a request of its own, and the same prompt again without P's params.
    again = fail_stack.complete(fail_stack.d_url, prompt)
    assert again["choices"][0]["token_ids"] == before["choices"][0]["token_ids"]
    # The proxy names the P it cannot reach.
    error = http_error(lambda: fail_stack.complete(fail_stack.proxy_url, prompt))
    assert error.code == 502 and fail_stack.p_url in error.read().decode()
