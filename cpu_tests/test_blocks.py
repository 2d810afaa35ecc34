"""Block arithmetic: ranges, kernel mapping, DCP placement, coalescing."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvxfer import InvalidInputError
from kvxfer.plan.blocks import (
    block_range,
    cdiv,
    coalesce,
    coalesce_pairs,
    dcp_location,
    kernel_placement,
    kernel_ratio,
    table_entries,
    to_kernel_ids,
    to_logical_ids,
)


def test_block_range_includes_partly_covered_blocks():
    assert block_range(24, 40, 16) == range(1, 3)
    assert block_range(0, 16, 16) == range(0, 1)
    assert block_range(16, 16, 16) == range(0)
    assert cdiv(33, 16) == 3 and cdiv(32, 16) == 2 and cdiv(0, 16) == 0


def test_logical_block_maps_to_its_kernel_blocks():
    r = kernel_ratio(128, 64)
    assert r == 2
    assert to_kernel_ids([3, 0, 7], r) == [6, 7, 0, 1, 14, 15]
    assert to_logical_ids([7, 6, 15, 1], r) == [3, 7, 0]


def test_a_placed_logical_block_is_its_kernel_blocks_at_its_kernel_positions():
    # Entries 1 and 4 of a table hold logical blocks 7 and 3; r = 2.
    assert kernel_placement([(1, 7), (4, 3)], 2) == [(2, 14), (3, 15), (8, 6), (9, 7)]
    assert kernel_placement([(0, 5)], 1) == [(0, 5)]


def test_table_entries_refuse_positions_past_the_table_or_on_the_null_block():
    assert table_entries([2, 0], [4, 9, 6]) == [(2, 6), (0, 4)]
    with pytest.raises(InvalidInputError, match="entry 3 is past the table's 3 entries"):
        table_entries([3], [4, 9, 6])
    with pytest.raises(InvalidInputError, match="entry 1 holds the null block"):
        table_entries([1], [4, 0, 6])


def test_kernel_ratio_rejects_non_multiple():
    with pytest.raises(InvalidInputError, match="100.*64"):
        kernel_ratio(100, 64)


@given(st.integers(0, 10_000), st.sampled_from([8, 16, 64]), st.sampled_from([1, 2, 4, 8]))
def test_dcp_with_interleave_equal_block_gives_each_rank_one_contiguous_slice(pos, block, world):
    entry, rank, local = dcp_location(pos, block, world, interleave=block)
    span = block * world
    assert entry == pos // span
    # Rank r holds tokens [entry*V + r*B, entry*V + (r+1)*B).
    assert entry * span + rank * block + local == pos
    assert 0 <= local < block


def test_dcp_interleave_one_round_robins_tokens():
    # I = 1, W = 2, B = 4: tokens alternate ranks.
    assert [dcp_location(p, 4, 2, 1)[1:] for p in range(6)] == [
        (0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)]


def test_coalesce_makes_runs_in_given_order():
    assert coalesce([3, 4, 5, 9, 10, 2]) == [(3, 3), (9, 2), (2, 1)]
    assert coalesce([]) == []
    assert coalesce_pairs([1, 2, 3, 7], [10, 11, 20, 21]) == [(1, 10, 2), (3, 20, 1), (7, 21, 1)]
    with pytest.raises(InvalidInputError, match="3 != 2"):
        coalesce_pairs([1, 2, 3], [1, 2])


@given(st.lists(st.integers(0, 50), max_size=40))
def test_coalesced_runs_expand_back_to_the_ids(ids):
    assert [i for first, n in coalesce(ids) for i in range(first, first + n)] == ids


def test_negative_ids_are_rejected():
    with pytest.raises(InvalidInputError, match="-1"):
        to_kernel_ids([-1], 2)
    with pytest.raises(InvalidInputError, match="-4"):
        block_range(-4, 3, 16)
