"""`kvxfer.bench.traces`: the phase table and timeline of `kvxfer bench e2e --trace`."""

import pytest

from kvxfer import cli
from kvxfer.bench.traces import table, timeline
from kvxfer.stats import Recorder, Trace


def _pair():
    """P's and D's traces of one request, D's started 5 ms after P's."""
    p = Trace("r", "P", "r", "P0", "D0", started=100.0, _t0=0.0)
    p.phase("gather", 0.0, 0.010)
    p.phase("staged", 0.010, 0.030)
    d = Trace("r-d", "D", "r", "P0", "D0", started=100.005, _t0=0.0)
    for name, start, end in (("connect", 0.0, 0.001), ("read", 0.001, 0.020),
                             ("ack", 0.020, 0.024), ("scatter", 0.024, 0.030)):
        d.phase(name, start, end)
    rec = Recorder()
    for t in (p, d):
        rec.finish(t)
    return [t.to_dict() for t in (p, d)]


def test_table_lists_each_sides_phases_on_the_requests_clock():
    lines = table(_pair())
    rows = [line.split() for line in lines[1:]]
    assert [(r[1], r[2]) for r in rows[:6]] == [("P", "gather"), ("P", "staged"),
                                                ("D", "connect"), ("D", "read"),
                                                ("D", "ack"), ("D", "scatter")]
    assert float(rows[0][3]) == 0.0 and float(rows[2][3]) == pytest.approx(5.0)  # ms
    assert float(rows[3][4]) == pytest.approx(19.0)
    assert all(r[0] == "r" for r in rows)  # grouped by P's request id


def test_timeline_writes_a_png_where_matplotlib_is_installed(tmp_path):
    pytest.importorskip("matplotlib")
    path = timeline(_pair(), str(tmp_path / "t.png"))
    assert path and open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv", [["bench", "plan", "--trace", "2"],
                                  ["bench", "e2e", "--trace", "2", "--no-stats"],
                                  ["bench", "e2e", "--trace", "-1"]])
def test_trace_flags_are_refused_where_they_do_not_apply(argv, capsys):
    assert cli.main(argv) == 2
    assert "--trace" in capsys.readouterr().err
