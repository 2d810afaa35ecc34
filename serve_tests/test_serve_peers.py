"""Reads by prefix between instances on the real stack (`kv_source`): P and D both `kv_both`
(`PD_PEER_READS=1`), each with a host pool and no device prefix cache, so that what D
decoded is held in D's pool alone and P holds nothing of it."""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterator

import pytest
from serve_stack import TIMEOUT_S, Stack, post, random_prompt, start
from test_serve import _metric, _same_answer, _until


@pytest.fixture(scope="module")
def peer_stack() -> Iterator[Stack]:
    yield from start("peers", PD_PEER_READS="1", PD_HOST_POOL_BYTES=str(16 << 20),
                     PD_P_PORT="8160", PD_D_PORT="8260", PD_PROXY_PORT="8060", PD_KV_PORT="5617",
                     PD_PROXY_ARGS="--peer-reads --local-prefill-tokens 0",
                     PD_EXTRA_ARGS="--enable-prompt-tokens-details --no-enable-prefix-caching")


@pytest.fixture(scope="module")
def second_pair(peer_stack) -> Iterator[Stack]:
    """A second pair like `peer_stack`'s (its P, P1, a peer of the first pair's P)."""
    yield from start("peers1", PD_PEER_READS="1", PD_HOST_POOL_BYTES=str(16 << 20),
                     PD_P_PORT="8161", PD_D_PORT="8261", PD_PROXY_PORT="8061", PD_KV_PORT="5619",
                     PD_EXTRA_ARGS="--enable-prompt-tokens-details --no-enable-prefix-caching")


def _turn(stack: Stack, prompt: list[int], max_tokens: int, salt: str | None = None,
          **p_params) -> dict:
    """A turn by hand as a router makes it: P prefills (reading `p_params`' source, if any),
    D decodes from P's params; both under cache salt `salt`."""
    salted = {} if salt is None else {"cache_salt": salt}
    p = stack.complete(stack.p_url, prompt, max_tokens=1, **salted,
                       kv_transfer_params={"do_remote_decode": True, **p_params})
    return stack.complete(stack.d_url, prompt, max_tokens=max_tokens, ignore_eos=True, **salted,
                          kv_transfer_params=p["kv_transfer_params"])


def test_the_next_turns_p_reads_the_previous_answer_from_ds_pool(peer_stack):
    """Turn 2 goes through P, which never saw turn 1's answer: D, asked for the conversation
    so far (a one-token prefill of it, `do_remote_decode`), answers from its pool, and P
    reads that prefix from D and computes only the new message. D's answer is P's alone."""
    s = peer_stack
    first = random_prompt(150, 81)
    one = _turn(s, first, max_tokens=60)
    history = first + one["choices"][0]["token_ids"]  # 210 tokens: 3 whole blocks and a part
    lookup = s.complete(s.d_url, history, max_tokens=1,
                        kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"]
    assert lookup["num_prompt_tokens"] == 210
    second = history + random_prompt(70, 82)
    loaded = _metric(s.p_url, "vllm:external_prefix_cache_hits_total")
    read = _metric(s.p_url, "vllm:kvxfer_num_transfers_total", role="D")  # P's reads
    two = _turn(s, second, max_tokens=8, kv_source=lookup)
    assert _until(lambda: _metric(s.p_url, "vllm:kvxfer_num_transfers_total", role="D") - read, 1) == 1
    # 128 tokens from P's own pool (turn 1's prompt), the third block from D; the part block
    # after it is computed
    assert _metric(s.p_url, "vllm:external_prefix_cache_hits_total") - loaded == 192
    _same_answer(two, s.complete(s.p_url, second, max_tokens=8, ignore_eos=True))


def test_a_source_for_another_tenant_is_refused_and_p_computes_the_prompt(peer_stack):
    """The lookup was made under one cache salt; P's request under another hashes its blocks
    otherwise: P reads nothing and computes the prompt, and the answer is still P's alone."""
    s = peer_stack
    first = random_prompt(150, 83)
    history = first + _turn(s, first, max_tokens=20)["choices"][0]["token_ids"]
    lookup = s.complete(s.d_url, history, max_tokens=1, cache_salt="tenant-a",
                        kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"]
    second = history + random_prompt(70, 84)
    loaded = _metric(s.p_url, "vllm:external_prefix_cache_hits_total")
    two = _turn(s, second, max_tokens=8, salt="tenant-b", kv_source=lookup)
    assert _metric(s.p_url, "vllm:external_prefix_cache_hits_total") == loaded
    _same_answer(two, s.complete(s.p_url, second, max_tokens=8, ignore_eos=True))


def test_through_the_proxy_a_sessions_next_turn_on_p_reads_the_last_answer_from_d(peer_stack):
    """`kvxfer proxy --peer-reads`, a chat of two turns under one `X-Session-Id`: the proxy
    looks the first turn's conversation up on the D that answered it, and P reads it from D
    (every prompt goes through P here); the answer is P's alone."""
    s = peer_stack
    headers = {"X-Session-Id": "peer-chat"}
    chat = [{"role": "system", "content": "You are terse. " * 30},
            {"role": "user", "content": "Tell me about disaggregated serving. " * 8}]
    body = {"model": s.model, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    one = post(s.proxy_url + "/v1/chat/completions", {**body, "messages": chat, "max_tokens": 100},
               headers)
    chat += [{"role": "assistant", "content": one["choices"][0]["message"]["content"]},
             {"role": "user", "content": "And what does the host pool keep? " * 8}]
    read = _metric(s.p_url, "vllm:kvxfer_num_transfers_total", role="D")
    loaded = _metric(s.p_url, "vllm:external_prefix_cache_hits_total")
    two = post(s.proxy_url + "/v1/chat/completions", {**body, "messages": chat}, headers)
    assert _metric(s.proxy_url, "kvxfer_proxy_peer_reads_total", outcome="looked_up") == 1
    assert _until(lambda: _metric(s.p_url, "vllm:kvxfer_num_transfers_total", role="D") - read, 1) == 1
    # the whole blocks of the first turn's prompt and answer (but its last token, whose KV D
    # never computed): from P's own pool (the prompt's) and D
    held = one["usage"]["prompt_tokens"] + one["usage"]["completion_tokens"] - 1
    assert _metric(s.p_url, "vllm:external_prefix_cache_hits_total") - loaded == held // 64 * 64
    alone = post(s.p_url + "/v1/chat/completions", {**body, "messages": chat})
    assert two["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]


def test_a_streamed_turn_whose_client_asked_no_usage_is_read_all_the_same(peer_stack):
    """The OpenAI client's default: a chat's first turn streamed without `include_usage`. The
    proxy asks D for the usage and takes that event out of the client's stream, and the next
    turn's P reads the first turn's answer from D as after a non-streamed turn."""
    s = peer_stack
    headers = {"X-Session-Id": "peer-chat-streamed"}
    chat = [{"role": "system", "content": "You are brief. " * 30},
            {"role": "user", "content": "Tell me about prefix caching. " * 8}]
    body = {"model": s.model, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    sent = urllib.request.Request(
        s.proxy_url + "/v1/chat/completions", headers={"Content-Type": "application/json", **headers},
        data=json.dumps({**body, "messages": chat, "max_tokens": 100, "stream": True}).encode())
    with urllib.request.urlopen(sent, timeout=TIMEOUT_S) as response:
        raw = response.read().decode()
    events = [json.loads(e[len("data: "):]) for e in raw.split("\n\n") if e.startswith("data: {")]
    assert raw.endswith("data: [DONE]\n\n") and not any("usage" in e for e in events)
    # vLLM's fingerprint where it puts it when no usage is asked for: on the choice's end
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert [bool(e.get("system_fingerprint")) for e in events[-2:]] == [False, True]
    answer = "".join(e["choices"][0]["delta"].get("content") or "" for e in events)
    prompt = post(s.p_url + "/tokenize", {"model": s.model, "messages": chat,
                                          "add_generation_prompt": True})["count"]
    chat += [{"role": "assistant", "content": answer},
             {"role": "user", "content": "And what does it keep? " * 8}]
    looked_up = _metric(s.proxy_url, "kvxfer_proxy_peer_reads_total", outcome="looked_up")
    loaded = _metric(s.p_url, "vllm:external_prefix_cache_hits_total")
    two = post(s.proxy_url + "/v1/chat/completions", {**body, "messages": chat}, headers)
    assert _metric(s.proxy_url, "kvxfer_proxy_peer_reads_total", outcome="looked_up") == looked_up + 1
    # the whole blocks of turn 1's prompt and its 100-token answer but the last token
    assert _until(lambda: _metric(s.p_url, "vllm:external_prefix_cache_hits_total") - loaded,
                  (prompt + 99) // 64 * 64) == (prompt + 99) // 64 * 64
    alone = post(s.p_url + "/v1/chat/completions", {**body, "messages": chat})
    assert two["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]


def test_a_p_reads_a_shared_system_prompt_another_p_holds(peer_stack, second_pair):
    """One user's request went through the second pair: its P (P1) holds the system prompt in
    its pool. Another user's, which starts with it, goes to the first pair's P (P0): P1,
    asked for the system prompt (the lookup), answers from its pool, P0 reads it from P1 and
    computes the user's message alone; the answer is P0's alone."""
    s0, s1 = peer_stack, second_pair
    system = random_prompt(256, 91)
    _turn(s1, system + random_prompt(40, 92), max_tokens=4)
    lookup = s1.complete(s1.p_url, system, max_tokens=1,
                         kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"]
    assert lookup["port"] == 5619  # P1's NIXL listener: the second pair's PD_KV_PORT
    second = system + random_prompt(40, 93)
    read = _metric(s0.p_url, "vllm:kvxfer_num_transfers_total", role="D")
    loaded = _metric(s0.p_url, "vllm:external_prefix_cache_hits_total")
    two = _turn(s0, second, max_tokens=8, kv_source=lookup)
    assert _until(lambda: _metric(s0.p_url, "vllm:kvxfer_num_transfers_total", role="D") - read, 1) == 1
    assert _metric(s0.p_url, "vllm:external_prefix_cache_hits_total") - loaded == 256
    _same_answer(two, s0.complete(s0.p_url, second, max_tokens=8, ignore_eos=True))
