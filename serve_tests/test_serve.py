"""Through `kvxfer proxy`, D decodes from P's KV exactly as P answers alone.

The stack: P (TP 2) and D (TP 1) as `vllm serve` on tpu-inference's own runner, kvxfer's
connector in both, an 80-token chunk budget (blocks of 64 straddle chunk boundaries). The
model's logits are peaky (`scripts/tiny-model`), so greedy tokens are compared exactly and
logprobs to float32 rounding. The last test kills P: keep it last.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from serve_stack import TIMEOUT_S, post, random_prompt

from kvxfer.bench.load import front

LOGPROB_TOL = 1e-3
BLOCK = 64  # tokens per block: tpu-inference's page size for this model on CPU
LENGTHS = [5, 63, 64, 65, 150, 400, 900]  # under a block, at its edges, to most of the 1,024 context



def _same_answer(got: dict, expected: dict) -> None:
    g, e = got["choices"][0], expected["choices"][0]
    assert g["token_ids"] == e["token_ids"]
    np.testing.assert_allclose(g["logprobs"]["token_logprobs"], e["logprobs"]["token_logprobs"],
                               atol=LOGPROB_TOL)
    for top_g, top_e in zip(g["logprobs"]["top_logprobs"], e["logprobs"]["top_logprobs"]):
        assert top_g.keys() == top_e.keys()
        np.testing.assert_allclose([top_g[k] for k in top_e], list(top_e.values()), atol=LOGPROB_TOL)


def _metric(url: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus series' samples at `url`/metrics that carry `labels` (0 when
    there are none)."""
    with urllib.request.urlopen(url + "/metrics", timeout=TIMEOUT_S) as response:
        lines = response.read().decode().splitlines()
    wanted = [f'{key}="{value}"' for key, value in labels.items()]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines
               if (line.startswith(name + "{") or line.startswith(name + " "))
               and all(w in line.split("}")[0] for w in wanted))


def _until(read, expected: float, timeout_s: float = 30.0) -> float:
    """`read()` once it equals `expected` (stats reach /metrics a step or two later), or its
    last value after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while (value := read()) != expected and time.monotonic() < deadline:
        time.sleep(0.5)
    return value


def _block_bytes(stack) -> int:
    """One 64-token block of every layer, K and V, float32, head_dim padded to 128."""
    config = json.loads((stack.dir.parent / "serve_tests-model" / "config.json").read_text())
    return (config["num_hidden_layers"] * BLOCK * 2 * config["num_key_value_heads"]
            * max(config["head_dim"], 128) * 4)


@pytest.mark.parametrize("length", LENGTHS)
def test_d_decodes_from_p_s_kv_as_p_answers_alone(tp_stack, length):
    prompt = random_prompt(length, seed=length)
    external = _metric(tp_stack.d_url, "vllm:external_prefix_cache_hits_total")
    got = tp_stack.complete(tp_stack.proxy_url, prompt)  # cold on P and on D
    # D took the prompt's KV from P instead of computing it.
    assert _metric(tp_stack.d_url, "vllm:external_prefix_cache_hits_total") - external >= length - 1
    _same_answer(got, tp_stack.complete(tp_stack.p_url, prompt))


def test_concurrent_requests_through_the_proxy_each_answer_as_p_alone(tp_stack):
    """Six at once, of mixed lengths: batched on P and on D, each answers as P alone (the
    test bed once drifted after such batches: tpu_cpu.patches' copying device_put)."""
    prompts = [random_prompt(n, seed=2000 + n) for n in (5, 7, 30, 64, 100, 200)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: tp_stack.complete(tp_stack.proxy_url, p), prompts))
    for prompt, answer in zip(prompts, answers):
        _same_answer(answer, tp_stack.complete(tp_stack.p_url, prompt))


def test_a_prompt_sent_twice_is_a_prefix_hit_on_d_and_answers_alike(tp_stack):
    prompt = random_prompt(300, seed=1)
    first = tp_stack.complete(tp_stack.proxy_url, prompt)
    local = _metric(tp_stack.d_url, "vllm:prefix_cache_hits_total")
    second = tp_stack.complete(tp_stack.proxy_url, prompt)
    assert _metric(tp_stack.d_url, "vllm:prefix_cache_hits_total") - local >= 256  # 4 blocks of 64
    _same_answer(second, first)
    _same_answer(second, tp_stack.complete(tp_stack.p_url, prompt))


def test_streaming_through_the_proxy_gives_p_alone_s_text(tp_stack):
    prompt = random_prompt(200, seed=2)
    body = {"model": tp_stack.model, "prompt": prompt, "max_tokens": 12, "temperature": 0,
            "stream": True}
    request = urllib.request.Request(tp_stack.proxy_url + "/v1/completions",
                                     json.dumps(body).encode(), {"Content-Type": "application/json"})
    pieces = []
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
        for line in response:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                pieces.append(json.loads(line[6:])["choices"][0]["text"])
    assert len(pieces) > 1  # relayed as chunks, not one answer
    alone = post(tp_stack.p_url + "/v1/completions", {**body, "stream": False})
    assert "".join(pieces) == alone["choices"][0]["text"]


def test_chat_completions_through_the_proxy_answer_as_p_alone(tp_stack):
    body = {"model": tp_stack.model, "messages": [{"role": "user", "content": "hello world " * 20}],
            "max_tokens": 8, "temperature": 0}
    got = post(tp_stack.proxy_url + "/v1/chat/completions", body)
    alone = post(tp_stack.p_url + "/v1/chat/completions", body)
    assert got["choices"][0]["message"]["content"] == alone["choices"][0]["message"]["content"]


def test_p_s_and_d_s_metrics_count_exactly_the_kv_that_moved(tp_stack):
    """kvxfer's series in vLLM's /metrics: transfers and bytes (blocks x block bytes) on both."""
    def counts():
        return [_metric(url, f"vllm:kvxfer_{name}_total", role=role)
                for url, role in ((tp_stack.p_url, "P"), (tp_stack.d_url, "D"))
                for name in ("num_transfers", "kv_bytes")]

    before = counts()
    lengths = [100, 200, 300]
    for n in lengths:  # fresh prompts: D reads every block of each
        tp_stack.complete(tp_stack.proxy_url, random_prompt(n, seed=1000 + n), max_tokens=2)
    block = _block_bytes(tp_stack)
    moved = sum(-(-n // BLOCK) for n in lengths) * block
    settled = [before[0] + 3, before[2] + 3, before[3] + moved]  # P's bytes aside: see below
    _until(lambda: [counts()[i] for i in (0, 2, 3)], settled)
    after = counts()
    figures = {"before": before, "after": after, "moved": moved}
    assert after[0] - before[0] == 3 and after[2] - before[2] == 3, figures
    assert after[3] - before[3] == moved, figures  # D: exactly the prompts' blocks
    staged = after[1] - before[1]  # P: those blocks, and each straddling block again per chunk
    assert staged >= moved and staged % block == 0, figures


@contextlib.contextmanager
def _proxy(stack, port: int, *flags: str, decode: str | None = None) -> Iterator[str]:
    """Another `kvxfer proxy` in front of `stack`'s P and D (or the D URLs `decode`), on
    `port`, with `flags`; its log is `proxy-PORT.log` in the stack's directory."""
    with front(stack.dir, f"proxy-{port}", port, [
            "kvxfer", "proxy", "--prefill", stack.p_url, "--decode", decode or stack.d_url,
            "--port", str(port), *flags]) as url:
        yield url


@pytest.fixture(scope="module")
def stream_proxy(tp_stack):
    """A second `kvxfer proxy`, with `--stream`, in front of the same P and D."""
    with _proxy(tp_stack, 8030, "--stream") as url:
        yield url


@pytest.fixture(scope="module")
def routing_proxy(tp_stack):
    """A `kvxfer proxy` with its default routing (the stack's own is started with
    `--local-prefill-tokens 0`, so that its tests move every prompt's KV)."""
    with _proxy(tp_stack, 8031) as url:
        yield url


def _complete_with_transfer(stack, url: str, prompt: list[int]) -> tuple[dict, str, str]:
    """`Stack.complete` through a proxy, with how the KV moved (`X-Kvxfer-Transfer`) and the
    route (`X-Kvxfer-Route`)."""
    body = {"model": stack.model, "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "logprobs": 3, "return_token_ids": True}
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
        headers = response.headers
        return json.loads(response.read()), headers["X-Kvxfer-Transfer"], headers["X-Kvxfer-Route"]


def test_streamed_requests_decode_exactly_as_p_answers_alone(tp_stack, stream_proxy):
    """D reads each chunk's KV while P prefills (80-token chunks, 64-token blocks: blocks
    straddle chunks): the answers are P's alone, as for requests that go by P's params."""
    _, how, _ = _complete_with_transfer(tp_stack, stream_proxy, random_prompt(30, seed=3000))
    assert how == "params"  # the proxy learns P's kvxfer address from P's first answer
    for length in (65, 150, 400, 900):
        prompt = random_prompt(length, seed=3000 + length)
        external = _metric(tp_stack.d_url, "vllm:external_prefix_cache_hits_total")
        got, how, _ = _complete_with_transfer(tp_stack, stream_proxy, prompt)  # cold on P and D
        assert how == "stream"
        hits = _metric(tp_stack.d_url, "vllm:external_prefix_cache_hits_total") - external
        assert hits >= length - 1  # D took the prompt's KV from P's stream
        _same_answer(got, tp_stack.complete(tp_stack.p_url, prompt))


def test_a_conversations_next_turn_is_prefilled_on_d_alone_and_answers_as_p_alone(
        tp_stack, routing_proxy):
    """The proxy's default routing: turn 1 goes through P; turn 2 (turn 1's prompt, the
    answer D decoded, 60 new tokens) goes to D alone, which finds turn 1 and what it can of
    the answer in its prefix cache, counts a local prefill, no fallback, and answers as P."""
    turn1 = random_prompt(300, seed=7000)
    got1, how1, route1 = _complete_with_transfer(tp_stack, routing_proxy, turn1)
    assert (how1, route1.split(";")[0]) == ("params", "choice=pd"), route1
    turn2 = turn1 + got1["choices"][0]["token_ids"] + random_prompt(60, seed=7001)
    d = tp_stack.d_url
    local, hits = (_metric(d, "vllm:kvxfer_num_local_prefills_total"),
                   _metric(d, "vllm:prefix_cache_hits_total"))
    fallbacks = _metric(d, "vllm:kvxfer_num_fallbacks_total")
    got2, how2, route2 = _complete_with_transfer(tp_stack, routing_proxy, turn2)
    assert how2 == "local" and route2.startswith("choice=local; prefill=-;"), route2
    assert "expected_hit=288;" in route2, route2  # 18 whole spans of 16 tokens of turn 1
    assert _metric(d, "vllm:prefix_cache_hits_total") - hits >= 256  # turn 1's 4 whole blocks
    assert _until(lambda: _metric(d, "vllm:kvxfer_num_local_prefills_total"), local + 1) == local + 1
    assert _metric(d, "vllm:kvxfer_num_fallbacks_total") == fallbacks
    _same_answer(got2, tp_stack.complete(tp_stack.p_url, turn2))


def test_a_request_whose_d_is_full_is_served_whole_by_p_and_answers_as_p_alone(tp_stack):
    """`--decode-slots 1 --whole-slots 2`: while D decodes one request, the next is served
    whole by P (no KV moves, `X-Kvxfer-Transfer: whole`) and answers as P alone does."""
    busy, prompt = random_prompt(100, seed=9300), random_prompt(150, seed=9301)
    with _proxy(tp_stack, 8034, "--decode-slots", "1", "--whole-slots", "2") as proxy:
        with ThreadPoolExecutor(1) as pool:
            # 300 tokens, past any end of sequence: D decodes it for seconds after it is routed
            first = pool.submit(tp_stack.complete, proxy, busy, 300, ignore_eos=True)
            time.sleep(1.0)  # routed by now: it holds D's one slot until D has answered
            got, how, route = _complete_with_transfer(tp_stack, proxy, prompt)
            assert first.result(timeout=TIMEOUT_S)["choices"][0]["text"]
    assert how == "whole" and route.startswith("choice=whole; prefill=-;"), route
    assert f"decode={tp_stack.p_url};" in route and "reason=d_full" in route
    _same_answer(got, tp_stack.complete(tp_stack.p_url, prompt))


def test_a_p_that_hangs_with_the_request_is_given_up_at_a_health_check_and_d_prefills_alone(
        tp_stack):
    """P is stopped (SIGSTOP: its host gone, as the proxy sees it; no connection breaks) and
    takes the request into its socket's backlog: the proxy gives P's request up when a health
    check finds P's /health unanswered, well before --prefill-timeout, and D prefills the
    prompt alone, answering as P does once it runs again."""
    prompt = random_prompt(200, seed=9100)
    with _proxy(tp_stack, 8033, "--health-interval", "1") as proxy:
        os.killpg(tp_stack.pid("P"), signal.SIGSTOP)
        try:  # the client's own timeout, TIMEOUT_S, is well under --prefill-timeout's 600 s
            got, how, route = _complete_with_transfer(tp_stack, proxy, prompt)
        finally:
            os.killpg(tp_stack.pid("P"), signal.SIGCONT)
    assert how == "local" and "reason=p_unreachable" in route, route
    _same_answer(got, tp_stack.complete(tp_stack.p_url, prompt))


def test_p_killed_between_prefill_and_decode_is_recomputed_on_d(tp_stack):
    """Last: P stays dead. D's load fails and, under `kv_load_failure_policy=recompute`,
    D computes the prompt itself and answers as P did."""
    prompt = random_prompt(330, seed=3)
    alone = tp_stack.complete(tp_stack.p_url, prompt)
    prefill = tp_stack.complete(tp_stack.p_url, prompt, max_tokens=1,
                                kv_transfer_params={"do_remote_decode": True})
    failed = _metric(tp_stack.d_url, "vllm:kvxfer_num_failed_transfers_total", role="D")
    os.killpg(tp_stack.pid("P"), signal.SIGKILL)
    params = prefill["kv_transfer_params"]
    _same_answer(tp_stack.complete(tp_stack.d_url, prompt, kv_transfer_params=params), alone)
    # The failure is counted under its reason: P's agent is gone (or never answered in time).
    reasons = {reason: _metric(tp_stack.d_url, "vllm:kvxfer_num_failed_transfers_total",
                               role="D", reason=reason) for reason in ("peer_gone", "deadline")}
    assert _until(lambda: _metric(tp_stack.d_url, "vllm:kvxfer_num_failed_transfers_total",
                                  role="D"), failed + 1) == failed + 1, reasons

