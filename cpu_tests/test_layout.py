"""CacheLayout: read off the caches, hashable, dict round-trip, peer compatibility."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from kvxfer.device.layout import CacheLayout, advertised, check_block_compatible
from kvxfer.errors import InvalidInputError, LayoutMismatchError


def _caches(mesh_shape, names, spec, shape, dtype=jnp.bfloat16, layers=2):
    mesh = jax.make_mesh(mesh_shape, names)
    sharding = NamedSharding(mesh, spec)
    return [jax.device_put(jnp.zeros(shape, dtype), sharding) for _ in range(layers)]


def test_reads_shape_dtype_mesh_and_spec_off_the_caches():
    caches = _caches((2, 4), ("data", "model"), P("data", None, "model"), (16, 8, 8, 2, 16))
    layout = CacheLayout.from_caches(caches, kernel_ratio=2)
    assert layout.num_layers == 2
    assert layout.shape == (16, 8, 8, 2, 16)
    assert layout.dtype == "bfloat16"
    assert layout.mesh_axes == (("data", 2), ("model", 4))
    assert layout.spec == (("data",), (), ("model",), (), ())
    assert layout.kernel_ratio == 2
    assert layout.partition_spec() == P("data", None, "model", None, None)
    assert layout.host_partition_spec() == P(None, None, "model", None, None)


def test_bytes_per_block_per_shard_divides_by_the_inner_sharding_only():
    caches = _caches((2, 4), ("dcp", "model"), P(None, "dcp", "model"), (16, 8, 8, 2, 16))
    layout = CacheLayout.from_caches(caches)
    assert layout.block_bytes == 8 * 8 * 2 * 16 * 2
    assert layout.shard_grid == (2, 4, 1, 1)
    assert layout.num_shards == 8
    assert layout.shard_block_shape == (4, 2, 2, 16)
    assert layout.bytes_per_block_per_shard == layout.block_bytes // 8


def test_block_axis_sharding_does_not_split_a_block():
    caches = _caches((2, 4), ("data", "model"), P("data"), (16, 4, 2, 64), jnp.int8)
    layout = CacheLayout.from_caches(caches)
    assert layout.num_shards == 1
    assert layout.bytes_per_block_per_shard == 4 * 2 * 64


def test_layout_is_hashable_and_equal_layouts_hash_alike():
    a = CacheLayout.from_caches(_caches((1, 8), ("data", "model"), P(None, None, "model"),
                                        (16, 8, 8, 2, 16)))
    b = CacheLayout.from_caches(_caches((1, 8), ("data", "model"), P(None, None, "model"),
                                        (16, 8, 8, 2, 16)))
    assert a == b and hash(a) == hash(b)
    assert len({a, b}) == 1


def test_dict_round_trip_survives_json():
    layout = CacheLayout.from_caches(
        _caches((2, 4), ("data", "model"), P("data", None, ("model",)), (16, 8, 8, 4, 16),
                jnp.float8_e4m3fn),
        kernel_ratio=4,
    )
    again = CacheLayout.from_dict(json.loads(json.dumps(layout.to_dict())))
    assert again == layout


def test_from_dict_rejects_a_malformed_dict():
    with pytest.raises(InvalidInputError, match="malformed"):
        CacheLayout.from_dict({"shape": [4, 4]})


@pytest.mark.parametrize("field, value", [("dtype", "float8_e5m2"), ("kernel_ratio", 2),
                                          ("num_layers", 3)])
def test_block_check_names_the_field_that_changes_a_blocks_bytes(field, value):
    layout = CacheLayout(2, (16, 8, 8, 2, 16), "bfloat16", (("data", 2), ("model", 4)),
                         ((), (), ("model",), (), ()))
    other = CacheLayout.from_dict({**layout.to_dict(), field: value})
    with pytest.raises(LayoutMismatchError, match=f"group 0 {field}: peer="):
        check_block_compatible(advertised([layout]), advertised([other]))


def test_block_check_allows_other_block_counts_and_shardings_but_not_another_block_shape():
    layout = CacheLayout(1, (16, 8, 16), "int8", (("model", 8),), ((), (), ("model",)))
    for other in ({**layout.to_dict(), "shape": [64, 8, 16]},
                  {**layout.to_dict(), "mesh_axes": [["data", 2], ["model", 4]],
                   "spec": [["data"], [], ["model"]]}):
        check_block_compatible(advertised([layout]), advertised([CacheLayout.from_dict(other)]))
    other = CacheLayout.from_dict({**layout.to_dict(), "shape": [16, 8, 8]})
    with pytest.raises(LayoutMismatchError, match="block_shape"):
        check_block_compatible(advertised([layout]), advertised([other]))


def test_block_check_refuses_pieces_cut_along_another_block_axis_and_pieces_against_blocks():
    layout = CacheLayout(1, (16, 4, 4, 2, 8), "bfloat16", (("model", 4),),
                         ((), (), ("model",), (), ()))
    check_block_compatible(advertised([layout], unit_axes=[1]), advertised([layout], unit_axes=[1]))
    with pytest.raises(LayoutMismatchError, match="group 0 unit_axis: peer=0 local=1"):
        check_block_compatible(advertised([layout], unit_axes=[1]),
                               advertised([layout], unit_axes=[0]))
    with pytest.raises(LayoutMismatchError, match="group 0 unit_axis: peer=None local=1"):
        check_block_compatible(advertised([layout], unit_axes=[1]), advertised([layout]))
    with pytest.raises(InvalidInputError, match="unit_axes must be None or one axis"):
        advertised([layout], unit_axes=[1, 2])


def test_block_check_is_per_group_and_names_the_group():
    group = {"block_shape": [16, 8, 2, 128], "dtype": "bfloat16", "num_layers": 4,
             "kernel_ratio": 1}
    ours = {"groups": [group, dict(group, block_shape=[16, 1, 2, 128])]}
    check_block_compatible(ours, {"groups": [dict(g) for g in ours["groups"]]})
    with pytest.raises(LayoutMismatchError, match="group 0 dtype: peer='float8_e4m3fn'"):
        check_block_compatible(ours, {"groups": [dict(group, dtype="float8_e4m3fn"),
                                                 ours["groups"][1]]})
    with pytest.raises(LayoutMismatchError, match="group 1 block_shape"):
        check_block_compatible(ours, {"groups": [group, group]})
    with pytest.raises(LayoutMismatchError, match="peer has 1 KV cache groups, local has 2"):
        check_block_compatible(ours, {"groups": [group]})
    with pytest.raises(LayoutMismatchError, match="peer has None KV cache groups"):
        check_block_compatible(ours, group)
    with pytest.raises(LayoutMismatchError, match="group 0 dtype: peer='junk'"):
        check_block_compatible({"groups": [group]}, {"groups": ["junk"]})


def test_rejects_empty_cache_list():
    with pytest.raises(InvalidInputError, match="empty"):
        CacheLayout.from_caches([])


def test_rejects_layers_of_mixed_dtype_naming_the_layer():
    caches = _caches((1, 8), ("data", "model"), P(None, None, "model"), (16, 8, 8, 2, 16))
    odd = jax.device_put(jnp.zeros((16, 8, 8, 2, 16), jnp.float32), caches[0].sharding)
    with pytest.raises(LayoutMismatchError, match=r"caches\[2\] dtype float32"):
        CacheLayout.from_caches(caches + [odd])


def test_rejects_layers_of_mixed_sharding_naming_the_layer():
    caches = _caches((1, 8), ("data", "model"), P(None, None, "model"), (16, 8, 8, 2, 16))
    odd = jax.device_put(np.zeros((16, 8, 8, 2, 16), np.float32).astype(jnp.bfloat16),
                         NamedSharding(caches[0].sharding.mesh, P(None, "model")))
    with pytest.raises(LayoutMismatchError, match=r"caches\[1\] spec"):
        CacheLayout.from_caches([caches[0], odd])


def test_rejects_an_inner_axis_that_does_not_split_evenly():
    with pytest.raises(InvalidInputError, match="does not split evenly"):
        CacheLayout(1, (16, 6, 16), "int8", (("model", 4),), ((), ("model",), ()))


def _hashing(algo="sha256_cbor", block_size=16, seed="default", canary="c0ffee", pool=True):
    return {"algo": algo, "block_size": block_size, "seed": seed, "canary": canary, "pool": pool}


def _with_hashing(hashing):
    layout = CacheLayout(1, (16, 8, 16), "int8", (("model", 8),), ((), (), ("model",)))
    return advertised([layout], {"model": "m"} if hashing is None else {"model": "m", "hashing": hashing})


@pytest.mark.parametrize("theirs, named", [
    (_hashing(algo="xxhash_cbor"), "algo: peer='xxhash_cbor' local='sha256_cbor'"),
    (_hashing(block_size=64), "block_size: peer=64 local=16"),
    (_hashing(seed="PYTHONHASHSEED", canary="beef"), "canary: peer='beef' local='c0ffee'"),
    (_hashing(pool=False, seed="random", canary=None), "the peer's 'sha256_cbor' seed is drawn at random"),
    (None, "algo: peer=None local='sha256_cbor'"),  # a peer that says nothing (an older kvxfer)
])
def test_a_pool_refuses_a_peer_that_hashes_blocks_otherwise_naming_what_differs(theirs, named):
    with pytest.raises(LayoutMismatchError, match="a host pool is on") as e:
        check_block_compatible(_with_hashing(_hashing()), _with_hashing(theirs))
    assert named in str(e.value)
    assert "--prefix-caching-hash-algo" in str(e.value)


@pytest.mark.parametrize("pool", [True, False])
def test_a_peer_whose_hashing_is_malformed_is_refused_naming_it_pool_or_not(pool):
    """A peer's `hashing` that is no mapping may hide a pool: refused by name either way."""
    with pytest.raises(LayoutMismatchError, match="the peer's hashing is not a description "
                                                  "of how it hashes blocks: 'totally-bogus'"):
        check_block_compatible(_with_hashing(_hashing(pool=pool)), _with_hashing("totally-bogus"))


def test_values_nested_deeper_than_a_repr_can_go_are_refused_by_name_not_by_a_recursion_error():
    deep = 0
    for _ in range(5000):
        deep = [deep]
    for field, theirs in (("hashing", {**_hashing(), "canary": deep}), ("hashing", deep),
                          ("model", {"model": deep})):
        peer = _with_hashing(_hashing())
        peer[field] = theirs
        with pytest.raises(LayoutMismatchError) as e:
            check_block_compatible(_with_hashing(_hashing()), peer)
        assert len(str(e.value)) < 2000 and "[[[" in str(e.value)
    peer = _with_hashing(_hashing())
    peer["groups"][0]["block_shape"] = deep
    with pytest.raises(LayoutMismatchError, match="block_shape: peer=\\[\\[\\["):
        check_block_compatible(_with_hashing(_hashing()), peer)


def test_a_peer_pool_is_refused_by_a_side_whose_seed_is_random_and_equal_hashing_pairs():
    with pytest.raises(LayoutMismatchError, match="the local side's 'xxhash' seed is drawn at random"):
        check_block_compatible(_with_hashing(_hashing(algo="xxhash", seed="random", canary=None, pool=False)),
                               _with_hashing(_hashing(algo="xxhash", seed="random", canary=None)))
    check_block_compatible(_with_hashing(_hashing()), _with_hashing(_hashing(pool=False)))
    # PYTHONHASHSEED set to what vLLM's default is hashes alike: the canaries decide
    check_block_compatible(_with_hashing(_hashing()), _with_hashing(_hashing(seed="PYTHONHASHSEED")))


def test_hashing_is_advertised_beside_the_model_so_a_peer_that_knows_none_compares_models_alike():
    ours = _with_hashing(_hashing(pool=False))
    assert ours["model"] == {"model": "m"} and ours["hashing"] == _hashing(pool=False)
    older = {k: v for k, v in ours.items() if k != "hashing"}  # what a peer before it sends
    check_block_compatible(ours, older)


def test_without_a_pool_block_hashes_never_leave_an_instance_and_any_hashing_pairs():
    ours = _hashing(algo="xxhash", seed="random", canary=None, pool=False)
    for theirs in (_hashing(pool=False), _hashing(algo="sha256", block_size=64, pool=False), None):
        check_block_compatible(_with_hashing(ours), _with_hashing(theirs))
    check_block_compatible(_with_hashing(None), _with_hashing(None))
