"""Property: through the real connectors, D's KV at every in-window prompt position equals P's.

Hypothesis draws a kernel ratio (1 or 2), a sliding window, a prompt length,
its chunking, P's block tables per group (with lookahead entries and null
blocks in front of the window) and how they are handed out step by step,
and D's differently laid out tables (null or not in front of the window).
P (TP 4) and D (TP 2) are NIXL agents in one process; one pair per (ratio,
window) is made once and reused across examples. Before each save step the
kernel blocks holding that chunk's tokens are rewritten on P (a forward
pass), so a block straddling a chunk boundary is only current on D if P
copied it again. After the load, every kernel block of D that holds prompt
tokens the window needs must equal P's block at the same table position,
as bits, in every layer and group, and no staging slot may leak on either side.
"""

import itertools
import os
import sys
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxfer.plan.blocks import cdiv
from kvxfer.plan.save_plan import GroupSpec, ScheduledRequest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from procs.pair import Pair, as_bits, rewrite_blocks  # noqa: E402

pytest.importorskip("nixl_cu12._api", reason="NIXL (nixl-cu12) is not installed")

T = 16  # tokens per logical block, every group
POOL = 64  # logical blocks per group, on each side (id 0 is the null block)
WINDOWS = (16, 40)
LAYERS = 2
REWRITE_IDS = 96 // 8 + 2  # most kernel blocks one chunk touches in one group (96 tokens, ratio 2)
_ids = itertools.count()


def _groups(window):
    return [GroupSpec(T), GroupSpec(T, "sliding_window", sliding_window=window)]


def _first_needed(n, window):
    """The sliding-window group's first table entry D needs for an `n`-token prompt."""
    return max(0, cdiv(n, T) - cdiv(window, T) - 1)


@pytest.fixture(scope="module")
def pairs():
    """`get(ratio, window)`: a P/D pair made on first use and kept for the module."""
    made = {}

    def get(ratio, window):
        if (ratio, window) not in made:
            made[(ratio, window)] = Pair(
                kernel_ratio=ratio, groups=_groups(window), layers=LAYERS,
                shape=(POOL * ratio, T // ratio, 4, 2, 8), p_devices=(0, 1, 2, 3), d_devices=(4, 5))
        return made[(ratio, window)]

    def discard(ratio, window):  # after a failed example: its state may be anything
        pr = made.pop((ratio, window), None)
        if pr is not None:
            pr.close()

    get.discard = discard
    yield get
    for pr in made.values():
        pr.close()


def _distinct_ids(count):
    return st.lists(st.integers(1, POOL - 1), min_size=count, max_size=count, unique=True)


@st.composite
def cases(draw):
    ratio = draw(st.sampled_from([1, 2]))
    window = draw(st.sampled_from(WINDOWS))
    n = draw(st.integers(1, 160))
    need, first = cdiv(n, T), _first_needed(n, window)
    ends, done = [], 0
    while done < n:
        done = min(n, done + draw(st.integers(1, 96)))
        ends.append(done)
    # P's tables: full attention, then the window with nulls only in front of `first`.
    p_tables = [draw(_distinct_ids(need + draw(st.integers(0, 2))))]
    nulls = draw(st.integers(0, first))
    p_tables.append([0] * nulls + draw(_distinct_ids(need + draw(st.integers(0, 2)) - nulls)))
    # Hand the tables out like vLLM: the whole table so far on the first step, additions after.
    steps, given = [], [0, 0]
    for k, end in enumerate(ends):
        added = []
        for g, table in enumerate(p_tables):
            upto = draw(st.integers(max(cdiv(end, T), given[g]), len(table)))
            added.append(table[given[g]:upto])
            given[g] = upto
        start = ends[k - 1] if k else 0
        steps.append((start, end, tuple(added) if k == 0 or any(added) else None))
    # D's tables: another layout; the window's entries in front of `first` null or not.
    d_tables = [draw(_distinct_ids(need + draw(st.integers(0, 2)))) for _ in p_tables]
    d_tables[1] = [0 if i < first and draw(st.booleans()) else b for i, b in enumerate(d_tables[1])]
    seed = draw(st.integers(0, 2**31 - 1))
    return ratio, window, n, steps, p_tables, d_tables, seed


def _forward(pr, ratio, p_tables, start, end, seed):
    """Overwrite on P every kernel block holding a token of [start, end), in every group."""
    sub = T // ratio
    for g, table in enumerate(p_tables):
        ids = [table[t // T] * ratio + (t % T) // sub for t in range(start, end, sub)]
        ids += [table[(end - 1) // T] * ratio + ((end - 1) % T) // sub]  # the chunk's last one
        ids = sorted({k for k in ids if k >= ratio})  # entries holding the null block: skipped
        if ids:  # padded with a repeat to one length: one compiled scatter per cache shape
            ids += ids[-1:] * (REWRITE_IDS - len(ids))
            pr.p_caches[g] = [rewrite_blocks(c, ids, [seed, start, g, layer])
                              for layer, c in enumerate(pr.p_caches[g])]


def _in_window(n, window, ratio, g, p_table, d_table):
    """`(entry, j, P kernel id, D kernel id)` of every kernel block holding prompt tokens D needs."""
    first = _first_needed(n, window) if g == 1 else 0
    sub = T // ratio
    return [(i, j, p_table[i] * ratio + j, d_table[i] * ratio + j)
            for i in range(first, cdiv(n, T)) for j in range(ratio) if i * T + j * sub < n]


def _free(stagings):
    return all(s.num_free_slots == s.num_slots for s in stagings)


def _assert_d_holds_p(pr, n, window, ratio, p_tables, d_tables):
    for g, (p_table, d_table) in enumerate(zip(p_tables, d_tables)):
        blocks = _in_window(n, window, ratio, g, p_table, d_table)
        p_ids, d_ids = np.array([b[2] for b in blocks]), np.array([b[3] for b in blocks])
        for layer, (p_cache, d_cache) in enumerate(zip(pr.p_caches[g], pr.d_caches[g])):
            same = (as_bits(d_cache)[d_ids] == as_bits(p_cache)[p_ids]).reshape(
                len(blocks), -1).all(axis=1)
            wrong = [b[:2] for b, ok in zip(blocks, same) if not ok]
            assert not wrong, f"group {g} layer {layer}: D differs at (entry, j) {wrong}"


def _assert_nothing_leaks(pr, req_id):
    assert _free(pr.d.stagings) and pr.d.pending() == []
    deadline = time.monotonic() + 10
    while True:
        with pr._lock:
            if req_id in pr.freed:
                assert _free(pr.p.stagings) and pr.p.transport.held() == []
                return
        assert time.monotonic() < deadline, f"P never freed {req_id}"
        time.sleep(0.001)


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=cases())
def test_d_holds_p_kv_at_every_in_window_position(pairs, case):
    ratio, window, n, steps, p_tables, d_tables, seed = case
    pr, req_id = pairs(ratio, window), f"q{next(_ids)}"
    try:
        with pr._lock:  # P's transport is polled from the serve thread after the first example
            pr.p.add_request(req_id, n)
            for start, end, block_ids in steps:
                _forward(pr, ratio, p_tables, start, end, seed)
                pr.save(ScheduledRequest(req_id, start, end - start, block_ids,
                                         full_table=start == 0))
            params = pr.p.request_finished(req_id)
        assert params is not None
        pr.serve()
        assert pr.load(req_id, params, d_tables) == ([req_id], [])
        assert pr.d.get_block_ids_with_load_errors() == set()
    except BaseException:  # the pair may hold anything now: the next example gets a new one
        pairs.discard(ratio, window)
        raise
    # Loaded: P frees the request on D's done whatever the bytes, so a wrong byte keeps the pair.
    _assert_d_holds_p(pr, n, window, ratio, p_tables, d_tables)
    try:
        _assert_nothing_leaks(pr, req_id)
    except BaseException:
        pairs.discard(ratio, window)
        raise
