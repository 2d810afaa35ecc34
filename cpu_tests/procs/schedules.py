"""Random schedules for the save-plan properties: KV cache group sets, prompts with prefix
hits, and events (steps of a token budget, preemptions, aborts) for `kvxfer.plan.simulate`."""

import math

from hypothesis import strategies as st

from kvxfer.plan.save_plan import GroupSpec

GROUP_SETS = [
    (GroupSpec(16),),
    (GroupSpec(16, dcp_size=2),),
    (GroupSpec(16), GroupSpec(32, kind="sliding_window", sliding_window=48)),
    (GroupSpec(16), GroupSpec(64, kind="mamba")),
    (
        GroupSpec(16, dcp_size=4),
        GroupSpec(8, kind="sliding_window", sliding_window=20, dcp_size=4),
        GroupSpec(32, kind="mamba", dcp_size=4),
    ),
]


@st.composite
def workloads(draw):
    groups = draw(st.sampled_from(GROUP_SETS))
    unit = math.lcm(*(g.tokens_per_block for g in groups))
    prompts = draw(st.lists(st.integers(1, 400), min_size=1, max_size=5))
    cached = [draw(st.integers(0, (p - 1) // unit)) * unit for p in prompts]
    events = draw(st.lists(
        st.tuples(st.integers(1, 160), st.sampled_from(["step"] * 6 + ["preempt", "abort"]),
                  st.integers(0, 4)),
        min_size=1, max_size=60,
    ))
    return groups, prompts, cached, draw(st.integers(0, 7)), events


def play(engine, events, step, abort):
    """Run `events` on `engine`: `step(budget)`, preempt a live request, or `abort(req_id)` it
    (then drop it); then step until every request is done."""
    for budget, kind, pick in events:
        live = sorted(engine.requests)
        if not live:
            break
        victim = live[pick % len(live)]
        if kind == "preempt":
            engine.preempt(victim)
        elif kind == "abort":
            abort(victim)
            engine.drop(victim)
        else:
            step(budget)
    while engine.requests:
        step(97)
