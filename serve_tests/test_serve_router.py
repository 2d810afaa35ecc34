"""Behind vllm-router (0.1.17, its vLLM P/D mode) instead of `kvxfer proxy`: D decodes from
P's KV, and what D computes itself is counted.

vllm-router asks P, then sends the client's request to D with the params P returned; it
sends D the request without params when P returns none, and the client cannot tell. D's
`vllm:kvxfer_*` series are the only witness, so these tests read them.
"""

from __future__ import annotations

import json
import urllib.request

from serve_stack import TIMEOUT_S, post, random_prompt
from test_serve import _metric, _same_answer, _until


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
