"""Smoke tests of the harness itself: real vLLM scheduler, simulated worker, no connector."""

import jax
import numpy as np
from engine import sample_token


def _prompt(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(10, 1000, size=n)]


def _assert_prompt_kv(engine, req_id, prompt):
    for layer in range(engine.num_layers):
        for pos, tok in enumerate(prompt):
            block, row = engine.slot_of(req_id, layer, pos)
            got = engine.read_token_kv(layer, block, row)
            np.testing.assert_array_equal(got, engine.stamp(layer, pos, tok))


def test_chunked_prefill_and_decode_stamp_kv(model_dir, engines):
    eng = engines(model_dir, kv_role=None, devices=jax.devices()[:4], max_num_batched_tokens=32)
    prompts = {"a": _prompt(1, 40), "b": _prompt(2, 70)}
    for rid, p in prompts.items():
        eng.add_request(rid, p, max_tokens=3)

    tokens = {rid: [] for rid in prompts}
    finished = {}
    for _ in range(50):
        res = eng.step()
        assert res.scheduler_output.total_num_scheduled_tokens <= 32
        for rid, toks in res.new_tokens.items():
            tokens[rid].extend(toks)
        finished.update(res.finished)
        if set(finished) == set(prompts):
            break
    assert finished == {"a": None, "b": None}
    # The last step freed the blocks but nothing reused them: the prompt KV is
    # still where the harness's block tables say.
    for rid, p in prompts.items():
        _assert_prompt_kv(eng, rid, p)
        assert len(tokens[rid]) == 3
        seq = list(p)  # greedy toy model: each token is a function of the prefix
        for t in tokens[rid]:
            assert t == sample_token(seq)
            seq.append(t)


def test_prefix_cache_hit(model_dir, engines):
    eng = engines(model_dir, kv_role=None, devices=jax.devices()[:2], max_num_batched_tokens=64)
    shared = _prompt(3, 32)
    first = shared + _prompt(4, 8)
    second = shared + _prompt(5, 12)
    eng.add_request("first", first, max_tokens=1)
    eng.run_until(lambda r: "first" in r.finished)

    eng.add_request("second", second, max_tokens=2)
    res = eng.step()
    new = {n.req_id: n for n in res.scheduler_output.scheduled_new_reqs}
    assert new["second"].num_computed_tokens == 32
    assert res.scheduler_output.num_scheduled_tokens["second"] == len(second) - 32
    # The hit blocks hold the first request's KV for the shared prefix.
    _assert_prompt_kv(eng, "second", second)
    eng.run_until(lambda r: "second" in r.finished)


def test_connector_plumbing_with_stub(model_dir, engines):
    import stub_connector

    stub_connector.CALLS.clear()
    eng = engines(model_dir, kv_role="kv_both", devices=jax.devices()[:2], kv_connector="StubConnector",
                  kv_connector_module_path="stub_connector")
    assert eng.worker is not None and eng.connector is not None and eng.worker is not eng.connector
    assert ("WORKER", "register_runner", 2) in stub_connector.CALLS
    eng.add_request("r", _prompt(6, 20), max_tokens=2, kv_transfer_params={"do_remote_decode": True})
    results = eng.run_until(lambda r: "r" in r.finished)
    assert results[-1].finished == {"r": {"from": "stub", "req": "r"}}
    assert ("SCHEDULER", "request_finished", ("r", {"do_remote_decode": True})) in stub_connector.CALLS
    names = [c[1] for c in stub_connector.CALLS if c[0] == "WORKER"]
    assert names.count("start_load_kv") == names.count("wait_for_save") == len(results)


def test_speculative_lookahead(model_dir, engines):
    eng = engines(model_dir, kv_role=None, devices=jax.devices()[:2], num_speculative_lookahead=2)
    assert eng.vllm_config.num_lookahead_tokens == 2
    prompt = _prompt(7, 40)
    eng.add_request("s", prompt, max_tokens=5)
    out = []
    steps = eng.run_until(lambda r: out.extend(r.new_tokens.get("s", [])) or "s" in r.finished)
    assert any(r.scheduler_output.scheduled_spec_decode_tokens for r in steps)
    seq = list(prompt)
    for t in out:
        assert t == sample_token(seq)
        seq.append(t)
    assert len(out) == 5 and len(steps) < 5  # drafts were accepted


def test_hybrid_groups(hybrid_model_dir, engines):
    eng = engines(hybrid_model_dir, kv_role=None, devices=jax.devices()[:4], hybrid=True,
                  max_num_batched_tokens=32)
    assert len(eng.kv_cache_config.kv_cache_groups) == 2
    # layers j of the two groups alias one array, as in vLLM's plan / tpu-inference
    assert len(eng.runner.kv_caches) == 2
    prompt = _prompt(8, 100)
    eng.add_request("h", prompt, max_tokens=1)
    eng.run_until(lambda r: "h" in r.finished)
    for layer in range(4):
        lo = 0 if layer % 2 == 0 else len(prompt) - 32  # sliding-window layers keep the window
        for pos in range(lo, len(prompt)):
            block, row = eng.slot_of("h", layer, pos)
            got = eng.read_token_kv(layer, block, row)
            np.testing.assert_array_equal(got, eng.stamp(layer, pos, prompt[pos]))
