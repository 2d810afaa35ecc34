"""`kvxfer plan` and `kvxfer bench plan`, through the real entry point."""

import json
import subprocess
import sys

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
