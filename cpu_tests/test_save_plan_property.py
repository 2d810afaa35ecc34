"""Property: over random schedules, every prompt token reaches the host current.

A simulated engine writes token-stamped KV into a simulated device cache and
copies each step's planned blocks to a simulated host buffer. At the step
that completes a request's prefill, every prompt token on the host must equal
the device; no block may be copied before anything in it was written, nor
copied twice without a write in between.
"""

from hypothesis import HealthCheck, given, settings
from procs.schedules import play, workloads

from kvxfer.plan.save_plan import SaveTracker
from kvxfer.plan.simulate import SimEngine


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

    play(engine, events, step, tracker.abort)
    assert len(tracker) == 0
