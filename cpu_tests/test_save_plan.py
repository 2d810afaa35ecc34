"""Save plans: the docs/save-plans.md cases, lifecycle, hybrid groups, DCP, bad input."""

import pytest

from kvxfer import InvalidInputError, KvxferError
from kvxfer.plan.blocks import cdiv
from kvxfer.plan.save_plan import GroupSpec, SaveTracker, ScheduledRequest
from kvxfer.plan.simulate import SimEngine

ATTN = GroupSpec(16)


def run_prefill(prompt, budget, lookahead=0, cached=0, groups=(ATTN,)):
    """Drive one request through a chunked prefill; return each step's plan as table indices."""
    engine = SimEngine(groups, lookahead=lookahead)
    tracker = SaveTracker(groups)
    engine.add("r", prompt, cached)
    tracker.add("r", prompt)
    steps = []
    while engine.requests["r"].remaining > 0:
        scheduled = engine.schedule(budget)
        engine.forward(scheduled)
        plan = tracker.plan(scheduled)
        engine.copy(plan)
        tables = engine.requests["r"].tables
        steps.append([[tables[g].index(b) for b in ids] for g, ids in enumerate(plan["r"])])
    assert engine.stale_tokens("r") == {}
    assert engine.violations == []
    assert "r" not in tracker
    return steps


# -- the four cases of docs/save-plans.md -------------------------------------------


def test_resaves_block_straddling_chunk_boundary():
    assert run_prefill(40, 24) == [[[0, 1]], [[1, 2]]]


def test_saves_last_chunk_that_allocates_no_block():
    assert run_prefill(20, 18) == [[[0, 1]], [[1]]]


def test_never_copies_unwritten_lookahead_block():
    assert run_prefill(40, 30, lookahead=3) == [[[0, 1]], [[1, 2]]]


def test_first_chunk_after_prefix_hit_copies_cached_blocks():
    assert run_prefill(110, 64, cached=32) == [[[0, 1, 2, 3, 4, 5]], [[6]]]


# -- the API directly ----------------------------------------------------------------


def test_plan_uses_engine_block_ids_in_table_order():
    tracker = SaveTracker([ATTN])
    tracker.add("r", 40)
    assert tracker.plan([ScheduledRequest("r", 0, 24, ([7, 3],), full_table=True)]) == {
        "r": ([7, 3],)
    }
    assert tracker.plan([ScheduledRequest("r", 24, 16, ([9],))]) == {"r": ([3, 9],)}


def test_untracked_requests_are_ignored():
    tracker = SaveTracker([ATTN])
    tracker.add("r", 40)
    plan = tracker.plan([
        ScheduledRequest("other", 0, 24, ([1, 2],), full_table=True),
        ScheduledRequest("r", 0, 16, ([5],), full_table=True),
    ])
    assert plan == {"r": ([5],)}


def test_completing_request_is_planned_then_dropped():
    tracker = SaveTracker([ATTN])
    tracker.add("r", 20)
    assert len(tracker) == 1
    plan = tracker.plan([ScheduledRequest("r", 0, 20, ([1, 2],), full_table=True)])
    assert plan == {"r": ([1, 2],)}
    assert "r" not in tracker and len(tracker) == 0
    assert tracker.plan([ScheduledRequest("r", 20, 1, None)]) == {}


def test_decode_tokens_past_prompt_are_not_saved():
    tracker = SaveTracker([ATTN])
    tracker.add("r", 20)
    tracker.plan([ScheduledRequest("r", 0, 16, ([1],), full_table=True)])
    # 16 + 24 scheduled, but only the prompt's tokens 16-19 count; b1 is the last.
    plan = tracker.plan([ScheduledRequest("r", 16, 24, ([2, 3],))])
    assert plan == {"r": ([2],)}


def test_finish_and_abort_drop_state_and_ignore_unknown_ids():
    tracker = SaveTracker([ATTN])
    tracker.add("a", 100)
    tracker.add("b", 100)
    tracker.plan([ScheduledRequest("a", 0, 16, ([1],), full_table=True)])
    tracker.finish("a")
    tracker.abort("b")
    tracker.finish("nope")
    tracker.abort("nope")
    assert len(tracker) == 0
    assert tracker.plan([ScheduledRequest("a", 16, 16, ([2],))]) == {}


def test_resumed_request_replaces_table_and_restarts_from_token_zero():
    tracker = SaveTracker([ATTN])
    tracker.add("r", 64)
    assert tracker.plan([ScheduledRequest("r", 0, 24, ([1, 2],), full_table=True)]) == {
        "r": ([1, 2],)
    }
    # Preempted, then rescheduled with a new table: everything is copied again.
    plan = tracker.plan([ScheduledRequest("r", 0, 40, ([8, 9, 10],), full_table=True)])
    assert plan == {"r": ([8, 9, 10],)}


def test_preempt_then_resume_leaves_nothing_stale():
    engine, tracker = SimEngine([ATTN]), SaveTracker([ATTN])
    engine.add("r", 70)
    tracker.add("r", 70)
    for _ in range(2):
        s = engine.schedule(24)
        engine.forward(s)
        engine.copy(tracker.plan(s))
    engine.preempt("r")
    while engine.requests["r"].remaining:
        s = engine.schedule(24)
        assert s[0].full_table or s[0].num_computed_tokens > 0
        engine.forward(s)
        engine.copy(tracker.plan(s))
    assert engine.stale_tokens("r") == {}
    assert engine.violations == []


def test_requests_sharing_a_step_budget_are_planned_independently():
    engine, tracker = SimEngine([ATTN]), SaveTracker([ATTN])
    for req_id, n in (("a", 30), ("b", 45), ("c", 17)):
        engine.add(req_id, n)
        tracker.add(req_id, n)
    done = set()
    while len(done) < 3:
        s = engine.schedule(20)
        engine.forward(s)
        plan = tracker.plan(s)
        assert set(plan) == {x.req_id for x in s}
        engine.copy(plan)
        for x in s:
            if x.num_computed_tokens + x.num_scheduled_tokens >= engine.requests[x.req_id].num_prompt_tokens:
                assert engine.stale_tokens(x.req_id) == {}
                done.add(x.req_id)
    assert engine.violations == [] and len(tracker) == 0


def test_null_block_is_never_copied():
    sw = GroupSpec(16, kind="sliding_window", sliding_window=16)
    tracker = SaveTracker([ATTN, sw])
    tracker.add("r", 64)
    # A sliding-window table with null placeholders for blocks it dropped.
    plan = tracker.plan([ScheduledRequest("r", 0, 64, ([1, 2, 3, 4], [0, 0, 7, 8]),
                                          full_table=True)])
    assert plan == {"r": ([1, 2, 3, 4], [7, 8])}


# -- hybrid groups and DCP ---------------------------------------------------------------


def test_sliding_window_skips_blocks_outside_final_window():
    sw = GroupSpec(16, kind="sliding_window", sliding_window=32)
    tracker = SaveTracker([sw])
    tracker.add("r", 160)  # 10 blocks; D needs the last cdiv(32, 16) + 1 = 3
    plan = tracker.plan([ScheduledRequest("r", 0, 160, (list(range(1, 11)),),
                                          full_table=True)])
    assert plan == {"r": ([8, 9, 10],)}


def test_mamba_copies_final_state_block_only_on_completing_step():
    mamba = GroupSpec(64, kind="mamba")
    tracker = SaveTracker([ATTN, mamba])
    tracker.add("r", 100)
    p1 = tracker.plan([ScheduledRequest("r", 0, 48, ([1, 2, 3], [50]), full_table=True)])
    assert p1 == {"r": ([1, 2, 3], [])}
    p2 = tracker.plan([ScheduledRequest("r", 48, 52, ([4, 5, 6, 7], [51]))])
    # The state after token 99 lives in the block for positions 64-127: id 51.
    assert p2 == {"r": ([4, 5, 6, 7], [51])}


def test_hybrid_groups_with_different_block_sizes_leave_nothing_stale():
    groups = (
        GroupSpec(16),
        GroupSpec(32, kind="sliding_window", sliding_window=40),
        GroupSpec(128, kind="mamba"),
    )
    for prompt, budget, lookahead in ((300, 48, 0), (300, 100, 5), (129, 64, 2)):
        steps = run_prefill(prompt, budget, lookahead=lookahead, groups=groups)
        assert all(not s[2] for s in steps[:-1]) and steps[-1][2]


@pytest.mark.parametrize("dcp", [2, 4])
def test_dcp_scales_attention_groups_only(dcp):
    attn = GroupSpec(16, dcp_size=dcp)
    mamba = GroupSpec(16, kind="mamba", dcp_size=dcp)
    sw = GroupSpec(16, kind="sliding_window", sliding_window=16, dcp_size=dcp)
    assert attn.tokens_per_block == 16 * dcp
    assert sw.tokens_per_block == 16 * dcp
    assert mamba.tokens_per_block == 16
    tracker = SaveTracker([attn])
    tracker.add("r", 100)
    step1 = tracker.plan([ScheduledRequest("r", 0, 40, ([1, 2, 3, 4][: cdiv(40, 16 * dcp)],),
                                           full_table=True)])
    # 40 tokens at 16 * dcp tokens per id: dcp 2 -> ids 0-1, dcp 4 -> id 0.
    assert step1 == ({"r": ([1, 2],)} if dcp == 2 else {"r": ([1],)})


@pytest.mark.parametrize("dcp", [2, 4])
def test_dcp_chunked_prefill_leaves_nothing_stale(dcp):
    groups = (GroupSpec(16, dcp_size=dcp), GroupSpec(16, kind="mamba", dcp_size=dcp))
    run_prefill(200, 24, groups=groups)
    run_prefill(200, 70, lookahead=3, groups=groups)


# -- bad input --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"block_size": 0}, "block_size"),
        ({"block_size": -16}, "-16"),
        ({"block_size": 16, "kind": "cross"}, "'cross'"),
        ({"block_size": 16, "dcp_size": 0}, "dcp_size"),
        ({"block_size": 16, "kind": "sliding_window"}, "sliding_window"),
        ({"block_size": 16, "sliding_window": 64}, "64"),
    ],
)
def test_invalid_group_spec_is_rejected(kwargs, needle):
    with pytest.raises(InvalidInputError, match=needle):
        GroupSpec(**kwargs)


def test_errors_are_value_errors_from_kvxfer():
    assert issubclass(InvalidInputError, ValueError)
    assert issubclass(InvalidInputError, KvxferError)


def tracked(prompt=64):
    tracker = SaveTracker([ATTN, GroupSpec(16, kind="mamba")])
    tracker.add("r", prompt)
    return tracker


@pytest.mark.parametrize(
    "step, needle",
    [
        (ScheduledRequest("r", -1, 16, ([1], [2]), True), "num_computed_tokens.*-1"),
        (ScheduledRequest("r", 0, -5, ([1], [2]), True), "num_scheduled_tokens.*-5"),
        (ScheduledRequest("r", 0, 40, ([1, 2], [3, 4, 5]), True), "group 0 table has 2 blocks"),
        (ScheduledRequest("r", 0, 16, ([1],), True), "1 groups, expected 2"),
        (ScheduledRequest("r", 0, 16, ([-3], [2]), True), "-3"),
        (ScheduledRequest("r", 0, 16, ([1.5], [2]), True), "1.5"),
    ],
)
def test_bad_scheduled_request_is_rejected_and_state_kept(step, needle):
    tracker = tracked()
    with pytest.raises(InvalidInputError, match=needle):
        tracker.plan([step])
    assert "r" in tracker
    # The tracker is untouched: a valid first step still plans from token 0.
    ok = tracker.plan([ScheduledRequest("r", 0, 16, ([1], [2]), True)])
    assert ok == {"r": ([1], [])}


def test_bad_step_in_batch_changes_no_request():
    tracker = tracked()
    tracker.add("s", 64)
    with pytest.raises(InvalidInputError, match="'s'"):
        tracker.plan([
            ScheduledRequest("r", 0, 16, ([1], [2]), True),
            ScheduledRequest("s", 0, 16, ([1],), True),
        ])
    assert tracker.plan([ScheduledRequest("r", 0, 16, ([1], [2]), True)]) == {"r": ([1], [])}


def test_table_too_short_after_appends_is_rejected():
    tracker = SaveTracker([ATTN])
    tracker.add("r", 64)
    tracker.plan([ScheduledRequest("r", 0, 16, ([1],), True)])
    with pytest.raises(InvalidInputError, match="table has 1 blocks"):
        tracker.plan([ScheduledRequest("r", 16, 16, None)])


def test_duplicate_add_and_bad_prompt_are_rejected():
    tracker = SaveTracker([ATTN])
    tracker.add("r", 10)
    with pytest.raises(InvalidInputError, match="'r' is already tracked"):
        tracker.add("r", 10)
    with pytest.raises(InvalidInputError, match="0"):
        tracker.add("z", 0)
    with pytest.raises(InvalidInputError, match="at least one"):
        SaveTracker([])
    with pytest.raises(InvalidInputError, match="appears twice"):
        tracker.plan([ScheduledRequest("r", 0, 5, ([1],), True)] * 2)
