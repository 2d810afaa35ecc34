"""Per-request traces (`kvxfer.stats.Trace`, as dicts) as a phase-by-phase table and a
timeline picture: `kvxfer bench e2e --trace N`.

A request's P and D traces are put on one clock by their wall-clock starts
(`started`; the two processes share the machine's clock, or NTP's across
hosts), counted from the earliest phase of the request.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["table", "timeline"]

Traces = Sequence[Mapping[str, Any]]


def _by_request(traces: Traces) -> dict[str, list[Mapping[str, Any]]]:
    """Traces grouped by P's request id (both sides name it), P's first."""
    grouped: dict[str, list[Mapping[str, Any]]] = {}
    for t in traces:
        grouped.setdefault(t.get("p_req_id") or t["req_id"], []).append(t)
    for group in grouped.values():
        group.sort(key=lambda t: t["role"] != "P")
    return grouped


def _rows(group: Sequence[Mapping[str, Any]]) -> list[tuple[str, str, float, float]]:
    """`(role, phase, start, duration)` in seconds from the request's first phase."""
    origin = min(t["started"] + (t["phases"][0][1] if t["phases"] else 0.0) for t in group)
    return [(t["role"], name, t["started"] + start - origin, duration)
            for t in group for name, start, duration in t["phases"]]


def table(traces: Traces) -> list[str]:
    """Lines of a table: per request, each side's phases in order (start and duration in
    ms from the request's first phase), its bytes and outcome."""
    lines = [f"{'request':<14} {'side':<4} {'phase':<8} {'start ms':>9} {'ms':>9}  "]
    for req_id, group in _by_request(traces).items():
        for role, name, start, duration in _rows(group):
            lines.append(f"{req_id:<14} {role:<4} {name:<8} {1e3 * start:9.3f} "
                         f"{1e3 * duration:9.3f}")
        for t in group:
            lines.append(f"{req_id:<14} {t['role']:<4} {'(all)':<8} {'':>9} "
                         f"{1e3 * t['wall']:9.3f}  {t['bytes'] / 2**20:.2f} MiB, "
                         f"{t['outcome']}, {t['p']} -> {t['d']}")
    return lines


def timeline(traces: Traces, path: str) -> str | None:
    """Write a timeline of the requests' phases (one lane per request and side) to `path`
    (PNG); returns `path`, or None where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    grouped = _by_request(traces)
    colors: dict[str, Any] = {}
    palette = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(10, 0.5 + 0.45 * sum(len(g) for g in grouped.values())))
    labels = []
    for req_id, group in grouped.items():
        lanes = {t["role"]: len(labels) + i for i, t in enumerate(group)}
        labels += [f"{req_id} {t['role']}" for t in group]
        for role, name, start, duration in _rows(group):
            color = colors.setdefault(name, palette(len(colors) % 10))
            ax.barh(lanes[role], 1e3 * duration, left=1e3 * start, color=color,
                    label=name if name not in ax.get_legend_handles_labels()[1] else None)
    ax.set_yticks(range(len(labels)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("ms from the request's first phase")
    ax.set_title("kvxfer: phases of each transfer (P and D)")
    ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
