"""`precompile`: on the XLA backend (selected on CPU), once it ran, saves and loads of every
block count compile nothing, for pieces (pinned staging on one device, a host copy on four);
and a connector precompiles at start-up."""

import os
import sys
from contextlib import contextmanager

import jax
import numpy as np
import pytest

from kvxfer.connector._processes import for_caches
from kvxfer.connector.config import ConnectorConfig
from kvxfer.device.gather import precompile, staging_regions
from kvxfer.device.layout import CacheLayout
from kvxfer.device.pieces import Piece, gather_piece_into, piece_staging, precompile_piece, scatter_piece
from kvxfer.device.pinned import PinnedRegions
from kvxfer.device.staging import Staging
from kvxfer.errors import InvalidInputError
from kvxfer.nixl.agent import TransportConfig
from kvxfer.plan.save_plan import ScheduledRequest

sys.path.insert(0, os.path.dirname(__file__))
from procs.pair import as_bits, caches_on  # noqa: E402

SLOTS = 12  # caches_on's caches hold 32 blocks: buckets 8 and 16, chunks 1 to 8
UNIQUE = (32, 16, 4, 2, 40)  # caches whose programs no other test compiles (jit's caches are global)


@pytest.fixture
def xla(monkeypatch):
    monkeypatch.setenv("KVXFER_BACKEND", "xla")


@contextmanager
def compiles():
    """The XLA compilations while inside, as a list that fills."""
    seen = []

    def listener(event, duration, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            seen.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def _every_size(n_max=SLOTS, seed=0):
    """`(ids, rows)` of every count 1..n_max: even counts as one run of rows (every chunk
    size of pinned staging), odd ones scattered."""
    rng = np.random.default_rng(seed)
    for n in range(1, n_max + 1):
        ids = rng.choice(32, n, replace=False)
        rows = (np.arange(n) + rng.integers(0, SLOTS - n + 1) if n % 2 == 0
                else rng.choice(SLOTS, n, replace=False))
        yield ids, rows


def _staging(caches, layers=2):
    layout = CacheLayout.from_caches(caches)
    regions = staging_regions(caches[0].sharding.mesh, layers, SLOTS, layout.block_shape,
                              layout.np_dtype)
    return Staging(layers, SLOTS, layout.block_shape, layout.np_dtype, regions=regions)


def test_without_precompile_the_first_save_of_a_size_compiles(xla):
    """The control: what precompile removes is there (3 layers: programs not compiled yet)."""
    caches = caches_on(jax.devices()[:1], seed=6, layers=3, shape=UNIQUE)
    piece = Piece.local(caches)
    staging = piece_staging(CacheLayout.from_caches(caches), piece, SLOTS, caches)
    assert isinstance(staging.regions, PinnedRegions)
    with compiles() as seen:
        gather_piece_into(caches, np.arange(5), staging, np.arange(5), piece)  # chunks 4, 1
    assert len(seen) >= 2  # one program per chunk size, 4 and 1, each taking and writing


@pytest.mark.parametrize("devices", [1, 4], ids=["one-device-pinned", "tp4"])
def test_after_precompile_piece_saves_and_loads_of_every_size_compile_nothing(xla, devices):
    caches = caches_on(jax.devices()[4 : 4 + devices], seed=7, shape=UNIQUE)
    piece = Piece.local(caches)
    layout = CacheLayout.from_caches(caches)
    staging = piece_staging(layout, piece, SLOTS, caches)
    assert isinstance(staging.regions, PinnedRegions) == (devices == 1)
    assert precompile_piece(caches, staging, piece, SLOTS, saves=True, loads=True) > 0
    with compiles() as seen:
        for ids, rows in _every_size(seed=1):
            gather_piece_into(caches, ids, staging, rows, piece)
            caches, _ = scatter_piece(caches, staging, ids, rows, piece)
    assert seen == []


def test_precompile_on_the_host_backend_compiles_nothing_and_bad_arguments_are_refused(monkeypatch):
    monkeypatch.setenv("KVXFER_BACKEND", "numpy")
    caches = caches_on(jax.devices()[:4], seed=8)
    staging = _staging(caches)
    with compiles() as seen:
        assert precompile(caches, staging.regions, SLOTS, saves=True, loads=True) == 0
    assert seen == []
    for bad in (0, -3, 2.5, "24", True):
        with pytest.raises(InvalidInputError, match=f"max_blocks must be a positive int, got "
                                                    f"{bad!r}"):
            precompile(caches, staging.regions, bad, saves=True, loads=False)
    piece = Piece.local(caches)
    pieces = piece_staging(CacheLayout.from_caches(caches), piece, SLOTS)
    with pytest.raises(InvalidInputError, match="max_blocks must be a positive int, got 0"):
        precompile_piece(caches, pieces, piece, 0, saves=True, loads=True)
    with pytest.raises(InvalidInputError, match="saves must be True or False, got 'yes'"):
        precompile(caches, staging.regions, SLOTS, saves="yes", loads=False)
    with pytest.raises(InvalidInputError, match="sums must be True or False, got 1"):
        precompile_piece(caches, pieces, piece, SLOTS, saves=True, loads=True, sums=1)


@pytest.mark.parametrize("d_devices", [(4, 5, 6, 7), (4,)], ids=["d-tp4", "d-one-device"])
def test_connectors_precompile_at_start_up_so_a_transfer_compiles_nothing(xla, pair, d_devices):
    pr = pair(p_devices=(0,), d_devices=d_devices, shape=(16, *UNIQUE[1:]))
    with compiles() as seen:
        pr.p.add_request("r", 56)
        pr.save(ScheduledRequest("r", 0, 24, ([5, 9],), full_table=True))
        pr.save(ScheduledRequest("r", 24, 32, ([12, 2],)))
        params = pr.p.request_finished("r")
        pr.serve()
        assert pr.load("r", params, [10, 11, 13, 14]) == (["r"], [])
    assert seen == []
    for p_cache, d_cache in zip(pr.p_caches[0], pr.d_caches[0]):
        assert (as_bits(d_cache)[[10, 11, 13, 14]] == as_bits(p_cache)[[5, 9, 12, 2]]).all()


@pytest.mark.parametrize("devices", [1, 4], ids=["one-device-pinned", "tp4-host-copy"])
def test_p_precompiles_saves_of_every_slot_when_staging_outgrows_the_cache(xla, devices):
    """Requests sharing a prefix each have their slots, so one save can gather a block more
    than once: with staging larger than the cache, P saves more blocks than the cache holds
    (here 64 of 32: a bucket and a pinned chunk of 64), and those sizes are compiled too."""
    caches = caches_on(jax.devices()[:devices], seed=9, layers=5, shape=UNIQUE)
    hosts = for_caches(ConnectorConfig(TransportConfig("P-precompile"), staging_blocks=80),
                       caches)
    assert hosts.precompile(caches, saves=True) > 0
    ids = np.concatenate([np.arange(32), np.arange(32)])  # every block twice
    with compiles() as seen:
        hosts.gather(0, caches, ids, np.arange(64))
    assert seen == []
    for layer, cache in enumerate(caches):
        unit_major = hosts.stagings[0].regions[layer][:64].view(np.uint16)  # heads first
        np.testing.assert_array_equal(np.moveaxis(unit_major, 1, 2), as_bits(cache)[ids])


def test_a_bad_kvxfer_host_threads_is_refused_when_a_connector_starts(monkeypatch):
    monkeypatch.setenv("KVXFER_HOST_THREADS", "0")
    with pytest.raises(InvalidInputError, match="KVXFER_HOST_THREADS must be a positive int, "
                                                "got '0'"):
        for_caches(ConnectorConfig(TransportConfig("P-threads")), caches_on(jax.devices()[:1], 1))
