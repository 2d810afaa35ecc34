"""P and D across hosts the way tpu-inference deploys them: each instance over two Ray nodes
(its own cluster, each node in a network namespace of its own with two CPU devices), its
workers run by tpu-inference's Ray executor (`TPU_MULTIHOST_BACKEND=ray`), tensor parallel
over both nodes; `kvxfer proxy` in front (`scripts/ray-pd-up`).

vLLM's `KVOutputAggregator` merges the two workers' output: D reports a load finished once
both workers hold their shards, P frees a request's staging once both have freed theirs.
"""

from __future__ import annotations

import re

from serve_stack import random_prompt
from test_serve import _metric, _same_answer, _until


def _counts(stack) -> tuple[float, float]:
    return (_metric(stack.d_url, "vllm:kvxfer_num_transfers_total", role="D"),
            _metric(stack.d_url, "vllm:kvxfer_num_fallbacks_total"))


def test_tpu_inferences_ray_executor_runs_each_instances_workers_on_both_nodes(ray_stack):
    """The engines' own logs: tpu-inference's Ray executor placed one worker per node, one
    on the head's node (its log lines carry no address) and one on the other node's."""
    for role in ("P", "D"):
        log = (ray_stack.dir / role / "serve.log").read_text(errors="replace")
        assert "RayDistributedExecutor" in log and "nodes_with_device=2" in log, role
        local = set(re.findall(r"\(RayWorkerProc pid=(\d+)\)", log))
        remote = set(re.findall(r"\(RayWorkerProc pid=(\d+), ip=[\d.]+\)", log))
        assert len(local) == 1 and len(remote) == 1, (role, local, remote)


def test_d_over_two_ray_nodes_answers_as_p_alone_from_ps_kv_for_every_request(ray_stack):
    stack = ray_stack
    transfers, fallbacks = _counts(stack)
    for i, n in enumerate((70, 190)):  # two and several 64-token blocks, the last partial
        prompt = random_prompt(n, seed=5000 + i)
        got = stack.complete(stack.proxy_url, prompt)
        want = transfers + 2 * (i + 1)  # each of D's two workers read its piece of the KV
        assert _until(lambda: _counts(stack)[0], want) == want
        _same_answer(got, stack.complete(stack.p_url, prompt))
    assert _counts(stack)[1] == fallbacks  # D computed no prompt itself
    # P's workers each freed their piece once D read it: nothing left held for D.
    assert _until(lambda: _metric(stack.p_url, "vllm:kvxfer_requests_held"), 0.0) == 0.0
