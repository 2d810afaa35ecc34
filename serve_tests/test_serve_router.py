"""Behind vllm-router (0.1.17, its vLLM P/D mode) instead of `kvxfer proxy`: D decodes from
P's KV, and what D computes itself is counted; then vllm-router's `cache_aware` policy over
two P and two D (this stack's pair and a second one).

vllm-router asks P, then sends the client's request to D with the params P returned; it
sends D the request without params when P returns none, and the client cannot tell. D's
`vllm:kvxfer_*` series are the only witness, so these tests read them.
"""

from __future__ import annotations

import json
import os
import subprocess
import urllib.request

import pytest
from serve_stack import ROOT, TIMEOUT_S, post, random_prompt, start
from test_serve import _metric, _same_answer, _until

from kvxfer.bench.load import front


def _transfers(stack) -> float:
    return _metric(stack.d_url, "vllm:kvxfer_num_transfers_total", role="D")


def _fallbacks(stack, **labels: str) -> float:
    return _metric(stack.d_url, "vllm:kvxfer_num_fallbacks_total", **labels)


def test_plain_and_streamed_requests_through_vllm_router_move_the_kv_and_answer_as_p_alone(
        router_stack):
    stack = router_stack
    before, fallbacks = _transfers(stack), _fallbacks(stack)
    prompt = random_prompt(150, seed=4000)
    got = stack.complete(stack.proxy_url, prompt)
    assert _until(lambda: _transfers(stack), before + 1) == before + 1  # D read P's KV
    _same_answer(got, stack.complete(stack.p_url, prompt))

    body = {"model": stack.model, "prompt": random_prompt(200, seed=4001), "max_tokens": 12,
            "temperature": 0, "stream": True}
    request = urllib.request.Request(stack.proxy_url + "/v1/completions",
                                     json.dumps(body).encode(), {"Content-Type": "application/json"})
    pieces = []
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
        for line in response:
            line = line.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                pieces.append(json.loads(line[6:])["choices"][0]["text"])
    assert len(pieces) > 1  # relayed as chunks, not one answer
    alone = post(stack.p_url + "/v1/completions", {**body, "stream": False})
    assert "".join(pieces) == alone["choices"][0]["text"]
    assert _until(lambda: _transfers(stack), before + 2) == before + 2
    assert _fallbacks(stack) == fallbacks  # neither went without P's KV


def test_pd_up_pins_each_engines_whole_process_tree_to_its_own_cores(router_stack):
    """`PD_P_CPUS=0 PD_D_CPUS=1`: every process of P's group (the API server, its engine
    core) may run on core 0 alone, every one of D's on core 1 alone, from their start."""
    for name, cpus in (("P", {0}), ("D", {1})):
        group = router_stack.pid(name)
        tree = [int(p) for p in os.listdir("/proc") if p.isdigit() and _group_of(int(p)) == group]
        assert len(tree) >= 2, f"{name}'s process group {group} has {tree}"
        assert {pid: os.sched_getaffinity(pid) for pid in tree} == dict.fromkeys(tree, cpus)
    assert "D_CPUS=1" in (router_stack.dir / "stack.env").read_text()


def _group_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def test_pd_up_refuses_a_cpu_list_or_decode_batch_by_name_before_starting_anything(tmp_path):
    for var, value in (("PD_P_CPUS", "9999"), ("PD_P_CPUS", "0-99"), ("PD_D_CPUS", "0;1"),
                       ("PD_D_MAX_NUM_SEQS", "0")):
        out = subprocess.run(["bash", "scripts/pd-up"], cwd=ROOT, capture_output=True, text=True,
                             env={**os.environ, "PD_DIR": str(tmp_path), var: value}, timeout=60)
        assert out.returncode == 1 and f"{var} must be" in out.stderr and f"'{value}'" in out.stderr
        assert not list(tmp_path.glob("*.pid")) and not list(tmp_path.glob("*.log"))


def test_a_request_reaching_d_without_params_is_counted_as_a_fallback(router_stack):
    """What vllm-router sends D when P returns no params: D computes the prompt itself, the
    answer is the same, and D's /metrics counts it (reason no_params, no P engine)."""
    stack = router_stack
    labels = {"reason": "no_params", "p_engine": "none"}
    before, transfers = _fallbacks(stack, **labels), _transfers(stack)
    prompt = random_prompt(100, seed=4002)
    _same_answer(stack.complete(stack.d_url, prompt), stack.complete(stack.p_url, prompt))
    assert _until(lambda: _fallbacks(stack, **labels), before + 1) == before + 1
    assert _transfers(stack) == transfers
    assert "no kv_transfer_params from P" in (stack.dir / "D.log").read_text()


@pytest.fixture(scope="module")
def fleet(router_stack):
    """A second kvxfer pair beside `router_stack`'s, and vllm-router in its vLLM P/D mode with
    `cache_aware` over both P and both D: its URL and the two pairs."""
    second = start("router1", PD_FRONT="vllm-router", PD_P_PORT="8141", PD_D_PORT="8241",
                   PD_PROXY_PORT="8041", PD_KV_PORT="5615")
    pairs = [router_stack, next(second)]
    try:
        argv = ["vllm-router", "--vllm-pd-disaggregation",
                *(a for s in pairs for a in ("--prefill", s.p_url)),
                *(a for s in pairs for a in ("--decode", s.d_url)),
                "--policy", "cache_aware", "--host", "127.0.0.1", "--port", "8042",
                "--prometheus-host", "127.0.0.1", "--prometheus-port", "28042"]
        with front(router_stack.dir, "vllm-router-fleet", 8042, argv) as url:
            yield url, pairs
    finally:
        second.close()  # its pd-down


def _words(n: int, seed: int) -> str:
    """A text prompt of `n` words, about 5 tokens each (vllm-router's `cache_aware` matches
    prompts by their text)."""
    return " ".join(f"w{i}" for i in random_prompt(n, seed))


def test_cache_aware_over_two_p_and_two_d_moves_every_turns_kv_and_answers_as_one_instance(
        fleet):
    """Four conversations of two turns through vllm-router's `cache_aware` over two kvxfer
    pairs: each turn's KV moves from P to D (no fallback), turn 2 (turn 1's prompt, its
    answer and 12 new words) goes to the P that prefilled turn 1 and finds turn 1's whole
    blocks in its prefix cache, and every answer is one instance's. (vllm-router 0.1.17
    picks P in its P/D mode by load, not prefix: one request at a time, every prompt goes
    to the first P, which this test records and does not require.)"""
    url, pairs = fleet
    ps, ds = [s.p_url for s in pairs], [s.d_url for s in pairs]

    def on(urls, name, **labels):
        return [_metric(u, name, **labels) for u in urls]

    def prefilled_by(prompt):  # the P whose prompt tokens grew by this request's
        before = on(ps, "vllm:prompt_tokens_total")
        got = pairs[0].complete(url, prompt)
        grown = [a - b for a, b in zip(on(ps, "vllm:prompt_tokens_total"), before)]
        assert sorted(grown)[0] == 0 and sorted(grown)[1] >= 256, grown
        return got, grown.index(max(grown))

    transfers = sum(on(ds, "vllm:kvxfer_num_transfers_total", role="D"))
    fallbacks = sum(on(ds, "vllm:kvxfer_num_fallbacks_total"))
    turns = {}
    for i in range(4):
        turn1 = _words(64, seed=4100 + i)
        got, p = prefilled_by(turn1)
        turns[i] = (turn1 + got["choices"][0]["text"] + " " + _words(12, seed=4200 + i), p)
    for turn2, p in turns.values():
        hits = _metric(ps[p], "vllm:prefix_cache_hits_total")
        got, again = prefilled_by(turn2)
        assert again == p
        assert _metric(ps[p], "vllm:prefix_cache_hits_total") - hits >= 256
        _same_answer(got, pairs[0].complete(ps[0], turn2))
    assert _until(lambda: sum(on(ds, "vllm:kvxfer_num_transfers_total", role="D")),
                  transfers + 8) == transfers + 8
    assert sum(on(ds, "vllm:kvxfer_num_fallbacks_total")) == fallbacks
