"""`kvxfer plan`, `kvxfer bench plan` and bad `kvxfer demo` flags, through the real entry point."""

import json
import subprocess
import sys

import numpy as np
import pytest

from kvxfer.cli import main, plan_report


def kvxfer(*args):
    return subprocess.run([sys.executable, "-m", "kvxfer.cli", *args],
                          capture_output=True, text=True, timeout=120)


def test_plan_shows_straddling_block_copied_in_both_steps():
    out = kvxfer("plan", "--prompt", "40", "--budget", "24", "--block-size", "16")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "step 1: writes tokens 0-23 | kvxfer copies b0 b1 | new-blocks rule copies b0 b1" in lines
    assert "step 2: writes tokens 24-39 | kvxfer copies b1 b2 | new-blocks rule copies b2" in lines
    assert "kvxfer: all 40 prompt tokens current on D" in lines
    assert "new-blocks rule: 8 prompt tokens stale on D: tokens 24-31 (in b1)" in lines


def test_plan_reports_old_rule_copying_lookahead_block():
    lines, ok = plan_report(40, 30, 16, lookahead=3)
    assert ok
    assert "new-blocks rule copied unwritten lookahead blocks: step 1: b2" in lines
    assert "new-blocks rule: 10 prompt tokens stale on D: tokens 30-39 (in b1 b2)" in lines


def test_plan_with_prefix_hit_and_dcp_keeps_d_current():
    lines, ok = plan_report(110, 64, 16, cached=32)
    assert ok and lines[1].endswith("kvxfer copies b0 b1 b2 b3 b4 b5 | new-blocks rule copies "
                                    "b0 b1 b2 b3 b4 b5")
    lines, ok = plan_report(100, 24, 16, dcp=2)
    assert ok and "32 tokens per block id" in lines[0]


def test_plan_bad_argument_is_a_clear_error(capsys):
    assert main(["plan", "--prompt", "40", "--budget", "0", "--block-size", "16"]) == 2
    assert "--budget must be positive, got 0" in capsys.readouterr().err
    assert main(["plan", "--prompt", "40", "--budget", "8", "--block-size", "16",
                 "--cached", "5"]) == 2
    assert "cached tokens 5" in capsys.readouterr().err


def test_bench_plan_prints_its_figures_as_json():
    out = kvxfer("bench", "plan", "--json")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert set(result) == {"plan_us_short", "plan_us_long", "long_over_short"}
    assert result["plan_us_short"] > 0 and result["plan_us_long"] > 0


# Bad flags: one `kvxfer: error:` line naming the value, exit 2, no traceback, no process.


@pytest.fixture
def no_processes(monkeypatch):
    """Fail the test if `kvxfer demo` or `kvxfer kvbytes` starts P or D."""
    import kvxfer.demo.procs

    def refuse(*args, **kwargs):
        raise AssertionError("a process was started for a bad flag")

    monkeypatch.setattr(kvxfer.demo.procs, "Proc", refuse)


def _one_error_line(capsys, *names):
    out = capsys.readouterr()
    lines = out.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvxfer: error: "), out.err
    assert "Traceback" not in out.err and out.out == ""
    for name in names:
        assert name in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("flags, names", [
    (["--dtype", "garbage"], ["--dtype", "'garbage'"]),
    (["--layers", "0"], ["--layers", "got 0"]),
    (["--tp-p", "3"], ["--tp-p 3", "does not divide"]),
    (["--tp-d", "16"], ["--tp-d 16"]),
    (["--tp-d", "0"], ["--tp-d", "got 0"]),
    (["--budget", "0"], ["--budget", "got 0"]),
    (["--budget", "-5"], ["--budget", "got -5"]),
    (["--block-size", "0"], ["--block-size", "got 0"]),
    (["--block-size", "1"], ["need 999 blocks", "--num-blocks 256", "raise --num-blocks"]),
    (["--block-size", "48"], ["cached[2] 64", "--block-size 48"]),
    (["--num-blocks", "10"], ["--num-blocks 10", "raise --num-blocks"]),
    (["--layout", "mla", "--dtype", "int8", "--block-size", "2"], ["--block-size 2"]),
])
def test_kvbytes_bad_flag_is_one_error_line_before_any_process_starts(
        no_processes, capsys, flags, names):
    assert main(["kvbytes", *flags]) == 2
    _one_error_line(capsys, *names)


@pytest.mark.parametrize("flags, names", [
    (["--prompts", "40,x"], ["--prompts '40,x'"]),
    (["--prompts", "40,0"], ["--prompts", "[40, 0]"]),
    (["--prompts", "5000"], ["--prompts", "[5000]"]),
    (["--tp-d", "3"], ["--tp-d 3", "use one of [1, 2, 4, 8]"]),
    (["--tp-p", "0"], ["--tp-p 0"]),
    (["--dtype", "float8_e4m3fn"], ["--tp-d 8", "float8_e4m3fn", "use one of [1, 2, 4]"]),
    (["--dtype", "int8"], ["--dtype 'int8'"]),
    (["--budget", "0"], ["--budget", "got 0"]),
    (["--lookahead", "-1"], ["--lookahead", "got -1"]),
    (["--decode-tokens", "0"], ["--decode-tokens", "got 0"]),
    (["--decode-tokens", "300"], ["--decode-tokens 300", "256"]),
    (["--lookahead", "65"], ["--lookahead 65", "64"]),
    (["--seed", "-2"], ["--seed", "got -2"]),
    (["--seed", str(2**64)], ["--seed", str(2**64)]),
    (["--prompts", ",".join(["20"] * 17)], ["--prompts lists 17 prompts"]),
])
def test_demo_bad_flag_is_one_error_line_before_any_process_starts(
        no_processes, capsys, flags, names):
    assert main(["demo", *flags]) == 2
    _one_error_line(capsys, *names)


@pytest.mark.parametrize("flags, names", [
    (["--lookahead", "100000"], ["--lookahead 100000", "need 6253 blocks", "4095"]),
    (["--lookahead", "-1"], ["--lookahead", "got -1"]),
    (["--prompt", "0"], ["--prompt", "got 0"]),
    (["--prompt", "100000000"], ["--prompt 100000000"]),
    (["--block-size", "0"], ["--block-size", "got 0"]),
    (["--dcp", "0"], ["--dcp", "got 0"]),
    (["--cached", "-16"], ["--cached", "got -16"]),
    (["--cached", "48"], ["--cached", "cached tokens 48", "--prompt 40"]),
    (["--cached", "16", "--dcp", "2"], ["32-token blocks", "cached tokens 16"]),
])
def test_plan_bad_flag_is_one_error_line(capsys, flags, names):
    base = {"--prompt": "40", "--budget": "8", "--block-size": "16"}
    for flag, value in zip(flags[::2], flags[1::2]):
        base[flag] = value
    assert main(["plan", *[x for kv in base.items() for x in kv]]) == 2
    _one_error_line(capsys, *names)


def test_plan_lookahead_that_just_fits_the_simulated_pool_runs():
    # cdiv(40 + 65480, 16) = 4095 blocks: the whole pool but the null block.
    lines, ok = plan_report(40, 100000, 16, lookahead=65480)
    assert ok and lines[-1].endswith("b4094")


def test_plan_huge_lookahead_through_the_real_entry_point_has_no_traceback():
    out = kvxfer("plan", "--prompt", "40", "--budget", "8", "--block-size", "16",
                 "--lookahead", "100000")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.startswith("kvxfer: error: --prompt 40 plus --lookahead 100000 need 6253")


def test_kvbytes_non_integer_flag_is_argparse_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        main(["kvbytes", "--layers", "two"])
    assert e.value.code == 2
    assert "invalid int value: 'two'" in capsys.readouterr().err


def test_bench_e2e_small_run_delivers_every_request_and_reports_every_figure():
    from kvxfer.bench.e2e import E2EConfig, run

    cfg = E2EConfig(layers=2, num_blocks=256, requests=4, min_prompt=32, max_prompt=600,
                    latency_requests=2, latency_prompt=256, scatter_blocks=8,
                    scatter_caches=(16, 256), timeout_s=120)
    out = run(cfg)  # raises if D failed to load any request
    assert set(out) >= {"e2e_gbps", "memcpy_gbps", "e2e_over_memcpy", "p50_ms_2k", "p99_ms_2k",
                        "latency_2k_over_memcpy", "scatter_ms_small_cache",
                        "scatter_ms_big_cache", "scatter_growth", "verify_overhead",
                        "d_held_ms_2k"}
    assert out["stream_requests"] == 4
    # Every byte of the stream's prompts reached D: 4 requests of whole 64 KiB blocks.
    rng = np.random.default_rng(cfg.seed)
    prompts = rng.integers(cfg.min_prompt, cfg.max_prompt + 1, cfg.requests)
    blocks = sum(-(-int(p) // cfg.block_size) for p in prompts)
    assert out["stream_gb"] == round(blocks * cfg.layers * 65536 / 1e9, 3)
    assert 0 < out["e2e_over_memcpy"]
    # What verifying adds to D's scatter, as a share of the path: measured, not all of it.
    assert 0 <= out["verify_overhead"] < 1
    assert out["p50_ms_2k"] <= out["p99_ms_2k"]


def test_bench_ttft_small_run_delivers_every_request_both_ways_and_reports_every_figure():
    from kvxfer.bench.ttft import TTFTConfig, run

    cfg = TTFTConfig(layers=2, lengths=[512, 1536], chunk=512, small_blocks=16, forward_ms=5.0,
                     repeats=1, timeout_s=120)
    out = run(cfg)  # raises if D failed to load any request, streamed or by params
    assert set(out["critical_ms"]) == set(out["critical_ms_streaming"]) == {"512", "1536"}
    figures = [*out["critical_ms"].values(), *out["critical_ms_streaming"].values(),
               out["one_chunk_ms"], out["small_request_ms"], out["small_memcpy_ms"]]
    assert all(f > 0 for f in figures)
    # The ratios are of the unrounded times.
    assert out["small_over_memcpy"] == pytest.approx(
        out["small_request_ms"] / out["small_memcpy_ms"], rel=0.05)
    assert out["critical_over_last_chunk"] == pytest.approx(
        out["critical_ms_streaming"]["1536"] / out["one_chunk_ms"], rel=0.05)


def test_bench_multihost_without_namespaces_says_what_is_missing(monkeypatch, capsys):
    import kvxfer.bench.multihost as multihost

    monkeypatch.setattr(multihost, "netns_available", lambda: "network namespaces need root")
    assert main(["bench", "multihost", "--json"]) == 2
    err = capsys.readouterr().err
    assert "bench multihost makes network namespaces as hosts: network namespaces need root" in err


def test_a_bad_host_thread_count_is_refused_by_the_cli_before_any_child_starts(
        monkeypatch, capsys):
    monkeypatch.setenv("KVXFER_HOST_THREADS", "many")
    monkeypatch.setattr("kvxfer.demo.procs.Proc.__init__", lambda *a, **k: pytest.fail(
        "a child process was started"))
    assert main(["demo"]) == 2
    assert "KVXFER_HOST_THREADS must be a positive int, got 'many'" in capsys.readouterr().err


def test_a_bad_backend_is_refused_by_the_cli_before_any_child_starts(monkeypatch, capsys):
    monkeypatch.setenv("KVXFER_BACKEND", "tpu")
    monkeypatch.setattr("kvxfer.demo.procs.Proc.__init__", lambda *a, **k: pytest.fail(
        "a child process was started"))
    assert main(["demo"]) == 2
    assert "KVXFER_BACKEND must be one of ('auto', 'xla', 'numpy'), got 'tpu'" in capsys.readouterr().err


def test_an_unwritable_profile_directory_is_refused_before_any_child_starts(
        monkeypatch, capsys, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    monkeypatch.setenv("KVXFER_PROFILE", str(blocked / "prof"))
    monkeypatch.setattr("kvxfer.demo.procs.Proc.__init__", lambda *a, **k: pytest.fail(
        "a child process was started"))
    assert main(["bench", "e2e", "--json"]) == 2
    assert f"KVXFER_PROFILE={str(blocked / 'prof')!r} is not a writable directory" in \
        capsys.readouterr().err


def test_bench_serve_without_the_serving_environment_says_what_is_missing(monkeypatch, capsys,
                                                                          tmp_path):
    import kvxfer.bench.serve as serve

    monkeypatch.setattr(serve, "ROOT", tmp_path)  # no scripts/pd-up, no .venv-tpu
    assert main(["bench", "serve", "--json"]) == 2
    err = capsys.readouterr().err
    assert "bash scripts/tpu-inference-env" in err and str(tmp_path / "scripts" / "pd-up") in err
