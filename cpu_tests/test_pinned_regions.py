"""P's staging as pinned-host JAX buffers written in place (`kvxfer.device.pinned`), on the XLA
backend selected on CPU: the same bytes and fingerprints as the host copy, every buffer at its
address across saves, and numpy staging wherever that cannot hold."""

import gc
import logging
import os
import sys

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kvxfer.device import pinned
from kvxfer.device.gather import staging_regions
from kvxfer.device.layout import CacheLayout
from kvxfer.device.pieces import Piece, gather_piece_into, piece_shape, piece_staging
from kvxfer.device.pinned import PinnedRegions, pinned_regions
from kvxfer.device.staging import Staging
from kvxfer.errors import InvalidInputError, TransferError
from kvxfer.plan.save_plan import ScheduledRequest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from procs.pair import as_bits, caches_on  # noqa: E402

BF16 = np.dtype(ml_dtypes.bfloat16)
BLOCK = (16, 4, 2, 32)


def _mesh(count):
    return Mesh(np.array(jax.devices()[:count]).reshape(1, count), ("data", "model"))


@pytest.fixture
def xla(monkeypatch):
    monkeypatch.setenv("KVXFER_BACKEND", "xla")


def test_a_gather_into_pinned_staging_writes_the_host_copys_bytes_in_place(xla, monkeypatch):
    caches = caches_on(jax.devices()[:1], seed=3, layers=3)
    layout, piece = CacheLayout.from_caches(caches), Piece.local(caches)
    staging = piece_staging(layout, piece, 24, caches)
    regions = staging.regions
    assert isinstance(regions, PinnedRegions)
    addresses = list(regions.addresses)
    expected = piece_staging(layout, piece, 24)  # numpy, copied on the host
    # Runs of 1, 3, 5 and 7 slots (chunks 1, 2+1, 4+1, 4+2+1), out of order, and a rewrite.
    saves = [([4, 9, 1], [10, 11, 12]), ([30, 2, 8, 17, 5, 0, 21], [3, 4, 5, 6, 7, 8, 9]),
             ([6], [23]), ([12, 13, 14, 15, 16], [18, 19, 20, 21, 22]), ([7, 3], [11, 0])]
    for ids, slots in saves:
        ids, slots = np.array(ids), np.array(slots)
        before = list(regions.arrays)
        gather_piece_into(caches, ids, staging, slots, piece)
        assert all(a.is_deleted() for a in before)  # donated to the write: no host copy ran
        monkeypatch.setenv("KVXFER_BACKEND", "numpy")
        gather_piece_into(caches, ids, expected, slots, piece)
        monkeypatch.setenv("KVXFER_BACKEND", "xla")
        assert np.array_equal(staging.prints[slots], expected.prints[slots])
        for layer in range(3):
            assert np.array_equal(regions[layer].view(np.uint16),
                                  expected.regions[layer].view(np.uint16))
        assert regions.addresses == addresses
        assert [s.data.unsafe_buffer_pointer() for a in regions.arrays
                for s in a.addressable_shards] == addresses
    assert np.array_equal(np.asarray(regions.arrays[2]),
                                              regions[2].view(np.uint16))


def test_pinned_regions_need_one_device_and_a_donation_that_keeps_the_address(xla, monkeypatch,
                                                                               caplog):
    assert pinned_regions(_mesh(4), 2, 8, BLOCK, BF16) is None  # a slot would span 4 buffers

    def copying_write(host, num_layers):  # what a backend that does not alias would do
        def write(regions, rows, at):
            return [jax.device_put(np.array(r), host) for r in regions]
        return write

    monkeypatch.setattr(pinned, "_write_fn", copying_write)
    with caplog.at_level(logging.WARNING, "kvxfer.device.staging"):
        assert pinned_regions(_mesh(1), 2, 8, BLOCK, BF16) is None
    assert "moved" in caplog.text


def test_a_write_that_moves_a_buffer_or_fails_is_refused_by_name_and_every_later_one(xla,
                                                                                monkeypatch):
    caches = caches_on(jax.devices()[:1], seed=4)
    layout, piece = CacheLayout.from_caches(caches), Piece.local(caches)
    shape = piece_shape(layout, piece)
    host = NamedSharding(_mesh(1), PartitionSpec(), memory_kind="pinned_host")
    moving = pinned_regions(_mesh(1), 2, 8, shape, BF16)
    failing = pinned_regions(_mesh(1), 2, 8, shape, BF16)

    def moves(arrays, args, ids, at):
        return [jax.device_put(np.array(a), host) for a in arrays], np.zeros((2, len(ids), 3))

    def fails(arrays, args, ids, at):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of pinned host memory")

    for regions, write, match in ((moving, moves, "moved its buffers"),
                                  (failing, fails, "RESOURCE_EXHAUSTED")):
        staging = Staging(2, 8, shape, BF16, prints_per_layer=piece.count, regions=regions)
        monkeypatch.setattr(pinned, "_take_and_write_fn", lambda *a, w=write: w)
        with pytest.raises(TransferError, match=match):
            gather_piece_into(caches, np.array([1, 2]), staging, np.array([0, 1]), piece)
        monkeypatch.undo()
        monkeypatch.setenv("KVXFER_BACKEND", "xla")
        with pytest.raises(TransferError, match=f"unusable: .*{match}"):  # the views may be stale
            gather_piece_into(caches, np.array([3]), staging, np.array([5]), piece)


def test_a_view_keeps_its_regions_alive():
    """NIXL registers the views: the buffers under them must outlive every other reference
    to the regions, or JAX frees them and reuses the memory (checked: without the view's
    reference its bytes were overwritten here)."""
    regions = pinned_regions(_mesh(1), 2, 8, BLOCK, BF16)
    view = regions[1]
    address = regions.addresses[1]
    pattern = np.arange(view.size, dtype=np.uint16).reshape(view.shape) | 1
    view.view(np.uint16)[...] = pattern
    del regions
    gc.collect()
    host = NamedSharding(_mesh(1), PartitionSpec(), memory_kind="pinned_host")
    others = [jax.device_put(np.full(view.shape, 7, np.uint16), host) for _ in range(8)]
    jax.block_until_ready(others)  # freed memory of the same size would be reused by now
    assert view.ctypes.data == address
    np.testing.assert_array_equal(view.view(np.uint16), pattern)


def test_staging_regions_refuses_a_bad_mesh_or_count_by_name(xla):
    with pytest.raises(InvalidInputError, match="mesh must be a jax.sharding.Mesh, got 'm'"):
        staging_regions("m", 2, 8, BLOCK, BF16)
    with pytest.raises(InvalidInputError, match="num_slots must be a positive int, got -1"):
        staging_regions(_mesh(1), 2, -1, BLOCK, BF16)
    with pytest.raises(InvalidInputError, match="num_layers must be a positive int, got 2.0"):
        staging_regions(_mesh(1), 2.0, 8, BLOCK, BF16)


def test_staging_refuses_regions_of_another_shape_by_name():
    with pytest.raises(InvalidInputError, match=r"regions must be 2 writable"):
        Staging(2, 8, BLOCK, BF16, regions=[np.zeros((8, *BLOCK), BF16)])
    with pytest.raises(InvalidInputError, match=r"\(8, 16, 4, 2, 32\)"):
        Staging(2, 8, BLOCK, BF16, regions=[np.zeros((8, 16, 4, 2, 31), BF16)] * 2)


@pytest.mark.parametrize("d_devices", [(4, 5, 6, 7), (4,)], ids=["d-tp4", "d-pinned-too"])
def test_one_device_p_saves_into_pinned_staging_and_d_receives_every_byte(xla, pair, d_devices):
    pr = pair(p_devices=(0,), d_devices=d_devices)
    assert isinstance(pr.p.staging.regions, PinnedRegions)
    assert isinstance(pr.d.staging.regions, PinnedRegions) == (len(d_devices) == 1)
    addresses, first = list(pr.p.staging.regions.addresses), pr.p.staging.regions.arrays[0]
    pr.p.add_request("r", 56)
    pr.save(ScheduledRequest("r", 0, 24, ([5, 9],), full_table=True))
    pr.save(ScheduledRequest("r", 24, 32, ([12, 2],)))
    params = pr.p.request_finished("r")
    pr.serve()
    assert pr.load("r", params, [20, 21, 22, 23]) == (["r"], [])
    for p_cache, d_cache in zip(pr.p_caches[0], pr.d_caches[0]):
        assert (as_bits(d_cache)[[20, 21, 22, 23]] == as_bits(p_cache)[[5, 9, 12, 2]]).all()
    assert first.is_deleted() and pr.p.staging.regions.addresses == addresses  # written in place
    assert pr.d.get_block_ids_with_load_errors() == set()
