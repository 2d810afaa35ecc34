"""`kvxfer bench serve --local-prefill`'s threshold, from canned figures (the run itself needs
`.venv-tpu` and minutes)."""

from __future__ import annotations

from kvxfer.bench import localprefill


def _point(pd_ttft, local_ttft, pd_stall, local_stall):
    return {"pd": {"p50_ttft_ms": pd_ttft, "p50_stall_ms": pd_stall},
            "local": {"p50_ttft_ms": local_ttft, "p50_stall_ms": local_stall}}


def test_the_threshold_is_the_longest_suffix_d_alone_answers_sooner_without_stalling_d_much():
    points = {64: _point(900, 300, 100, 120), 256: _point(1000, 600, 100, 190),
              512: _point(1200, 1100, 100, 250), 768: _point(1300, 1500, 100, 400)}
    assert localprefill.threshold(points) == 256, "512 stalls D 2.5x, 768 answers later"
    points[512] = _point(1200, 1100, 100, 200)
    assert localprefill.threshold(points) == 512


def test_no_suffix_passing_means_no_threshold():
    assert localprefill.threshold({64: _point(300, 400, 100, 100)}) is None
