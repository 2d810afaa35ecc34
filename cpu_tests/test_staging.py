"""Staging: slot runs per request, re-staged blocks replace their copy, errors name values."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.device.staging import Staging
from kvxfer.errors import InvalidInputError, KvxferError, StagingFullError, UnknownRequestError
from kvxfer.plan.blocks import coalesce
from kvxfer.plan.slots import SlotAllocator


def _rows(rng, n, shape=(4, 2), layers=2, dtype=np.float32):
    return [rng.standard_normal((n, *shape)).astype(dtype) for _ in range(layers)]


def test_stage_copies_blocks_and_lookup_finds_them():
    rng = np.random.default_rng(0)
    s = Staging(num_layers=2, num_slots=16, block_shape=(4, 2), dtype=np.float32)
    ids = [9, 3, 7]
    rows = _rows(rng, 3)
    slots = s.stage("r1", ids, rows)
    for layer in range(2):
        np.testing.assert_array_equal(s.rows(layer, s.slots("r1", ids)), rows[layer])
    assert s.slot("r1", 3) == slots[1]
    assert s.blocks("r1") == ids


def test_request_gets_one_contiguous_run_whatever_its_block_ids():
    s = Staging(1, 64, (8,), np.uint8)
    s.stage("a", [5], [np.zeros((1, 8), np.uint8)])
    slots = s.assign("b", [40, 2, 33, 17, 8])
    assert coalesce(slots) == [(slots[0], 5)]


def test_reserved_run_stays_contiguous_across_chunks():
    s = Staging(1, 64, (8,), np.uint8)
    s.reserve("a", 4)
    s.assign("b", [1, 2])  # another request allocates between a's chunks
    first = s.assign("a", [30, 12])
    second = s.assign("a", [12, 50, 7])  # 12 re-staged, 50 and 7 new
    all_slots = s.slots("a", [30, 12, 50, 7])
    assert coalesce(all_slots) == [(all_slots[0], 4)]
    assert second[0] == first[1]


def test_restaged_block_replaces_its_earlier_copy_in_the_same_slot():
    s = Staging(1, 8, (2,), np.int32)
    s.stage("r", [4, 5], [np.array([[1, 1], [2, 2]], np.int32)])
    slot5 = s.slot("r", 5)
    s.stage("r", [5, 6], [np.array([[3, 3], [4, 4]], np.int32)])
    assert s.slot("r", 5) == slot5
    np.testing.assert_array_equal(s.rows(0, s.slots("r", [4, 5, 6])), [[1, 1], [3, 3], [4, 4]])


def test_free_returns_slots_and_forgets_the_request():
    s = Staging(1, 4, (2,), np.uint8)
    s.assign("r", [0, 1, 2, 3])
    assert s.num_free_slots == 0
    s.free("r")
    assert s.num_free_slots == 4 and "r" not in s
    assert coalesce(s.assign("q", [9, 8, 7, 6])) == [(0, 4)]


def test_out_of_space_names_request_and_counts():
    s = Staging(1, 4, (2,), np.uint8)
    s.assign("a", [1, 2, 3])
    with pytest.raises(StagingFullError, match=r"'b'.*need 2 .*only 1 free"):
        s.assign("b", [7, 8])
    assert "b" not in s and s.num_free_slots == 1


def test_unknown_request_and_block_raise_named_errors():
    s = Staging(1, 4, (2,), np.uint8)
    with pytest.raises(UnknownRequestError, match="'nope'"):
        s.slot("nope", 1)
    s.assign("r", [1])
    with pytest.raises(UnknownRequestError, match=r"\[2\]"):
        s.slots("r", [1, 2])
    with pytest.raises(KvxferError):
        s.free("nope")


def test_rejects_rows_of_wrong_shape_or_layer_count():
    s = Staging(2, 4, (2,), np.uint8)
    with pytest.raises(InvalidInputError, match="1 layers"):
        s.stage("r", [1], [np.zeros((1, 2), np.uint8)])
    with pytest.raises(InvalidInputError, match=r"\(1, 3\)"):
        s.stage("r", [1], [np.zeros((1, 3), np.uint8)] * 2)


def test_mirror_placement_uses_block_id_as_slot():
    s = Staging(1, 16, (2,), np.uint8, placement="mirror")
    assert s.assign("r", [9, 3]) == [9, 3]
    with pytest.raises(InvalidInputError, match="16"):
        s.assign("r", [16])


def test_regions_are_page_aligned():
    s = Staging(3, 5, (7,), np.uint8)
    assert all(addr % 4096 == 0 for addr, _ in s.region_addresses())
    assert [n for _, n in s.region_addresses()] == [35] * 3


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 6)), max_size=40))
def test_allocator_never_hands_out_a_slot_twice(ops):
    alloc = SlotAllocator(32)
    held: list[list[tuple[int, int]]] = []
    for do_alloc, n in ops:
        if do_alloc:
            try:
                held.append(alloc.allocate(n))
            except StagingFullError:
                assert n > alloc.num_free
        elif held:
            for start, length in held.pop(n % len(held)):
                alloc.release(start, length)
        used = [s for runs in held for start, length in runs for s in range(start, start + length)]
        assert len(used) == len(set(used)) and all(0 <= s < 32 for s in used)
        assert alloc.num_free + len(used) == 32


@pytest.mark.parametrize("keys", [[-1], [2, "3"], [1.0], [True]])
@pytest.mark.parametrize("placement", ["runs", "mirror"])
def test_a_slot_map_refuses_keys_that_are_not_non_negative_ints(keys, placement):
    from kvxfer.plan.slots import SlotMap

    slots = SlotMap(8, placement)
    with pytest.raises(InvalidInputError, match="staging keys must be non-negative ints"):
        slots.assign("r", keys)
    assert "r" not in slots and slots.num_free_slots == 8


def test_staging_larger_than_the_machine_is_refused_naming_the_setting():
    with pytest.raises(InvalidInputError, match=r"needs .* GiB, more than this machine's .* "
                                                r"lower staging_blocks"):
        Staging(80, 10**12, (16, 8, 2, 128), np.uint16)


@pytest.mark.parametrize("shape", [(0, 8), (-1, 8), (2.5, 8), (), "ab", (True, 8), None])
def test_staging_refuses_a_block_shape_that_is_not_positive_ints_by_name(shape):
    with pytest.raises(InvalidInputError, match="Staging block_shape must be a non-empty sequence "
                                                "of positive ints"):
        Staging(1, 4, shape)


def test_staging_refuses_a_dtype_numpy_does_not_know_by_name():
    with pytest.raises(InvalidInputError, match="Staging dtype must be a numpy dtype"):
        Staging(1, 4, (8,), dtype=object())
