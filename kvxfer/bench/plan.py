"""`kvxfer bench plan`: the cost of `SaveTracker.plan()` per request-step.

256 requests in mid-prefill, once with block tables of 8 blocks and once of
8,192, the same tokens scheduled each step. The plan touches only the blocks
it copies, so the long tables must cost about the same as the short ones.
"""

from __future__ import annotations

import time

from kvxfer.plan.save_plan import GroupSpec, SaveTracker, ScheduledRequest

__all__ = ["run"]

_BLOCK = 16


def _time_plan(table_blocks: int, requests: int, steps: int) -> float:
    """Microseconds of plan() per request-step with tables of `table_blocks` blocks."""
    tracker = SaveTracker([GroupSpec(_BLOCK)])
    ids = iter(range(1, 1 << 40))
    # Mid-prefill: the table is full up to a block ending 8 tokens into its last block.
    start = (table_blocks - 2) * _BLOCK + _BLOCK // 2
    first = []
    for r in range(requests):
        req_id = f"r{r}"
        tracker.add(req_id, 1 << 40)
        table = [next(ids) for _ in range(table_blocks)]
        first.append(ScheduledRequest(req_id, start, _BLOCK, (table,), full_table=True))
    tracker.plan(first)
    # Each later step writes one block's worth of tokens and appends one block.
    schedule = [
        [
            ScheduledRequest(f"r{r}", start + k * _BLOCK, _BLOCK, ([next(ids)],))
            for r in range(requests)
        ]
        for k in range(1, steps + 1)
    ]
    t0 = time.perf_counter()
    for step in schedule:
        tracker.plan(step)
    return (time.perf_counter() - t0) * 1e6 / (steps * requests)


def run(requests: int = 256, steps: int = 50, short_blocks: int = 8,
        long_blocks: int = 8192, repeats: int = 5) -> dict[str, float]:
    """Best-of-`repeats` microseconds per request-step for short and long tables."""
    short = min(_time_plan(short_blocks, requests, steps) for _ in range(repeats))
    long = min(_time_plan(long_blocks, requests, steps) for _ in range(repeats))
    return {
        "plan_us_short": round(short, 3),
        "plan_us_long": round(long, 3),
        "long_over_short": round(long / short, 3),
    }
