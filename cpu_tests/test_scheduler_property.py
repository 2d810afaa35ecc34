"""Property: over random schedules, every prompt token reaches the host current.

A simulated engine writes token-stamped KV into a simulated device cache and
copies each step's planned blocks to a simulated host buffer. At the step
that completes a request's prefill, every prompt token on the host must equal
the device; no block may be copied before anything in it was written, nor
copied twice without a write in between.
"""

import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxfer.scheduler import GroupSpec, SaveTracker
from kvxfer.simulate import SimEngine

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


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_every_prompt_token_reaches_host_current_over_random_schedules(workload):
    groups, prompts, cached, lookahead, events = workload
    engine = SimEngine(groups, num_blocks=4096, lookahead=lookahead)
    tracker = SaveTracker(groups)
    for i, (prompt, hit) in enumerate(zip(prompts, cached)):
        engine.add(f"r{i}", prompt, hit)
        tracker.add(f"r{i}", prompt)

    def step(budget):
        scheduled = engine.schedule(budget)
        engine.forward(scheduled)
        engine.copy(tracker.plan(scheduled))
        assert engine.violations == []
        for s in scheduled:
            req = engine.requests[s.req_id]
            if req.remaining == 0:
                assert engine.stale_tokens(s.req_id) == {}, s.req_id
                assert s.req_id not in tracker
                engine.drop(s.req_id)

    for budget, kind, pick in events:
        live = sorted(engine.requests)
        if not live:
            break
        victim = live[pick % len(live)]
        if kind == "preempt":
            engine.preempt(victim)
        elif kind == "abort":
            tracker.abort(victim)
            engine.drop(victim)
        else:
            step(budget)
    while engine.requests:
        step(97)
    assert len(tracker) == 0
