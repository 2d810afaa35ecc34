"""`kvxfer bench serve --equal-hardware`'s figures and ratios, from made-up answers (the
benchmark itself needs the serving stack: `.venv-tpu`, and minutes)."""

import pytest

from kvxfer.bench import equal
from kvxfer.cli import main

UNLOADED = {"ttft_s": 0.1, "tpot_s": 0.05}


def answer(ttft, tpot, tokens=4, turn=0):
    return {"ttft_s": ttft, "tpot_s": tpot, "tokens": list(range(tokens)), "turn": turn}


def test_a_request_meets_the_objectives_only_within_both_and_one_token_has_no_tpot():
    answers = [answer(0.5, 0.1), answer(0.51, 0.1), answer(0.5, 0.11), answer(0.2, None, 1)]
    assert equal.attainment(answers, UNLOADED) == 2


def test_figures_count_failures_later_turns_tokens_and_goodput():
    answers = [answer(0.1, 0.05, turn=0), answer(0.3, 0.05, turn=1), answer(0.9, 0.05, turn=1),
               {"error": "HTTPError: 500", "turn": 1}]
    f = equal.figures(answers, wall=2.0, unloaded=UNLOADED)
    assert (f["requests"], f["failed"]) == (4, 1)
    assert f["ttft_p50_ms"] == 300.0 and f["ttft_p50_later_ms"] == 600.0
    assert f["tokens_per_s"] == 6.0
    assert f["attainment"] == 0.5 and f["goodput"] == 1.0  # two of four met both, in 2 s


def test_ratios_take_kvxfers_best_arm_over_the_best_colocated_one():
    def runs(tpot, ttft, goodput, later):
        return {"8": [{"tpot_p90_ms": tpot, "ttft_p90_ms": ttft, "goodput": goodput,
                       "ttft_p50_later_ms": later}]}

    result = {"arms": {"colocated": {"multi_turn": runs(400, 6000, 1.0, 5000)},
                       "kvxfer": {"multi_turn": runs(300, 9000, 0.5, 9000)},
                       "kvxfer_whole": {"multi_turn": runs(500, 4500, 1.5, 4000)},
                       "kvxfer_adaptive": {"multi_turn": runs(None, None, None, None)}}}
    ratios = equal.summary(result, ("multi_turn",))
    assert ratios["multi_turn"] == {"tpot_p90": 0.75, "ttft_p90": 0.75, "goodput": 1.5,
                                    "ttft_p50_later": 0.8}
    assert ratios["kvxfer_over_tpu"] is None


@pytest.mark.parametrize("argv,named", [
    (["bench", "e2e", "--equal-hardware"], "--equal-hardware"),
    (["bench", "serve", "--equal-hardware", "--multi-turn"], "--equal-hardware"),
    (["bench", "serve", "--equal-hardware", "--repeats", "0"], "--repeats"),
    (["bench", "e2e", "--repeats", "2"], "--repeats"),
    (["bench", "serve", "--workloads", "chat"], "--workloads")])
def test_bad_equal_hardware_options_are_refused_by_name(argv, named, capsys):
    assert main(argv) == 2  # before any stack starts
    assert named in capsys.readouterr().err
