"""`kvxfer bench serve --multi-turn`'s arithmetic and wiring, with canned figures and no stack
(the run itself needs `.venv-tpu` and minutes: `kvxfer bench serve --multi-turn`)."""

import json
import subprocess

import pytest

from kvxfer.bench import multiturn
from kvxfer.cli import main
from kvxfer.errors import InvalidInputError


def test_held_tokens_are_the_whole_blocks_an_earlier_prompt_started_with():
    seen: set = set()
    system = [7] * 6
    first = system + [1, 2, 3, 4]  # 10 tokens: two whole blocks of 4
    assert multiturn.held_tokens(first, seen, 4) == 0  # nothing sent before
    multiturn.remember(first, seen, 4)
    second = first + [9, 9] + [5, 5, 5, 5, 5]  # the history, an answer, a new message
    assert multiturn.held_tokens(second, seen, 4) == 8  # not the partial third block
    other = system[:4] + [8] * 10  # the same first block only
    assert multiturn.held_tokens(other, seen, 4) == 4
    assert multiturn.held_tokens([8] * 12, seen, 4) == 0
    multiturn.remember(second, seen, 4)
    assert multiturn.held_tokens(second + [1], seen, 4) == 16


@pytest.mark.parametrize("computed, want", [
    (40, (0, 0.0)),     # only the 40 never-held tokens prefilled
    (70, (30, 0.5)),    # 30 held tokens prefilled again
    (100, (60, 1.0)),   # all of it: nothing was kept
    (10, (0, 0.0)),     # fewer than the new ones (a hit on what was never sent)
])
def test_recomputed_tokens_are_the_prefilled_ones_beyond_those_never_held(computed, want):
    assert multiturn.recompute(100, 60, computed) == want


def test_recompute_with_nothing_held_has_no_fraction_and_held_past_the_prompt_is_refused():
    assert multiturn.recompute(100, 0, 100) == (0, None)
    with pytest.raises(InvalidInputError, match="held tokens 120 must be within the prompt's 100"):
        multiturn.recompute(100, 120, 0)


def _scrape(prompt, device, external, transfers=None):
    out = {("P", "vllm:prompt_tokens_total"): prompt, ("P", "vllm:prefix_cache_hits_total"): device,
           ("P", "vllm:external_prefix_cache_hits_total"): external}
    if transfers is not None:
        out[("D", "vllm:kvxfer_num_transfers_total")] = transfers
    return out


def test_a_waves_figures_come_from_its_answers_and_ps_metric_deltas():
    answers = [{"ttft_s": 0.1, "tpot_s": 0.02}, {"ttft_s": 0.3, "tpot_s": 0.04},
               {"ttft_s": 0.2, "tpot_s": None}, {"error": "HTTPError: 500"}]
    before = _scrape(1000, 100, 0, transfers=5)
    after = _scrape(2440, 740, 60, transfers=8)
    t = multiturn.wave_figures(answers, 960, before, after)
    assert t["prompt_tokens"] == 1440 and t["device_hits"] == 640 and t["connector_hits"] == 60
    assert t["computed_tokens"] == 740  # prompt less both kinds of hit
    assert t["recomputed_tokens"] == 260 and t["recompute_fraction"] == 0.271  # 740 - 480 new
    assert t["requests"] == 4 and t["failed"] == 1
    assert t["ttft_ms"] == [100.0, 300.0, 200.0] and t["p50_ttft_ms"] == 200.0
    assert t["p90_ttft_ms"] == 280.0 and t["p50_tpot_ms"] == 30.0
    assert t["kv_moved"] == 1.0  # 3 transfers for the 3 answered
    assert t["computed_on_d"] == 0
    colocated = multiturn.wave_figures(answers[:1], 0, _scrape(0, 0, 0), _scrape(352, 0, 0))
    assert colocated["kv_moved"] is None and colocated["recompute_fraction"] is None


def test_a_wave_d_prefilled_alone_counts_what_d_computed_not_what_d_loaded():
    """Two requests: one through P (D loads 400 tokens, its device held 64), one the proxy sent
    D alone (500 tokens, 448 in D's device cache)."""
    answers = [{"ttft_s": 0.1, "tpot_s": 0.02}, {"ttft_s": 0.05, "tpot_s": 0.02}]
    before = {("P", "vllm:prompt_tokens_total"): 0, ("D", "vllm:prompt_tokens_total"): 0}
    after = {("P", "vllm:prompt_tokens_total"): 464, ("P", "vllm:prefix_cache_hits_total"): 64,
             ("D", "vllm:prompt_tokens_total"): 964, ("D", "vllm:prefix_cache_hits_total"): 512,
             ("D", "vllm:external_prefix_cache_hits_total"): 400}
    t = multiturn.wave_figures(answers, 896, before, after, prompt_tokens=964)
    assert t["prompt_tokens"] == 964 and t["computed_on_d"] == 52
    assert t["computed_tokens"] == 400 + 52
    assert t["recomputed_tokens"] == 452 - (964 - 896)


def test_a_wave_gives_each_instances_mean_queue_and_prefill_time():
    """vLLM's histograms between the two scrapes: two requests queued 3 s in all on D and
    prefilled 0.5 s; the colocated instance (P alone) gives no D figures; a progress line
    names what was measured."""
    h = {("D", "vllm:request_queue_time_seconds_sum"): 3.0,
         ("D", "vllm:request_queue_time_seconds_count"): 2,
         ("D", "vllm:request_prefill_time_seconds_sum"): 0.5,
         ("D", "vllm:request_prefill_time_seconds_count"): 2}
    answers = [{"ttft_s": 2.0, "tpot_s": 0.1}] * 2
    t = multiturn.wave_figures(answers, 0, {}, h, prompt_tokens=100)
    assert t["breakdown_ms"]["d_queue"] == 1500.0 and t["breakdown_ms"]["d_first_step"] == 250.0
    assert t["breakdown_ms"]["p_queue"] is None
    assert multiturn._where_time_went(t["breakdown_ms"]) == "d_queue 1500.0 d_first_step 250.0"
    colocated = multiturn.wave_figures(answers, 0, {}, {
        ("P", "vllm:request_queue_time_seconds_sum"): 1.0,
        ("P", "vllm:request_queue_time_seconds_count"): 2}, prompt_tokens=100)
    assert colocated["breakdown_ms"]["p_queue"] == 500.0
    assert multiturn._where_time_went(None) == "-"


def _turns(ttfts, held, recomputed):
    return [{"ttft_ms": list(t), "requests": len(t), "failed": 0, "p50_ttft_ms": t[0],
             "p90_ttft_ms": t[-1], "p50_tpot_ms": 50.0, "prompt_tokens": 1000, "held_tokens": h,
             "computed_tokens": 1000 - h + r, "recomputed_tokens": r,
             "recompute_fraction": round(r / h, 3) if h else None, "kv_moved": None}
            for t, h, r in zip(ttfts, held, recomputed)]


def _stacks():
    first = [9000.0] * 7  # turn 1, the same everywhere: left out of the ratios and fractions
    held, again = [600, 600, 600, 600], [0, 0, 300, 600]
    return {name: {regime: {"turns": _turns([first, *[[x * scale, x * scale]] * 3],
                                            held, again if regime == "pressure" else [0] * 4)}
                   for regime in multiturn.CONVERSATIONS}
            for name, x, scale in (("kvxfer", 100.0, 1.0), ("tpu_inference", 100.0, 2.0),
                                   ("colocated", 100.0, 0.5))}


def test_the_summary_has_each_regimes_later_turn_ratios_and_recompute_fraction():
    out = multiturn.summary(_stacks())
    assert set(out) == {"fits", "pressure"}
    for regime in ("fits", "pressure"):
        s = out[regime]
        assert s["kvxfer_over_colocated"] == 2.0 and s["kvxfer_over_tpu"] == 0.5
        assert s["p50_ttft_ms_later_turns"] == {"kvxfer": 100.0, "tpu_inference": 200.0,
                                                "colocated": 50.0}
    assert out["fits"]["recompute_fraction"] == 0.0
    assert out["pressure"]["recompute_fraction"] == 0.5  # 900 of 1,800 held, turns 2-4
    assert out["pressure"]["recompute_fraction_by_stack"]["colocated"] == 0.5


def test_pool_series_are_reported_per_label_set_as_they_changed():
    hits = 'vllm:kvxfer_pool_hit_tokens_total{role="P",source="own_pool"}'
    by_tier = 'vllm:prompt_tokens_cached_by_source_total{source="%s"}'
    before = {f"P {hits}": 100.0, "P vllm:kvxfer_pool_blocks{}": 25.0,
              "P " + by_tier % "device": 50.0, "P " + by_tier % "host": 0.0}
    after = {f"P {hits}": 2340.0, "P vllm:kvxfer_pool_blocks{}": 60.0,
             "D vllm:kvxfer_pool_loads_total{}": 0.0,
             "P " + by_tier % "device": 350.0, "P " + by_tier % "host": 0.0}
    out = multiturn.labelled_deltas(before, after)
    assert out["pool"] == {f"P {hits}": 2240.0, "P vllm:kvxfer_pool_blocks{}": 35.0,
                           "D vllm:kvxfer_pool_loads_total{}": 0.0}
    assert out["cached_by_source"] == {"P " + by_tier % "device": 300.0}
    assert multiturn.labelled_deltas({}, {}) == {"pool": {}, "cached_by_source": {}}


def test_the_caches_hold_every_fitting_conversation_and_about_half_the_pressure(monkeypatch):
    assert multiturn.cache_blocks(64) == 40  # 3 x 12 blocks running + 4; fits 28, pressure 68
    monkeypatch.setitem(multiturn.CONVERSATIONS, "pressure", 2)
    with pytest.raises(InvalidInputError, match="do not separate the regimes"):
        multiturn.cache_blocks(64)


def test_the_cache_config_is_read_off_its_labels_not_its_lookalikes(monkeypatch):
    labels = ('{hash_block_size="None",block_size="64",mamba_block_size="128",'
              'num_gpu_blocks="40",num_gpu_blocks_override="None"}')
    monkeypatch.setattr(multiturn, "samples", lambda url: iter([
        ("vllm:num_requests_running", "", 0.0), ("vllm:cache_config_info", labels, 1.0)]))
    assert multiturn._cache_config("http://x") == {"block_size": 64, "num_gpu_blocks": 40}


def test_multi_turn_is_refused_by_name_for_other_benchmarks_and_beside_load(capsys):
    assert main(["bench", "ttft", "--multi-turn"]) == 2
    assert "--multi-turn is an option of `kvxfer bench serve`" in capsys.readouterr().err
    assert main(["bench", "serve", "--multi-turn", "--load"]) == 2
    assert "--multi-turn runs on its own: give one of --load" in capsys.readouterr().err
    assert main(["bench", "serve", "--multi-turn", "--local-prefill"]) == 2
    assert "runs on its own" in capsys.readouterr().err
    assert main(["bench", "e2e", "--local-prefill"]) == 2
    assert "--local-prefill is an option of `kvxfer bench serve`" in capsys.readouterr().err


@pytest.fixture
def no_stack(tmp_path, monkeypatch):
    """`run()` with its stacks replaced by canned figures; P refuses the pool when asked."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "num_hidden_layers": 2, "num_key_value_heads": 2, "head_dim": 128,
        "hidden_size": 256, "num_attention_heads": 4, "dtype": "float32"}))
    (model / "model.safetensors").write_bytes(b"\0" * 1000)
    calls = []

    def stack(name, how, settings):
        calls.append((name, settings.get("PD_HOST_POOL_BYTES")))
        if "PD_HOST_POOL_BYTES" in settings:
            log = tmp_path / ".pd" / "multiturn-kvxfer" / "P.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            log.write_text("InvalidInputError: host_pool_bytes is not yet wired into vLLM\n")
            raise subprocess.CalledProcessError(1, ["bash", "scripts/pd-up"])
        return _stacks()[name]

    monkeypatch.setattr(multiturn, "ROOT", tmp_path)
    monkeypatch.setattr(multiturn, "OUT", tmp_path / "out")
    monkeypatch.setattr(multiturn, "need_stack", lambda command: None)
    monkeypatch.setattr(multiturn, "bench_model", lambda: model)
    monkeypatch.setattr(multiturn, "_stack", stack)
    return calls


def test_a_pool_that_p_refuses_reruns_kvxfer_without_it_and_says_so(no_stack, tmp_path, capsys):
    assert main(["bench", "serve", "--multi-turn", "--json"]) == 0
    out = capsys.readouterr()
    half_staging = 256 * 2 * 64 * 2 * 2 * 128 * 4 // 2  # 256 blocks x all layers' bytes / 2
    assert no_stack == [("kvxfer", str(half_staging)), ("kvxfer", None),
                        ("tpu_inference", None), ("colocated", None)]
    assert "refused host_pool_bytes" in out.err and f"pool of {half_staging} bytes" in out.err
    lines = out.out.splitlines()
    assert any(line.startswith("fits: 3 conversations") for line in lines)
    result = json.loads(lines[-1])
    assert result["pool"] is False and result["ok"] is True
    assert result["fits"]["kvxfer_over_colocated"] == 2.0
    assert result["pressure"]["recompute_fraction"] == 0.5
    assert result["cache_blocks"] == 40 and 0 < float(result["pd_memory"]) < 0.001
    assert json.loads((tmp_path / "out" / "multiturn.json").read_text())["pool"] is False


def test_a_start_failure_that_is_not_the_pools_is_not_hidden(no_stack, tmp_path, monkeypatch):
    def fails(name, how, settings):
        raise subprocess.CalledProcessError(1, ["bash", "scripts/pd-up"])

    monkeypatch.setattr(multiturn, "_stack", fails)
    with pytest.raises(subprocess.CalledProcessError):
        multiturn.run()


def test_the_fleet_summary_compares_prefix_routing_with_local_prefill_to_the_other_policies(capsys):
    from kvxfer.bench import fleet

    def policy(later_ttft, held, again):
        first = {"ttft_ms": [9000.0], "held_tokens": 0, "recomputed_tokens": 0}
        return {"turns": [first] + [{"ttft_ms": [later_ttft], "held_tokens": held,
                                     "recomputed_tokens": again}] * 3}

    out = fleet.summary({"round_robin": policy(400.0, 100, 80), "prefix": policy(300.0, 100, 0),
                         "prefix_peer": policy(150.0, 100, 0),
                         "prefix_local": policy(100.0, 100, 5), "cache_aware": policy(200.0, 0, 0)})
    assert out["prefix_over_cache_aware"] == 0.5 and out["prefix_over_round_robin"] == 0.25
    assert out["peer_over_prefix"] == 0.5
    assert out["recompute_fraction"] == 0.05
    assert out["p50_ttft_ms_later_turns"]["prefix"] == 300.0
    assert main(["bench", "serve", "--fleet"]) == 2
    assert "--fleet is an option of `kvxfer bench serve --multi-turn`" in capsys.readouterr().err
