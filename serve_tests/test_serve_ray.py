"""P and D across hosts the way tpu-inference deploys them: each instance over two Ray nodes
(its own cluster, each node in a network namespace of its own with two CPU devices), its
workers run by tpu-inference's Ray executor (`TPU_MULTIHOST_BACKEND=ray`), tensor parallel
over both nodes; `kvxfer proxy` in front (`scripts/ray-pd-up`). D1 is a second D on one
host (four devices, one process: vLLM's one-process executor), which reads from P's two
workers with no setting (every instance stages units).

vLLM's `KVOutputAggregator` merges the two workers' output: D reports a load finished once
both workers hold their shards, P frees a request's staging once both have freed theirs.
The last test kills one of P's workers, then starts P again: keep it last.
"""

from __future__ import annotations

import os
import re
import signal
import time

from serve_stack import random_prompt, restart_ray_p
from test_serve import _complete_with_transfer, _metric, _proxy, _same_answer, _until


def _counts(stack, url=None) -> tuple[float, float]:
    """D's (at `url`, default the stack's D) transfers and fallbacks."""
    url = url or stack.d_url
    return (_metric(url, "vllm:kvxfer_num_transfers_total", role="D"),
            _metric(url, "vllm:kvxfer_num_fallbacks_total"))


def _failures(stack) -> dict[str, float]:
    return {reason: _metric(stack.d_url, "vllm:kvxfer_num_failed_transfers_total", role="D",
                            reason=reason) for reason in ("peer_gone", "deadline", "other_process")}


def test_tpu_inferences_ray_executor_runs_each_instances_workers_on_both_nodes(ray_stack):
    """The engines' own logs: tpu-inference's Ray executor placed one worker per node, one
    on the head's node (its log lines carry no address) and one on the other node's."""
    for role in ("P", "D"):
        log = (ray_stack.dir / role / "serve.log").read_text(errors="replace")
        assert "RayDistributedExecutor" in log and "nodes_with_device=2" in log, role
        local = set(re.findall(r"\(RayWorkerProc pid=(\d+)\)", log))
        remote = set(re.findall(r"\(RayWorkerProc pid=(\d+), ip=[\d.]+\)", log))
        assert len(local) == 1 and len(remote) == 1, (role, local, remote)
    log = (ray_stack.dir / "D1" / "serve.log").read_text(errors="replace")
    assert "Force using UniProcExecutor" in log and "RayWorkerProc" not in log
    assert "stage_units" not in log


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


def test_d_on_one_host_staging_units_answers_as_p_alone_from_the_kv_of_both_p_workers(ray_stack):
    """P over two hosts, D on one: D1's one process reads units 0-3 of each block from P's
    first worker and 4-7 from its second, into one unit-major piece of all eight; through
    D1's own proxy, and by P's params handed on by the test."""
    stack = ray_stack
    transfers, fallbacks = _counts(stack, stack.d1_url)
    for i, n in enumerate((70, 190)):
        prompt = random_prompt(n, seed=5500 + i)
        if i == 0:
            got = stack.complete(stack.d1_proxy_url, prompt)
        else:
            prefill = stack.complete(stack.p_url, prompt, max_tokens=1,
                                     kv_transfer_params={"do_remote_decode": True})
            sources = prefill["kv_transfer_params"]["sources"]
            assert [s["units"] for s in sources] == [[0, 4], [4, 8]], sources
            got = stack.complete(stack.d1_url, prompt,
                                 kv_transfer_params=prefill["kv_transfer_params"])
        want = transfers + i + 1  # one D worker, one transfer per request
        assert _until(lambda: _counts(stack, stack.d1_url)[0], want) == want
        _same_answer(got, stack.complete(stack.p_url, prompt))
    assert _counts(stack, stack.d1_url)[1] == fallbacks  # D1 computed no prompt itself
    assert _until(lambda: _metric(stack.p_url, "vllm:kvxfer_requests_held"), 0.0) == 0.0


def test_a_prompt_pooled_on_both_p_workers_is_named_not_copied_again_and_d1_reads_it(ray_stack):
    """P over two hosts keeps a host pool (16 MiB a worker): a prompt D read through the proxy
    leaves its whole blocks pooled in both P workers' pieces. The same prompt sent on to D1,
    which holds none of it, names those entries instead of copying them again (P gathers
    only its last, partial block), and D1 reads their units from both P workers."""
    stack = ray_stack
    prompt = random_prompt(200, seed=5800)  # three whole 64-token blocks and 8 tokens
    pooled = _metric(stack.p_url, "vllm:kvxfer_pool_blocks")
    staged = _metric(stack.p_url, "vllm:kvxfer_kv_bytes_total", role="P")
    stack.complete(stack.proxy_url, prompt)
    # at least its three: P also pools what it answered alone (the tests' references), a step
    # after each, so more may enter meanwhile
    deadline = time.monotonic() + 30
    while (_metric(stack.p_url, "vllm:kvxfer_pool_blocks") < pooled + 3
           and time.monotonic() < deadline):
        time.sleep(0.5)
    assert _metric(stack.p_url, "vllm:kvxfer_pool_blocks") >= pooled + 3
    first = _metric(stack.p_url, "vllm:kvxfer_kv_bytes_total", role="P") - staged
    transfers1, fallbacks1 = _counts(stack, stack.d1_url)
    got = stack.complete(stack.d1_proxy_url, prompt)
    assert _until(lambda: _counts(stack, stack.d1_url)[0], transfers1 + 1) == transfers1 + 1
    _same_answer(got, stack.complete(stack.p_url, prompt))
    assert _counts(stack, stack.d1_url)[1] == fallbacks1  # D1 computed none of it itself
    second = _until(lambda: _metric(stack.p_url, "vllm:kvxfer_kv_bytes_total", role="P")
                    - staged - first, first / 6)
    assert 0 < second <= first / 4, (first, second)  # one block, against six gathers (chunks)


def test_a_proxy_over_both_ds_keeps_each_conversation_on_its_d_and_prefills_its_next_turn_there(
        ray_stack):
    """`kvxfer proxy` with its default routing over D (two hosts) and D1 (one host): two
    conversations' first turns go through P, one to each D in turn; each second turn (the
    first, its answer, 40 new tokens) goes to the D that answered the first, alone, and
    answers as P alone."""
    stack = ray_stack
    firsts = [random_prompt(200, seed=5900 + i) for i in range(2)]
    with _proxy(stack, 8395, decode=f"{stack.d_url},{stack.d1_url}") as url:
        turn1 = [_complete_with_transfer(stack, url, prompt) for prompt in firsts]
        assert [how for _, how, _ in turn1] == ["params", "params"]
        ds = [re.search(r"decode=(\S+);", route).group(1) for _, _, route in turn1]
        assert sorted(ds) == sorted([stack.d_url, stack.d1_url]), ds
        for (got1, _, _), first, d in zip(turn1, firsts, ds):
            turn2 = first + got1["choices"][0]["token_ids"] + random_prompt(40, seed=5950)
            got2, how, route = _complete_with_transfer(stack, url, turn2)
            assert how == "local" and f"decode={d};" in route and "reason=prefix" in route, route
            _same_answer(got2, stack.complete(stack.p_url, turn2))


def test_one_p_worker_killed_before_d_reads_fails_the_load_on_both_d_workers_and_d_computes_it(
        ray_stack):
    """Last: P's engine dies with its worker. One of D's two workers reads from the killed
    P worker, the other from the live one: the failure is the whole instance's (counted
    once per D worker, under a named reason), D computes the prompt itself within its
    read deadline and answers as P did, and D serves on. Then P is started again on its
    cluster, and both pairs (P-D, P-D1, through their proxies) move the KV again."""
    stack = ray_stack
    prompt = random_prompt(150, seed=6000)
    alone = stack.complete(stack.p_url, prompt)
    prefill = stack.complete(stack.p_url, prompt, max_tokens=1,
                             kv_transfer_params={"do_remote_decode": True})
    failed = _metric(stack.d_url, "vllm:kvxfer_num_failed_transfers_total", role="D")
    was = _failures(stack)
    load_failed = _metric(stack.d_url, "vllm:kvxfer_num_fallbacks_total", reason="load_failed")
    log = (stack.dir / "P" / "serve.log").read_text(errors="replace")
    (remote,) = set(re.findall(r"\(RayWorkerProc pid=(\d+), ip=[\d.]+\)", log))
    os.kill(int(remote), signal.SIGKILL)  # the P worker on P's second node

    started = time.monotonic()
    got = stack.complete(stack.d_url, prompt, kv_transfer_params=prefill["kv_transfer_params"])
    assert time.monotonic() - started < 60  # D's read deadline is 10 s; nothing hangs
    _same_answer(got, alone)
    # Both D workers fail it: the one whose READ failed (its peer gone, or no answer by the
    # deadline), and the one that read from the live P worker (`other_process`).
    assert _until(lambda: _metric(stack.d_url, "vllm:kvxfer_num_failed_transfers_total",
                                  role="D"), failed + 2) == failed + 2
    reasons = {k: v - was[k] for k, v in _failures(stack).items()}
    # The other reads from the live P worker: it fails with it (`other_process`), unless P's
    # engine, going down with its killed worker, takes that worker too before (`peer_gone`).
    assert sum(reasons.values()) == 2 and reasons["peer_gone"] + reasons["deadline"] >= 1, reasons
    assert _metric(stack.d_url, "vllm:kvxfer_num_fallbacks_total",
                   reason="load_failed") == load_failed + 1  # one request, computed on D
    # D serves on: a prompt of its own.
    other = random_prompt(90, seed=6001)
    assert len(stack.complete(stack.d_url, other)["choices"][0]["token_ids"]) == 8

    # P started again (the same agent names, a new instance): the pairs are healthy, and
    # requests through the proxy and to D1 move their KV from the new P.
    restart_ray_p("ray")
    transfers, fallbacks = _counts(stack)
    transfers1, fallbacks1 = _counts(stack, stack.d1_url)
    prompt = random_prompt(130, seed=6002)
    got = stack.complete(stack.proxy_url, prompt)
    assert _until(lambda: _counts(stack)[0], transfers + 2) == transfers + 2
    got1 = stack.complete(stack.d1_proxy_url, prompt)
    assert _until(lambda: _counts(stack, stack.d1_url)[0], transfers1 + 1) == transfers1 + 1
    alone = stack.complete(stack.p_url, prompt)
    _same_answer(got, alone)
    _same_answer(got1, alone)
    assert (_counts(stack)[1], _counts(stack, stack.d1_url)[1]) == (fallbacks, fallbacks1)
