"""Property: over random schedules, what P names final is what D needs, and never changes.

A simulated engine (`kvxfer.plan.simulate`) writes token-stamped KV; P's scheduler
side plans each step of streamed requests. D's view is simulated: each block is
copied to D's host the step P names it final, and only then. When a request's
prefill completes, every prompt token D holds must be the device's newest (a
block named final was never written again), no block is named twice, and no
block named final is copied again by a later step. A preempted or aborted
streamed request is given up (`cancels`), and D recomputes it.
"""

from hypothesis import HealthCheck, given, settings
from procs.schedules import play, workloads

from kvxfer.connector.scheduler import PeerAddress, PrefillScheduler
from kvxfer.nixl.wire import new_stream_id
from kvxfer.plan.simulate import SimEngine


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_blocks_named_final_reach_d_current_once_each_over_random_schedules(workload):
    groups, prompts, cached, lookahead, events = workload
    engine = SimEngine(groups, num_blocks=4096, lookahead=lookahead)
    p = PrefillScheduler(groups, staging_blocks=8192, kernel_ratio=1,
                         address=PeerAddress("P", "127.0.0.1", 1))
    d_host: dict[str, dict] = {}  # per request: what D read, keyed as the engine's host
    final: dict[str, list[set[int]]] = {}  # per request and group: table positions named
    given_up: set[str] = set()
    for i, (prompt, hit) in enumerate(zip(prompts, cached)):
        engine.add(f"r{i}", prompt, hit)
        p.add_request(f"r{i}", prompt, stream=new_stream_id())
        d_host[f"r{i}"], final[f"r{i}"] = {}, [set() for _ in groups]

    def step(budget):
        scheduled = engine.schedule(budget)
        engine.forward(scheduled)
        meta = p.build_connector_meta(scheduled)
        given_up.update(meta.cancels)
        for req_id, placed in meta.blocks.items():
            for g, blocks in enumerate(placed):  # no block named final is copied again
                assert not {pos for pos, _ in blocks} & final[req_id][g], (req_id, g)
        for req_id, keys in meta.final.items():
            ids = []
            for g, (group_keys, placed) in enumerate(zip(keys, meta.blocks[req_id])):
                assert not set(group_keys) & final[req_id][g], (req_id, g, "named twice")
                final[req_id][g].update(group_keys)
                at = dict(placed)
                ids.append([at[k] for k in group_keys])
            engine.copy({req_id: ids}, d_host[req_id])  # D reads them now, and only now
        for req_id in meta.holds:
            assert req_id not in given_up
            assert engine.stale_tokens(req_id, d_host[req_id]) == {}, req_id
            assert p.request_finished(req_id) is not None
            p.release([req_id])  # D read it: P's worker frees it
        for s in scheduled:
            if engine.requests[s.req_id].remaining == 0:
                engine.drop(s.req_id)

    def abort(req_id):
        p.abort(req_id)
        given_up.add(req_id)

    play(engine, events, step, abort)
    p.release(p.held())  # the worker frees what it gave up on, once D let go
    assert p.held() == [] and all(m.num_free_slots == 8192 for m in p.slot_maps)
