"""Inputs kvxfer used to accept silently (cast, round, wrap or crash on) are refused,
with a kvxfer error naming the value, before any state changes."""

import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kvxfer.demo.kvbytes import BytesConfig
from kvxfer.device.gather import block_fingerprints, check_fingerprints, gather_blocks, scatter_blocks
from kvxfer.device.layout import CacheLayout
from kvxfer.device.staging import Staging
from kvxfer.errors import InvalidInputError, LayoutMismatchError
from kvxfer.plan.blocks import cdiv
from kvxfer.plan.save_plan import GroupSpec
from kvxfer.plan.simulate import SimEngine
from kvxfer.plan.slots import SlotAllocator

# Staging.


@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.uint8])
def test_stage_refuses_rows_of_another_dtype(dtype):
    s = Staging(1, 4, (2,), dtype)
    with pytest.raises(LayoutMismatchError, match=rf"float64.*{np.dtype(dtype).name}"):
        s.stage("r", [0], [np.full((1, 2), 1e300)])  # would have been cast (to inf in bf16)
    assert "r" not in s and s.num_free_slots == 4


def test_stage_accepts_a_host_jax_array_of_the_staging_dtype():
    s = Staging(1, 4, (2,), ml_dtypes.bfloat16)
    rows = jnp.array([[1.5, -2.0]], jnp.bfloat16)
    slots = s.stage("r", [3], [rows])
    np.testing.assert_array_equal(s.rows(0, slots), np.asarray(rows))


@pytest.mark.parametrize("num_layers, num_slots, bad", [
    (True, 4, "num_layers must be a positive int, got True"),
    (1.5, 4, "num_layers must be a positive int, got 1.5"),
    (1, 4.0, "num_slots must be a positive int, got 4.0"),
    (1, 0, "num_slots must be a positive int, got 0"),
])
def test_staging_refuses_sizes_that_are_not_positive_ints(num_layers, num_slots, bad):
    with pytest.raises(InvalidInputError, match=bad):
        Staging(num_layers, num_slots, (2,))


def _free_runs(alloc):
    return list(zip(alloc._starts, alloc._lengths))


def test_release_refuses_a_double_release_and_keeps_the_free_list():
    alloc = SlotAllocator(8)
    alloc.allocate(8)
    alloc.release(0, 4)
    for start, length in [(0, 4), (2, 4), (3, 1), (0, 8)]:
        with pytest.raises(InvalidInputError, match=rf"start {start}, length {length}\).*overlaps"):
            alloc.release(start, length)
        assert alloc.num_free == 4 and _free_runs(alloc) == [(0, 4)]
    alloc.release(4, 4)  # the run actually held: merges into one
    assert _free_runs(alloc) == [(0, 8)]


@pytest.mark.parametrize("start, length", [(6, 4), (-1, 1), (8, 1), (2, 0), (2, -1), (1.0, 2),
                                           (True, 1)])
def test_release_refuses_a_run_outside_the_slots(start, length):
    alloc = SlotAllocator(8)
    alloc.allocate(8)
    with pytest.raises(InvalidInputError, match=rf"start {start!r}, length {length!r}"):
        alloc.release(start, length)
    assert alloc.num_free == 0


def test_staging_free_twice_does_not_free_slots_twice():
    s = Staging(1, 8, (2,), np.uint8)
    s.assign("a", [1, 2, 3])
    s.assign("b", [4, 5])
    s.free("a")
    with pytest.raises(InvalidInputError, match="overlaps"):
        s._free.release(0, 3)
    assert s.num_free_slots == 6


# Fingerprint counts.


@pytest.fixture(scope="module")
def gathered():
    mesh = jax.make_mesh((1, 8), ("data", "model"))
    sharding = NamedSharding(mesh, P(None, None, "model"))
    caches = [jax.device_put(jnp.ones((16, 4, 8, 16), jnp.bfloat16), sharding) for _ in range(2)]
    out = gather_blocks(caches, [1, 2], fingerprints=True)
    return CacheLayout.from_caches(caches), out


@pytest.mark.parametrize("count", [-1, True, 1.5, "2"])
def test_check_fingerprints_refuses_a_count_that_is_not_a_non_negative_int(gathered, count):
    layout, out = gathered
    with pytest.raises(InvalidInputError, match=rf"count must be a non-negative int, got {count!r}"):
        check_fingerprints(layout, out.blocks, count, out.fingerprints)
    with pytest.raises(InvalidInputError, match=rf"count must be a non-negative int, got {count!r}"):
        block_fingerprints(layout, out.blocks, count)


def test_fingerprint_count_may_not_exceed_the_rows(gathered):
    layout, out = gathered
    with pytest.raises(InvalidInputError, match="8 rows, fewer than the 9"):
        check_fingerprints(layout, out.blocks, 9, np.zeros((2, 9, 3), np.uint32))
    with pytest.raises(InvalidInputError, match="8 rows, fewer than the 9"):
        block_fingerprints(layout, out.blocks, 9)


def test_fingerprint_count_may_be_a_numpy_int(gathered):
    layout, out = gathered
    check_fingerprints(layout, out.blocks, np.int64(2), out.fingerprints)
    assert block_fingerprints(layout, out.blocks, np.int32(2)).shape == (2, 2, 3)


# cdiv.


@pytest.mark.parametrize("a, b", [(-7, 2), (7, 0), (7, -2), (np.int64(-1), 2)])
def test_cdiv_refuses_negative_numerator_or_non_positive_denominator(a, b):
    with pytest.raises(InvalidInputError, match=rf"cdiv\({int(a)}, {int(b)}\)"):
        cdiv(a, b)


@pytest.mark.parametrize("a, b", [(7.5, 2), (7, 2.0), (True, 1), (7, False), (np.bool_(True), 1),
                                  ("7", 2)])
def test_cdiv_refuses_bools_floats_and_strings(a, b):
    with pytest.raises(InvalidInputError, match="needs ints"):
        cdiv(a, b)


def test_cdiv_accepts_numpy_ints_and_returns_a_python_int():
    assert cdiv(np.int64(33), np.int32(16)) == 3 and type(cdiv(np.int64(33), 16)) is int
    assert cdiv(0, 5) == 0 and cdiv(32, 16) == 2


def test_sim_engine_with_a_numpy_prompt_length_still_plans():
    engine = SimEngine([GroupSpec(16)])
    engine.add("r", np.int64(40))
    engine.forward(engine.schedule(64))
    assert engine.requests["r"].tables[0] == [1, 2, 3]


# CacheLayout.

_LAYOUT = CacheLayout(1, (16, 8, 16), "int8", (("model", 8),), ((), (), ("model",)))


@pytest.mark.parametrize("field, value, message", [
    ("num_layers", 2.5, "num_layers must be a positive int, got 2.5"),
    ("num_layers", True, "num_layers must be a positive int, got True"),
    ("num_layers", "1", "num_layers must be a positive int, got '1'"),
    ("shape", [16, 8.5, 16], r"positive int sizes, got \(16, 8.5, 16\)"),
    ("shape", [16, True, 16], r"positive int sizes, got \(16, True, 16\)"),
    ("mesh_axes", [["model", 8.0]], r"mesh_axes entry \('model', 8.0\)"),
    ("mesh_axes", [[7, 8]], r"mesh_axes entry \(7, 8\)"),
    ("kernel_ratio", 1.9, "kernel_ratio must be a positive int, got 1.9"),
    ("kernel_ratio", True, "kernel_ratio must be a positive int, got True"),
    ("dtype", 5, "dtype must be a numpy dtype name, got 5"),
    ("dtype", "garbage", "unknown dtype name 'garbage'"),
    ("spec", [[], [], [7]], r"spec entry \(7,\)"),
])
def test_from_dict_refuses_fields_of_the_wrong_type_instead_of_coercing(field, value, message):
    with pytest.raises(InvalidInputError, match=message):
        CacheLayout.from_dict({**_LAYOUT.to_dict(), field: value})


def test_layout_with_unknown_dtype_name_is_invalid_input_not_type_error():
    with pytest.raises(InvalidInputError, match="unknown dtype name 'garbage'"):
        CacheLayout(1, (16, 8, 16), "garbage", (("model", 8),), ((), (), ("model",)))


@pytest.mark.parametrize("ratio, message", [
    (3, "kernel_ratio 3 does not divide the 16 kernel blocks"),
    (2.0, "kernel_ratio must be a positive int, got 2.0"),
])
def test_layout_refuses_a_kernel_ratio_that_is_not_an_int_dividing_the_blocks(ratio, message):
    with pytest.raises(InvalidInputError, match=message):
        CacheLayout(1, (16, 8, 16), "int8", (("model", 8),), ((), (), ("model",)), ratio)


def test_layout_round_trips_after_the_stricter_checks():
    layout = CacheLayout(1, (16, 8, 16), "int8", (("model", 8),), ((), (), ("model",)), 4)
    assert CacheLayout.from_dict(layout.to_dict()) == layout


# Donated caches.


def _caches(layers=4):
    mesh = jax.make_mesh((1, 8), ("data", "model"))
    sharding = NamedSharding(mesh, P(None, None, "model"))
    return [jax.device_put(jnp.zeros((16, 4, 8, 16), jnp.bfloat16), sharding)
            for _ in range(layers)]


def test_scatter_on_donated_caches_names_the_deleted_layer_instead_of_crashing():
    caches = _caches()
    rows = gather_blocks(caches, [1, 2])
    new = scatter_blocks(caches, rows, [3, 4])  # donates `caches`
    with pytest.raises(InvalidInputError, match=r"caches\[0\] was deleted \(donated"):
        scatter_blocks(caches, rows, [3, 4])
    with pytest.raises(InvalidInputError, match=r"caches\[0\] was deleted"):
        gather_blocks(caches, [3])
    mixed = new[:3] + caches[3:]  # only layer 3 is stale
    with pytest.raises(InvalidInputError, match=r"caches\[3\] was deleted.*pass the caches that"):
        scatter_blocks(mixed, rows, [3, 4])
    assert not any(c.is_deleted() for c in new)  # refused before dispatch: nothing donated
    np.testing.assert_array_equal(np.asarray(gather_blocks(new, [3])[0])[0], np.asarray(rows[0])[0])


def test_scatter_refuses_deleted_host_blocks():
    caches = _caches(layers=2)
    rows = gather_blocks(caches, [1, 2])
    rows[1].delete()
    with pytest.raises(InvalidInputError, match=r"host_blocks\[1\] was deleted"):
        scatter_blocks(caches, rows, [3, 4])
    assert not any(c.is_deleted() for c in caches)


# BytesConfig.validate (the CLI's view of it is in test_cli.py).


@pytest.mark.parametrize("fields, message", [
    (dict(dtype="garbage"), "--dtype 'garbage' is not one of"),
    (dict(dtype="float64"), "--dtype 'float64' is not one of"),
    (dict(layers=0), "--layers must be a positive int, got 0"),
    (dict(budget=0), "--budget must be a positive int, got 0"),
    (dict(tp_p=3), r"--tp-p 3 does not divide the 8 head rows.*one of \[1, 2, 4, 8\]"),
    (dict(tp_d=16), "--tp-d 16 is more than the 8 devices"),
    (dict(tp_p=0), "--tp-p must be a positive int, got 0"),
    (dict(layout="attention4d", heads=3, tp_p=3, tp_d=4), "--tp-d 4 does not divide the 6 head rows"),
    (dict(layout="mla", dtype="int8", block_size=2), "--block-size 2 must be a multiple of 4"),
    (dict(heads=1.5), "BytesConfig.heads must be a positive int, got 1.5"),
    (dict(lookahead=-1), "BytesConfig.lookahead must be a non-negative int, got -1"),
    (dict(seed=-3), "BytesConfig.seed must be a non-negative int, got -3"),
    (dict(timeout_s=0), "BytesConfig.timeout_s must be a positive number, got 0"),
    (dict(timeout_s=float("nan")), "BytesConfig.timeout_s must be a positive number, got nan"),
    (dict(prompts=[], cached=[]), r"BytesConfig.prompts must be a non-empty list .* got \[\]"),
    (dict(prompts=[40, 0], cached=[0, 0]), r"BytesConfig.prompts .* got \[40, 0\]"),
    (dict(prompts=[40], cached=[0, 0]), r"BytesConfig.cached \[0, 0\] must give one prefix hit"),
    (dict(prompts=[40], cached=[8]), r"BytesConfig.cached\[0\] 8 must be a multiple of --block-size 16"),
    (dict(prompts=[32], cached=[32]), r"BytesConfig.cached\[0\] 32 .* in \[0, prompt 32\)"),
    (dict(num_blocks=10), "need 64 blocks of 16 tokens, more than the 9 usable of --num-blocks 10; "
                          "raise --num-blocks"),
])
def test_demo_config_validate_names_the_bad_field_and_value(fields, message):
    with pytest.raises(InvalidInputError, match=message):
        BytesConfig(**fields).validate()


@pytest.mark.parametrize("fields", [
    dict(), dict(dtype="float32", tp_p=8, tp_d=1), dict(dtype="float16"),
    dict(layout="mla", tp_p=3, tp_d=7), dict(layout="attention4d", dtype="int8", tp_p=8),
    dict(dtype="float8_e5m2", tp_p=4, tp_d=2),
])
def test_demo_config_validate_accepts_working_configs(fields):
    BytesConfig(**fields).validate()


def _p_engine_runs_out_of_blocks(cfg):
    """Drive P's engine as the demo does (all prompts added, nothing freed); True if it runs dry."""
    engine = SimEngine([GroupSpec(cfg.block_size)], num_blocks=cfg.num_blocks, lookahead=cfg.lookahead)
    for i, (prompt, hit) in enumerate(zip(cfg.prompts, cfg.cached)):
        engine.add(f"req{i}", prompt, hit)
    try:
        while any(r.remaining > 0 for r in engine.requests.values()):
            engine.forward(engine.schedule(cfg.budget))
    except IndexError:  # the free deque is empty
        return True
    return False


def test_demo_block_check_matches_what_p_engine_allocates():
    # prompts 40 and 300 with lookahead 3 need cdiv(43, 16) + cdiv(303, 16) = 3 + 19 = 22 blocks.
    fits = BytesConfig(prompts=[40, 300], cached=[0, 64], lookahead=3, num_blocks=23)
    fits.validate()
    assert not _p_engine_runs_out_of_blocks(fits)
    short = BytesConfig(prompts=[40, 300], cached=[0, 64], lookahead=3, num_blocks=22)
    with pytest.raises(InvalidInputError, match="need 22 blocks of 16 tokens, more than the 21"):
        short.validate()
    assert _p_engine_runs_out_of_blocks(short)


# Transport and connector configs: refused before any agent is created.


@pytest.mark.parametrize("fields, message", [
    (dict(name=""), "name must be a non-empty printable str, got ''"),
    (dict(name=7), "name must be a non-empty printable str, got 7"),
    (dict(name="P", listen_port=-1), "listen_port must be an int in \\[0, 65535\\], got -1"),
    (dict(name="P", listen_port=70000), "listen_port .* got 70000"),
    (dict(name="P", listen_port=True), "listen_port .* got True"),
    (dict(name="P", handshake_timeout_s=-1), "handshake_timeout_s must be a positive finite"),
    (dict(name="P", transfer_timeout_s=0), "transfer_timeout_s must be a positive finite"),
    (dict(name="P", transfer_timeout_s=float("inf")), "transfer_timeout_s .* got inf"),
    (dict(name="P", lease_s=-30.0), "lease_s must be a positive finite number of seconds, got -30"),
    (dict(name="P", lease_s="30"), "lease_s .* got '30'"),
    (dict(name="P", lease_s=1.0, heartbeat_interval_s=2.0),
     r"heartbeat_interval_s 2.0 must be at most half of lease_s 1.0.* lease_s >= 4.0"),
    (dict(name="P", lease_s=3.0, heartbeat_interval_s=2.0), "at most half of lease_s 3.0"),
    (dict(name="P", lease_s=1e-9, heartbeat_interval_s=1e-10),
     r"lease_s 1e-09 is below 1.0 s.* give lease_s >= 1.0 s"),
    (dict(name="P", lease_s=0.5, heartbeat_interval_s=0.1), "lease_s 0.5 is below 1.0 s"),
    (dict(name="P", transfer_timeout_s=1e-6), r"transfer_timeout_s 1e-06 is below 0.1 s"),
    (dict(name="P", handshake_timeout_s=1e-6), r"handshake_timeout_s 1e-06 is below 0.1 s"),
    (dict(name="P", lease_s=1e300), r"lease_s 1e\+300 is over 86400 s"),
    (dict(name="P", transfer_timeout_s=1e9), r"transfer_timeout_s 1000000000.0 is over 86400 s"),
    (dict(name="P", stream_wait_s=0), "stream_wait_s must be a positive finite number"),
    (dict(name="P", stream_wait_s=float("nan")), "stream_wait_s .* got nan"),
    (dict(name="P", stream_wait_s=1e9), r"stream_wait_s 1000000000.0 is over 86400 s"),
    (dict(name="P", ucx_tls=""), "ucx_tls must be None or a non-empty str"),
    (dict(name="P", num_threads=-1), "num_threads must be a non-negative int, got -1"),
    (dict(name="P", progress_wake_us=-1), "progress_wake_us must be an int in .* got -1"),
    (dict(name="P", progress_wake_us=1.5), "progress_wake_us must be an int in .* got 1.5"),
])
def test_transport_config_refuses_bad_values(fields, message):
    from kvxfer.nixl.agent import TransportConfig

    with pytest.raises(InvalidInputError, match=message):
        TransportConfig(**fields)


@pytest.mark.parametrize("fields, message", [
    (dict(staging_blocks=0), "staging_blocks must be a positive int, got 0"),
    (dict(staging_blocks=8.0), "staging_blocks must be a positive int, got 8.0"),
    (dict(kernel_ratio=True), "kernel_ratio must be a positive int, got True"),
    (dict(verify_fingerprints=1), "verify_fingerprints must be a bool, got 1"),
    (dict(precompile="yes"), "precompile must be a bool, got 'yes'"),
    (dict(stage_units="true"), "stage_units must be a bool, got 'true'"),
    (dict(transport="P"), "transport must be a TransportConfig, got 'P'"),
])
def test_connector_config_refuses_bad_values(fields, message):
    from kvxfer.connector.config import ConnectorConfig
    from kvxfer.nixl.agent import TransportConfig

    with pytest.raises(InvalidInputError, match=message):
        ConnectorConfig(**{"transport": TransportConfig("P"), **fields})


def test_two_live_agents_may_not_share_a_name():
    pytest.importorskip("nixl_cu12._api", reason="NIXL (nixl-cu12) is not installed")
    from kvxfer.device.layout import check_block_compatible
    from kvxfer.device.staging import Staging
    from kvxfer.nixl.agent import TransportConfig
    from kvxfer.nixl.decode import DecodeTransport
    from kvxfer.nixl.prefill import PrefillTransport

    first = PrefillTransport(TransportConfig("twin"), Staging(1, 4, (8,)), {})
    try:
        with pytest.raises(InvalidInputError, match="'twin' is already live"):
            DecodeTransport(TransportConfig("twin"), Staging(1, 4, (8,)), {}, check_block_compatible)
    finally:
        first.close()
    # Free once closed.
    DecodeTransport(TransportConfig("twin"), Staging(1, 4, (8,)), {}, check_block_compatible).close()


def test_start_read_refuses_logical_ids_that_are_not_block_ids_before_any_state_changes():
    pytest.importorskip("nixl_cu12._api", reason="NIXL (nixl-cu12) is not installed")
    from kvxfer.device.layout import check_block_compatible
    from kvxfer.device.staging import Staging
    from kvxfer.nixl.agent import TransportConfig
    from kvxfer.nixl.decode import DecodeTransport
    from kvxfer.nixl.wire import ReadParams

    params = ReadParams.parse({"peer": "P", "instance": "i", "host": "127.0.0.1", "port": 1,
                               "req_id": "r", "generation": 1, "secret": "ab" * 16,
                               "groups": [{"keys": [0], "slots": [0]}]}, 1)
    d = DecodeTransport(TransportConfig("D-strict"), Staging(1, 4, (8,)), {}, check_block_compatible)
    try:
        for bad in ("12", [1.0], [-1], None):
            with pytest.raises(InvalidInputError, match="logical_ids of 'r' must be a list"):
                d.start_read("r", params, bad)
        assert d.pending() == [] and "r" not in d.staging
    finally:
        d.close()


def test_a_d_across_hosts_refuses_a_stream_by_name_and_fails_it_in_logical_ids():
    """A stream has one reader: each process of a D across hosts would subscribe to it, so
    D fails the request at once, naming why, and its engine recomputes it."""
    pytest.importorskip("nixl_cu12._api", reason="NIXL (nixl-cu12) is not installed")
    from kvxfer.device.layout import check_block_compatible
    from kvxfer.device.staging import Staging
    from kvxfer.nixl.agent import TransportConfig
    from kvxfer.nixl.decode import DecodeTransport
    from kvxfer.nixl.wire import StreamParams, new_stream_id

    d = DecodeTransport(TransportConfig("D-stream-1-of-2"), Staging(1, 4, (2, 8)), {},
                        check_block_compatible, piece=(0, 1, 2), reader=(0, 2))
    try:
        d.start_stream("r", StreamParams("P", "127.0.0.1", 1, new_stream_id()), [7, 8])
        assert d.poll() == ([], {"r": [7, 8]})
        assert d.reading("r") is None and "r" not in d.staging
    finally:
        d.close()


def test_a_ucx_tls_ucx_cannot_use_is_refused_by_name_and_frees_the_agent_name():
    pytest.importorskip("nixl_cu12._api", reason="NIXL (nixl-cu12) is not installed")
    from kvxfer.device.staging import Staging
    from kvxfer.nixl.agent import TransportConfig
    from kvxfer.nixl.prefill import PrefillTransport

    with pytest.raises(InvalidInputError, match="ucx_tls='bogus' names on this machine") as e:
        PrefillTransport(TransportConfig("tls-check", ucx_tls="bogus"), Staging(1, 4, (8,)), {})
    assert "tried 'bogus'; try ucx_tls=None (UCX's own choice)" in str(e.value)
    PrefillTransport(TransportConfig("tls-check"), Staging(1, 4, (8,)), {}).close()


def test_ucx_transports_by_default_add_cuda_copy_where_ucx_sees_cuda_then_fall_back_to_ucxs_own():
    from kvxfer.nixl.agent import choose_ucx_tls

    assert choose_ucx_tls("auto", sees_cuda=True) == ["cma,tcp,self,cuda_copy", None]
    assert choose_ucx_tls("auto", sees_cuda=False) == ["cma,tcp,self", None]
    assert choose_ucx_tls("tcp,self", sees_cuda=True) == ["tcp,self"]
    assert choose_ucx_tls(None, sees_cuda=True) == [None]


def test_an_agent_whose_chosen_transports_ucx_cannot_make_starts_on_ucxs_own_and_says_so(
        monkeypatch, caplog):
    """On a CUDA host UCX refused the host transports alone; the default must still start."""
    pytest.importorskip("nixl_cu12._api", reason="NIXL (nixl-cu12) is not installed")
    from kvxfer.device.staging import Staging
    from kvxfer.nixl import agent
    from kvxfer.nixl.agent import TransportConfig
    from kvxfer.nixl.prefill import PrefillTransport

    monkeypatch.setattr(agent, "ucx_sees_cuda", lambda: True)
    # UCX makes no context from names it has none of, as on a CUDA host without cuda_copy.
    monkeypatch.setattr(agent, "HOST_TLS", "no_such_transport")
    monkeypatch.setattr(agent, "CUDA_TLS", "nor_this")
    with caplog.at_level("INFO", logger="kvxfer.nixl.agent"):
        PrefillTransport(TransportConfig("tls-auto"), Staging(1, 4, (8,)), {}).close()
    said = [r.getMessage() for r in caplog.records if r.name == "kvxfer.nixl.agent"]
    assert any("cannot use transports no_such_transport,nor_this" in m for m in said), said
    assert "NIXL agent tls-auto: UCX transports UCX's own choice (ucx_tls auto)" in said


def test_cancel_refuses_an_id_that_is_not_a_str():
    pytest.importorskip("nixl_cu12._api", reason="NIXL (nixl-cu12) is not installed")
    from kvxfer.device.layout import check_block_compatible
    from kvxfer.device.staging import Staging
    from kvxfer.nixl.agent import TransportConfig
    from kvxfer.nixl.decode import DecodeTransport

    d = DecodeTransport(TransportConfig("D-cancel"), Staging(1, 4, (8,)), {}, check_block_compatible)
    try:
        with pytest.raises(InvalidInputError, match=r"cancel takes P's request id \(a str\), got \['r'\]"):
            d.cancel(["r"])
        with pytest.raises(InvalidInputError, match=r"its instance \(a str or None\), got 5"):
            d.cancel("r", 5)
        d.cancel("never-expected")  # ignored
    finally:
        d.close()


def test_the_shortest_workable_lease_is_accepted():
    from kvxfer.nixl.agent import MIN_LEASE_S, TransportConfig

    config = TransportConfig("P", lease_s=MIN_LEASE_S, heartbeat_interval_s=MIN_LEASE_S / 2)
    assert config.lease_s == 1.0


def test_agents_left_at_the_default_name_draw_distinct_names():
    from kvxfer.nixl.agent import TransportConfig

    first, second = TransportConfig(), TransportConfig(etcd_endpoints="http://127.0.0.1:2379")
    assert first.name != second.name
    assert f"-{os.getpid()}-" in first.name and first.name.isprintable()
