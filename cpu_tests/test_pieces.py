"""Pieces (`kvxfer.device.pieces`) in one process: two "hosts" emulated by giving each half of
the devices' units, P and D cut differently; and the params that name them. What moves
bytes runs on both backends (`KVXFER_BACKEND=numpy`, and `xla`: the jitted programs an
accelerator runs)."""

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kvxfer.device.fingerprint import combine_sums, fmix32
from kvxfer.device.gather import fingerprint_blocks
from kvxfer.device.layout import CacheLayout
from kvxfer.device.pieces import (
    Piece,
    gather_piece_into,
    piece_prints,
    piece_staging,
    process_pieces,
    scatter_piece,
    split_axis,
)
from kvxfer.errors import InvalidInputError, LayoutMismatchError
from kvxfer.nixl.wire import ReadParams

SHAPE = (32, 16, 8, 2, 32)


def caches(mesh_shape, spec, seed=0, zeros=False, shape=SHAPE):
    mesh = Mesh(np.array(jax.devices()).reshape(mesh_shape), ("data", "model"))
    rng = np.random.default_rng(seed)
    import ml_dtypes
    out = []
    for _ in range(2):
        bits = np.zeros(shape, np.uint16) if zeros else rng.integers(0, 1 << 16, shape,
                                                                       dtype=np.uint16)
        out.append(jax.device_put(bits.view(ml_dtypes.bfloat16), NamedSharding(mesh, spec)))
    return out


def bits(cache):
    return np.asarray(cache).view(np.uint16)


def move(p_caches, p_pieces, p_ids, d_caches, d_pieces, d_ids, corrupt=None):
    """P's pieces gathered into their stagings, copied unit range by unit range into D's
    stagings (what the NIXL reads do), scattered; returns D's caches and each D piece's
    (landed sums, expected sums)."""
    layout = CacheLayout.from_caches(p_caches)
    n = len(p_ids)
    p_st = [piece_staging(layout, p, 8) for p in p_pieces]
    for p, st in zip(p_pieces, p_st):
        gather_piece_into(p_caches, p_ids, st, np.arange(n) + 2, p)
    if corrupt is not None:
        p_st[corrupt].regions[1][3].view(np.uint8).reshape(-1)[5] ^= 0x04
    checks = []
    for dp in d_pieces:
        d_st = piece_staging(layout, dp, 8)
        for p, st in zip(p_pieces, p_st):
            span = dp.overlap(p)
            if span:
                a, b = span
                for layer in range(2):
                    d_st.regions[layer][:n, a - dp.lo : b - dp.lo] = \
                        st.regions[layer][2 : 2 + n, a - p.lo : b - p.lo]
                d_st.prints[:n, a - dp.lo : b - dp.lo] = st.prints[2 : 2 + n, a - p.lo : b - p.lo]
        d_caches, landed = scatter_piece(d_caches, d_st, d_ids, np.arange(n), dp)
        checks.append((landed, piece_prints(d_st, np.arange(n)), d_st.prints[:n]))
    return d_caches, checks


def _addresses(caches):
    return [s.data.unsafe_buffer_pointer() for c in caches for s in c.addressable_shards]


def test_pieces_move_blocks_between_different_cuts_byte_exact_and_sums_match(backend):
    p = caches((1, 8), PartitionSpec(None, None, "model"))  # P: TP 8, two hosts of 4 units
    d = caches((2, 4), PartitionSpec(None, None, "model"), zeros=True)  # D: TP 4, 2 + 6 units
    before = bits(d[0]).copy()
    p_ids, d_ids = np.array([5, 3, 4, 20]), np.array([30, 1, 2, 9])
    d, checks = move(p, [Piece(1, 8, 0, 4), Piece(1, 8, 4, 8)], p_ids,
                     d, [Piece(1, 8, 0, 2), Piece(1, 8, 2, 8)], d_ids)
    for layer in range(2):
        assert (bits(d[layer])[d_ids] == bits(p[layer])[p_ids]).all()
    others = np.setdiff1d(np.arange(32), d_ids)
    assert (bits(d[0])[others] == before[others]).all()
    for landed, expected, _ in checks:
        assert (landed == expected).all()
    # The per-unit sums of every piece combine to the whole block's fingerprint.
    total = np.zeros((len(d_ids), 2, 3), np.uint32)
    for _, _, units in checks:
        for u in range(units.shape[1]):
            combine_sums(total, units[:, u])
    assert (fmix32(total.transpose(1, 0, 2)) == np.asarray(fingerprint_blocks(d, d_ids))).all()


def test_a_block_gathered_twice_in_one_save_moves_byte_exact_with_matching_sums(backend):
    """Requests that share a prefix each have their slots, so one save stages a block more
    than once (a scatter's blocks stay distinct)."""
    p = caches((1, 8), PartitionSpec(None, None, "model"), seed=4)
    d = caches((2, 4), PartitionSpec(None, None, "model"), zeros=True)
    p_ids, d_ids = np.array([5, 3, 5, 20, 3]), np.array([30, 1, 2, 9, 11])
    d, checks = move(p, [Piece(1, 8, 0, 4), Piece(1, 8, 4, 8)], p_ids,
                     d, [Piece(1, 8, 0, 2), Piece(1, 8, 2, 8)], d_ids)
    for layer in range(2):
        assert (bits(d[layer])[d_ids] == bits(p[layer])[p_ids]).all()
    for landed, expected, _ in checks:
        assert (landed == expected).all()
    d_st = piece_staging(CacheLayout.from_caches(d), Piece(1, 8, 0, 2), 8)
    with pytest.raises(InvalidInputError, match=r"block ids of one scatter must be distinct, "
                                                r"got \[1, 1\]"):
        scatter_piece(d, d_st, [1, 1], [0, 1], Piece(1, 8, 0, 2))


def test_a_flipped_bit_in_one_piece_changes_only_that_pieces_sums(backend):
    p = caches((1, 8), PartitionSpec(None, None, "model"))
    d = caches((1, 8), PartitionSpec(None, None, "model"), zeros=True)
    halves = [Piece(1, 8, 0, 4), Piece(1, 8, 4, 8)]
    _, checks = move(p, halves, np.array([1, 2, 3, 4]), d, halves, np.array([5, 6, 7, 8]),
                     corrupt=1)
    (landed0, expected0, _), (landed1, expected1, _) = checks
    assert (landed0 == expected0).all()
    # P summed before the flip (slot 3 holds the second block): that block of layer 1
    # differs, nothing else.
    assert (landed1 != expected1).any(axis=2).tolist() == [[False] * 4, [False, True, False, False]]


def test_a_replicated_cache_is_one_whole_piece_per_process():
    mla = caches((1, 8), PartitionSpec(), shape=(32, 16, 1, 64))
    layout = CacheLayout.from_caches(mla)
    assert split_axis(layout) == 0
    assert process_pieces(mla) == {0: Piece(0, 16, 0, 16)}


@pytest.mark.parametrize("backend", ["numpy", "xla"])
def test_tpu_inference_caches_with_a_data_axis_of_one_move_as_pieces(backend, monkeypatch):
    """tpu-inference shards its caches `P('data', None, 'model')`; with a `data` axis of 1 the
    block axis is not cut, so they are pieces like any other (under Ray, on two hosts, they
    were refused)."""
    monkeypatch.setenv("KVXFER_BACKEND", backend)
    spec = PartitionSpec("data", None, "model")
    p_caches = caches((1, 8), spec, seed=3)
    layout = CacheLayout.from_caches(p_caches)
    assert split_axis(layout) == 1
    whole = Piece(1, 8, 0, 8)
    assert process_pieces(p_caches) == {0: whole}
    halves = [Piece(1, 8, 0, 4), Piece(1, 8, 4, 8)]
    d_caches, checks = move(p_caches, halves, [3, 9, 1], caches((1, 8), spec, zeros=True),
                            [whole], [0, 5, 7])
    for p, d in zip(p_caches, d_caches):
        assert (bits(d)[[0, 5, 7]] == bits(p)[[3, 9, 1]]).all()
    for landed, expected, _ in checks:
        assert (np.asarray(landed) == np.asarray(expected)).all()


def test_pieces_refuse_layouts_they_cannot_cut():
    layout = CacheLayout.from_caches(caches((1, 8), PartitionSpec(None, None, "model")))
    with pytest.raises(LayoutMismatchError, match="unit axis"):
        piece_staging(layout, Piece(0, 16, 0, 8), 4)
    with pytest.raises(InvalidInputError, match="lo < hi"):
        Piece(1, 8, 4, 4)


@pytest.mark.parametrize("spec", [PartitionSpec("data", None, "model"),
                                  PartitionSpec(None, "data", "model")], ids=["dp", "dcp"])
def test_caches_split_along_other_axes_too_move_as_one_piece_in_one_process(backend, spec):
    """Data parallel caches (the block axis split over `data`) and DCP ones (the tokens split
    over `data`, heads over `model`) in one process: every block of every unit is this
    process's, so it stages the whole piece, cut along the heads (the last axis the spec
    names), byte for byte with its sums, on both backends."""
    p = caches((2, 4), spec, seed=4)
    (whole,) = process_pieces(p).values()
    assert whole == Piece(1, 8, 0, 8) and split_axis(CacheLayout.from_caches(p)) == 1
    ids = [30, 2, 17, 15]  # blocks of both halves of the block axis
    d_caches, checks = move(p, [whole], ids, caches((2, 4), spec, zeros=True), [whole],
                            [16, 0, 31, 9])
    for a, b in zip(p, d_caches):
        assert (bits(b)[[16, 0, 31, 9]] == bits(a)[ids]).all()
        assert not np.delete(bits(b), [16, 0, 31, 9], axis=0).any()
    for landed, expected, _ in checks:
        assert (np.asarray(landed) == np.asarray(expected)).all()


def test_both_backends_stage_the_same_bytes_and_sums_and_scatter_in_place(monkeypatch):
    """The XLA programs and the host copies agree byte for byte, sums included; both
    scatters keep every shard's buffer (the caches are donated and written in place)."""
    p = caches((2, 4), PartitionSpec(None, None, "model"), seed=3)  # replicas over 'data'
    layout = CacheLayout.from_caches(p)
    piece, ids = Piece(1, 8, 2, 8), np.array([7, 1, 2, 31])
    staged, landed = [], []
    for backend in ("numpy", "xla"):
        monkeypatch.setenv("KVXFER_BACKEND", backend)
        st = piece_staging(layout, piece, 8)
        gather_piece_into(p, ids, st, np.array([6, 0, 1, 3]), piece)
        staged.append((st.regions[0][[6, 0, 1, 3]].view(np.uint16), st.prints[[6, 0, 1, 3]]))
        d = caches((2, 4), PartitionSpec(None, None, "model"), zeros=True)
        before = _addresses(d)
        d, sums = scatter_piece(d, st, np.array([4, 5, 6, 9]), np.array([6, 0, 1, 3]), piece)
        assert _addresses(d) == before, backend
        landed.append(sums)
        for layer in range(2):
            assert (bits(d[layer])[[4, 5, 6, 9]][:, :, 2:] == bits(p[layer])[ids][:, :, 2:]).all()
            assert not bits(d[layer])[[4, 5, 6, 9]][:, :, :2].any()  # another piece's units
    assert (staged[0][0] == staged[1][0]).all() and (staged[0][1] == staged[1][1]).all()
    assert (landed[0] == landed[1]).all()


def test_a_replicated_cache_moves_as_one_piece_on_both_backends(backend):
    mla = caches((1, 8), PartitionSpec(), shape=(32, 16, 1, 64), seed=5)
    layout = CacheLayout.from_caches(mla)
    (whole,) = process_pieces(mla).values()
    st = piece_staging(layout, whole, 4)
    gather_piece_into(mla, [3, 30], st, [1, 2], whole)
    d = caches((1, 8), PartitionSpec(), shape=(32, 16, 1, 64), zeros=True)
    d, landed = scatter_piece(d, st, [0, 4], [1, 2], whole)
    assert (landed == piece_prints(st, [1, 2])).all()
    for got, want in zip(d, mla):
        assert (bits(got)[[0, 4]] == bits(want)[[3, 30]]).all()
        assert all((np.asarray(s.data).view(np.uint16)[[0, 4]] == bits(want)[[3, 30]]).all()
                   for s in got.addressable_shards)  # every replica written


@pytest.mark.parametrize("whole", [Piece(1, 8, 0, 8), Piece(0, 16, 0, 16)])
def test_a_one_device_cache_moves_as_one_whole_piece_cut_along_any_axis(backend, whole):
    """One chip (a single GPU, a one-chip host): nothing splits its blocks, so the whole
    block is the piece, whichever axis names it (tpu_tests cut the heads axis). Its own
    piece cuts the axis the spec names, as the same caches at any TP do."""
    one = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    p = [jax.device_put(c, NamedSharding(one, PartitionSpec(None, None, "model")))
         for c in caches((1, 8), PartitionSpec(), seed=6)]
    d = [jax.device_put(c, NamedSharding(one, PartitionSpec(None, None, "model")))
         for c in caches((1, 8), PartitionSpec(), zeros=True)]
    layout = CacheLayout.from_caches(p)
    assert process_pieces(p) == {0: Piece(1, 8, 0, 8)}
    st = piece_staging(layout, whole, 4)
    gather_piece_into(p, [3, 30, 7], st, [1, 2, 0], whole)
    d, landed = scatter_piece(d, st, [0, 4, 9], [1, 2, 0], whole)
    assert (landed == piece_prints(st, [1, 2, 0])).all()
    for got, want in zip(d, p):
        assert (bits(got)[[0, 4, 9]] == bits(want)[[3, 30, 7]]).all()
    with pytest.raises(LayoutMismatchError, match="across the edge"):  # it holds every unit
        gather_piece_into(p, [3], piece_staging(layout, Piece(1, 8, 0, 4), 4), [0],
                          Piece(1, 8, 0, 4))


def test_a_bad_backend_setting_is_refused_by_name_before_anything_moves(monkeypatch):
    layout = CacheLayout.from_caches(caches((1, 8), PartitionSpec(None, None, "model")))
    piece = process_pieces(caches((1, 8), PartitionSpec(None, None, "model")))[0]
    monkeypatch.setenv("KVXFER_BACKEND", "gpu")
    with pytest.raises(InvalidInputError, match="KVXFER_BACKEND must be one of .* got 'gpu'"):
        piece_staging(layout, piece, 4)


def test_a_call_with_the_wrong_staging_or_slots_is_refused_by_name():
    p = caches((1, 8), PartitionSpec(None, None, "model"))
    layout = CacheLayout.from_caches(p)
    half, other = Piece(1, 8, 0, 4), Piece(1, 8, 4, 6)
    with pytest.raises(LayoutMismatchError, match="staging holds"):
        gather_piece_into(p, [1], piece_staging(layout, half, 4), [0], other)
    tp4 = caches((2, 4), PartitionSpec(None, None, "model"))  # 2 units per shard
    with pytest.raises(LayoutMismatchError, match="across the edge"):
        gather_piece_into(tp4, [1], piece_staging(layout, Piece(1, 8, 0, 3), 4), [0],
                          Piece(1, 8, 0, 3))
    with pytest.raises(InvalidInputError, match="slots must be 1 ints"):
        gather_piece_into(p, [1], piece_staging(layout, half, 4), [4], half)


def params(**extra):
    base = {"peer": "p-0", "instance": "i", "host": "h", "port": 0, "req_id": "r",
            "generation": 1, "secret": "ab" * 16, "groups": [{"keys": [0], "slots": [0]}]}
    return dict(base, **extra)


def test_params_with_sources_round_trip():
    sources = [{"peer": "p-0", "units": [0, 4]}, {"peer": "p-1", "units": [4, 8]}]
    p = ReadParams.parse(params(units=8, sources=sources), 1)
    assert p.peers == ["p-0", "p-1"] and ReadParams.parse(p.to_dict(), 1) == p
    replicas = [{"peer": "p-0", "units": [0, 8]}, {"peer": "p-1", "units": [0, 8]}]
    assert ReadParams.parse(params(units=8, sources=replicas), 1).peers == ["p-0", "p-1"]


@pytest.mark.parametrize("units,sources,match", [
    (8, [{"peer": "a", "units": [0, 4]}], "do not tile"),
    (8, [{"peer": "a", "units": [0, 4]}, {"peer": "b", "units": [2, 8]}], "do not tile"),
    (8, [{"peer": "a", "units": [0, 4]}, {"peer": "a", "units": [4, 8]}], "repeat a peer"),
    (8, [{"peer": "a", "units": [0, 9]}], "within 8 units"),
    (0, [{"peer": "a", "units": [0, 1]}], "'units' must be a positive int"),
    (8, [], "'sources' must be a non-empty list"),
])
def test_params_with_bad_sources_are_refused_by_name(units, sources, match):
    with pytest.raises(InvalidInputError, match=match):
        ReadParams.parse(params(units=units, sources=sources), 1)


@pytest.mark.parametrize("sources,units,match", [
    ([("p-0", 0, 4)], 8, "must be Source entries"),
    ([], 8, "'sources' must be a non-empty list"),
    (["ok"], -1, "'units' must be a positive int"),
    (["half"], 8, "do not tile"),
])
def test_a_prefill_scheduler_refuses_sources_d_would_refuse(sources, units, match):
    from kvxfer.connector.scheduler import PeerAddress, PrefillScheduler
    from kvxfer.nixl.wire import Source
    from kvxfer.plan.save_plan import GroupSpec

    named = {"ok": Source("p-0", 0, 8), "half": Source("p-0", 0, 4)}
    sources = [named.get(x, x) if isinstance(x, str) else x for x in sources]
    with pytest.raises(InvalidInputError, match=match):
        PrefillScheduler([GroupSpec(16)], staging_blocks=8, kernel_ratio=1,
                         address=PeerAddress("p-0", "h", 0), sources=sources, units=units)


def test_scatter_piece_without_sums_writes_the_same_bytes_and_hashes_nothing(backend):
    """D with verify_fingerprints=False: the copy alone."""
    spec = PartitionSpec(None, None, "model")
    src = caches((1, 8), spec, seed=7)
    layout = CacheLayout.from_caches(src)
    whole = Piece(1, 8, 0, 8)
    st = piece_staging(layout, whole, 8)
    gather_piece_into(src, np.array([3, 9, 4]), st, np.array([0, 1, 2]), whole)
    outs = []
    for sums in (True, False):
        d = caches((1, 8), spec, zeros=True)
        d, landed = scatter_piece(d, st, np.array([30, 1, 2]), np.array([0, 1, 2]), whole,
                                  sums=sums)
        assert (landed is None) == (not sums)
        outs.append([bits(c) for c in d])
    for with_sums, without in zip(*outs):
        assert (with_sums == without).all()
    assert all((o[[30, 1, 2]] == bits(s)[[3, 9, 4]]).all() for o, s in zip(outs[1], src))
    with pytest.raises(InvalidInputError, match="sums must be True or False, got 'no'"):
        scatter_piece(d, st, np.array([30]), np.array([0]), whole, sums="no")


def test_a_piece_one_device_holds_is_gathered_into_pinned_staging_in_place(monkeypatch):
    """On the XLA backend, a piece one device holds (here with a replica over 'data') stages
    into pinned-host regions written in place (`kvxfer.device.pinned`): the host
    backend's bytes and sums, every region at its address; two devices' piece: numpy."""
    from kvxfer.device.pinned import PinnedRegions

    p = caches((2, 4), PartitionSpec(None, None, "model"), seed=5)  # 2 units per device
    layout = CacheLayout.from_caches(p)
    piece, ids, slots = Piece(1, 8, 2, 4), np.array([7, 1, 2, 31, 30]), np.array([6, 0, 1, 2, 3])
    monkeypatch.setenv("KVXFER_BACKEND", "numpy")
    expected = piece_staging(layout, piece, 8)
    gather_piece_into(p, ids, expected, slots, piece)
    monkeypatch.setenv("KVXFER_BACKEND", "xla")
    assert not isinstance(piece_staging(layout, Piece(1, 8, 2, 6), 8, p).regions, PinnedRegions)
    st = piece_staging(layout, piece, 8, p)
    assert isinstance(st.regions, PinnedRegions)
    addresses, first = list(st.regions.addresses), st.regions.arrays[0]
    gather_piece_into(p, ids, st, slots, piece)
    assert first.is_deleted() and st.regions.addresses == addresses  # written in place
    for layer in range(2):
        assert (st.regions[layer][slots].view(np.uint16)
                == expected.regions[layer][slots].view(np.uint16)).all()
    assert (st.prints[slots] == expected.prints[slots]).all()


def test_piece_staging_refuses_caches_that_are_not_jax_arrays_by_name():
    p = caches((1, 8), PartitionSpec(None, None, "model"))
    layout = CacheLayout.from_caches(p)
    for bad in ("x", [np.zeros(3)], []):
        with pytest.raises(InvalidInputError, match="piece_staging caches must be"):
            piece_staging(layout, Piece(1, 8, 0, 4), 8, bad)
