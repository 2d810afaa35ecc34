"""Cache layout: what a set of per-layer KV caches looks like, block for block.

A `CacheLayout` is read off the arrays themselves (`CacheLayout.from_caches`)
and says only what the copy paths need: the global shape, the dtype, the mesh
axes and how each array axis is sharded over them, and the ratio between the
engine's logical block and the kernel block. Axis 0 is always the block axis;
the inner axes are opaque (a block is bytes with a shape), so nothing here
knows about heads, tokens or K/V packing.

A layout is a frozen, hashable dataclass (a static key for cached jitted
builders) and round-trips through a plain dict (`to_dict` / `from_dict`).
Two sides may exchange blocks when `check_block_compatible` accepts their
`advertised` block fields: the one compatibility check.
"""


from __future__ import annotations

import dataclasses
import math
import reprlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from kvxfer.errors import InvalidInputError, LayoutMismatchError
from kvxfer.plan.blocks import is_int

__all__ = ["BLOCK_AXIS", "BLOCK_FIELDS", "CacheLayout", "advertised", "check_block_compatible"]

BLOCK_AXIS = 0
"""The array axis that indexes blocks, in every cache kvxfer handles."""

_DICT_VERSION = 1


def _spec_entries(spec: PartitionSpec, ndim: int) -> tuple[tuple[str, ...], ...]:
    """`spec` as one tuple of mesh axis names per array axis (empty = not sharded)."""
    entries = tuple(spec)
    if len(entries) > ndim:
        raise InvalidInputError(f"partition spec {spec} has more entries than the {ndim} axes")
    out: list[tuple[str, ...]] = []
    for entry in entries + (None,) * (ndim - len(entries)):
        if entry is None:
            out.append(())
        elif isinstance(entry, str):
            out.append((entry,))
        else:
            out.append(tuple(entry))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """Static description of a list of per-layer caches that share one layout.

    Fields:

    - `num_layers`: how many per-layer arrays.
    - `shape`: the global shape of each array, `[num_blocks, *block_shape]`.
    - `dtype`: the numpy name of the element type (`"bfloat16"`, `"float8_e4m3fn"`, ...).
    - `mesh_axes`: the mesh as `((axis_name, size), ...)`, in mesh order.
    - `spec`: per array axis, the mesh axis names that shard it (`()` = not sharded).
    - `kernel_ratio`: kernel blocks per logical (engine) block; 1 when they match.
      Block ids given to `kvxfer.device.gather` are always kernel ids.
    """

    num_layers: int
    shape: tuple[int, ...]
    dtype: str
    mesh_axes: tuple[tuple[str, int], ...]
    spec: tuple[tuple[str, ...], ...]
    kernel_ratio: int = 1

    def __post_init__(self) -> None:
        if not is_int(self.num_layers) or self.num_layers <= 0:
            raise InvalidInputError(f"num_layers must be a positive int, got {self.num_layers!r}")
        if (not isinstance(self.shape, Sequence) or len(self.shape) < 2
                or not all(is_int(d) and d > 0 for d in self.shape)):
            raise InvalidInputError(
                f"cache shape must be [num_blocks, *block_shape] with positive int sizes, "
                f"got {self.shape!r}"
            )
        if not isinstance(self.dtype, str):
            raise InvalidInputError(f"dtype must be a numpy dtype name, got {self.dtype!r}")
        try:
            np.dtype(self.dtype)
        except TypeError:
            raise InvalidInputError(f"unknown dtype name {self.dtype!r}") from None
        if not isinstance(self.mesh_axes, Sequence):
            raise InvalidInputError(f"mesh_axes must be ((name, size), ...), got {self.mesh_axes!r}")
        for entry in self.mesh_axes:
            if (not isinstance(entry, Sequence) or len(entry) != 2 or not isinstance(entry[0], str)
                    or not is_int(entry[1]) or entry[1] <= 0):
                raise InvalidInputError(
                    f"mesh_axes entry {entry!r} is not (axis name, positive int size)"
                )
        if not isinstance(self.spec, Sequence) or len(self.spec) != len(self.shape):
            raise InvalidInputError(f"spec {self.spec} does not have one entry per axis of {self.shape}")
        for entry in self.spec:
            if (not isinstance(entry, Sequence) or isinstance(entry, str)
                    or not all(isinstance(n, str) for n in entry)):
                raise InvalidInputError(
                    f"spec entry {entry!r} is not a tuple of mesh axis names (strings)"
                )
        if not is_int(self.kernel_ratio) or self.kernel_ratio <= 0:
            raise InvalidInputError(f"kernel_ratio must be a positive int, got {self.kernel_ratio!r}")
        if self.num_blocks % self.kernel_ratio:
            # Logical block L holds kernel blocks L*r .. L*r + r - 1: the last would run past.
            raise InvalidInputError(
                f"kernel_ratio {self.kernel_ratio} does not divide the {self.num_blocks} "
                f"kernel blocks of shape {self.shape}"
            )
        sizes = dict(self.mesh_axes)
        used = [name for entry in self.spec for name in entry]
        unknown = [name for name in used if name not in sizes]
        if unknown:
            raise InvalidInputError(f"spec {self.spec} names mesh axes {unknown} not in {self.mesh_axes}")
        if len(set(used)) != len(used):
            raise InvalidInputError(f"spec {self.spec} uses a mesh axis twice")
        block_grid = math.prod(sizes[n] for n in self.spec[0])
        grids = (block_grid, *self.shard_grid)
        for axis, (dim, grid) in enumerate(zip(self.shape, grids)):
            if dim % grid:
                raise InvalidInputError(
                    f"axis {axis} of size {dim} does not split evenly into {grid} shards "
                    f"(spec {self.spec}, mesh {self.mesh_axes})"
                )

    @classmethod
    def from_caches(cls, caches: Sequence[jax.Array], kernel_ratio: int = 1) -> CacheLayout:
        """Read the layout off per-layer caches, checking that all layers share it.

        **Arguments:**

        - `caches`: one `jax.Array` per layer, `[num_blocks, *block_shape]`, each with a
          `NamedSharding`.
        - `kernel_ratio`: kernel blocks per logical block (`kvxfer.plan.blocks.kernel_ratio`).

        **Returns:**

        The `CacheLayout` of every layer.

        Raises `InvalidInputError` on an empty list, a deleted (donated) array or an
        array that is not sharded by a `NamedSharding`, and `LayoutMismatchError` naming
        the layer and value when layers differ in shape, dtype or sharding.
        """
        if isinstance(caches, jax.Array) or not isinstance(caches, Sequence):
            raise InvalidInputError(
                f"caches must be a list of per-layer jax.Arrays, got {type(caches).__name__}"
            )
        if len(caches) == 0:
            raise InvalidInputError("caches is an empty list: no layers to copy")
        first = caches[0]
        first_spec = None
        for i, cache in enumerate(caches):
            if not isinstance(cache, jax.Array):
                raise InvalidInputError(f"caches[{i}] is a {type(cache).__name__}, not a jax.Array")
            if cache.is_deleted():
                # Running on a donated buffer crashes the process (scatter) or raises deep in JAX.
                raise InvalidInputError(
                    f"caches[{i}] was deleted (donated to an earlier call); pass the caches "
                    f"that call returned"
                )
            if not isinstance(cache.sharding, NamedSharding):
                raise InvalidInputError(
                    f"caches[{i}] has sharding {cache.sharding}; kvxfer needs a NamedSharding"
                )
            if cache.shape == first.shape and cache.dtype == first.dtype and (
                    cache.sharding is first.sharding or cache.sharding == first.sharding):
                continue  # the usual case, checked in one comparison each (D checks per step)
            first_spec = first_spec or _spec_entries(first.sharding.spec, first.ndim)
            for name, got, want in (
                ("shape", cache.shape, first.shape),
                ("dtype", cache.dtype, first.dtype),
                ("mesh", cache.sharding.mesh, first.sharding.mesh),
                ("spec", _spec_entries(cache.sharding.spec, cache.ndim), first_spec),
            ):
                if got != want:
                    raise LayoutMismatchError(
                        f"caches[{i}] {name} {got} differs from caches[0] {name} {want}"
                    )
        mesh = first.sharding.mesh
        return cls(
            num_layers=len(caches),
            shape=tuple(int(d) for d in first.shape),
            dtype=np.dtype(first.dtype).name,
            mesh_axes=tuple((str(n), int(s)) for n, s in mesh.shape.items()),
            spec=_spec_entries(first.sharding.spec, first.ndim),
            kernel_ratio=kernel_ratio,
        )

    # Derived quantities.

    @property
    def num_blocks(self) -> int:
        """Kernel blocks per layer (the length of axis 0)."""
        return self.shape[BLOCK_AXIS]

    @property
    def block_shape(self) -> tuple[int, ...]:
        """The shape of one block: every axis but the block axis."""
        return self.shape[1:]

    @property
    def np_dtype(self) -> np.dtype:
        """The element dtype as a numpy dtype (ml_dtypes for bf16 and fp8)."""
        return np.dtype(self.dtype)

    @property
    def block_bytes(self) -> int:
        """Bytes of one whole (global) block of one layer."""
        return math.prod(self.block_shape) * self.np_dtype.itemsize

    @property
    def shard_axes(self) -> tuple[str, ...]:
        """Mesh axes that split a block (those sharding the inner axes), in axis order."""
        return tuple(name for entry in self.spec[1:] for name in entry)

    @property
    def shard_grid(self) -> tuple[int, ...]:
        """Per inner axis, how many pieces the sharding cuts it into."""
        sizes = dict(self.mesh_axes)
        return tuple(math.prod(sizes[n] for n in entry) for entry in self.spec[1:])

    @property
    def num_shards(self) -> int:
        """Distinct pieces one block is split into (replicas not counted)."""
        return math.prod(self.shard_grid)

    @property
    def shard_block_shape(self) -> tuple[int, ...]:
        """The shape of the piece of one block that one device holds."""
        return tuple(d // g for d, g in zip(self.block_shape, self.shard_grid))

    @property
    def bytes_per_block_per_shard(self) -> int:
        """Bytes of the piece of one block that one device holds."""
        return math.prod(self.shard_block_shape) * self.np_dtype.itemsize

    # Shardings.

    def partition_spec(self) -> PartitionSpec:
        """The caches' `PartitionSpec`."""
        return PartitionSpec(*(_entry_to_spec(e) for e in self.spec))

    def host_partition_spec(self) -> PartitionSpec:
        """The `PartitionSpec` of gathered blocks: the caches' spec with axis 0 unsharded.

        Gathered rows are replicated over the mesh axes that shard the block axis, so
        every device's host shard holds whole requested blocks in request order.
        """
        return PartitionSpec(None, *(_entry_to_spec(e) for e in self.spec[1:]))

    def check_mesh(self, mesh: Mesh) -> None:
        """Raise `LayoutMismatchError` unless `mesh` has this layout's axis names and sizes."""
        got = tuple((str(n), int(s)) for n, s in mesh.shape.items())
        if got != self.mesh_axes:
            raise LayoutMismatchError(f"mesh axes {got} differ from the layout's {self.mesh_axes}")

    # Serialisation and peer checks.

    def to_dict(self) -> dict[str, Any]:
        """A plain, JSON-serialisable dict of the layout (lists, strings, ints)."""
        return {
            "version": _DICT_VERSION,
            "num_layers": self.num_layers,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "mesh_axes": [[n, s] for n, s in self.mesh_axes],
            "spec": [list(e) for e in self.spec],
            "kernel_ratio": self.kernel_ratio,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CacheLayout:
        """Inverse of `to_dict`; raises `InvalidInputError` on a malformed dict.

        Nothing is coerced: sizes must be ints and names strings, so a peer's
        `2.5` or `"8"` is refused rather than silently rounded or parsed.
        """
        try:
            version = data.get("version", _DICT_VERSION)
            if version != _DICT_VERSION:
                raise InvalidInputError(f"layout dict version {version!r} is not {_DICT_VERSION}")
            return cls(
                num_layers=data["num_layers"],
                shape=tuple(data["shape"]),
                dtype=data["dtype"],
                mesh_axes=tuple(tuple(pair) for pair in data["mesh_axes"]),
                spec=tuple(tuple(e) for e in data["spec"]),
                kernel_ratio=data.get("kernel_ratio", 1),
            )
        except InvalidInputError as e:
            raise InvalidInputError(f"malformed layout dict {dict(data)!r}: {e}") from e
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise InvalidInputError(f"malformed layout dict {dict(data)!r}: {e!r}") from e

    def block_fields(self) -> dict[str, Any]:
        """What fixes the bytes of one block, as a JSON-able dict: block shape, dtype,
        layers and kernel ratio (not the number of blocks, nor the sharding)."""
        return {
            "block_shape": list(self.block_shape),
            "dtype": self.dtype,
            "num_layers": self.num_layers,
            "kernel_ratio": self.kernel_ratio,
        }


BLOCK_FIELDS = ("block_shape", "dtype", "num_layers", "kernel_ratio")
"""The fields of `CacheLayout.block_fields`."""


def advertised(layouts: Sequence[CacheLayout], model: Mapping[str, Any] | None = None,
               unit_axes: Sequence[int] | None = None) -> dict[str, Any]:
    """What a peer checks at handshake (`check_block_compatible`): each group's block fields,
    and `model`, a JSON-able description of what the caches hold (for vLLM: the model,
    its dtype, heads and layers, and each KV cache group's kind, block size and
    sliding window; `kvxfer.vllm.model_description`), which must be the same on
    both sides; None describes nothing (and matches only nothing).

    `unit_axes`: per group, the block axis a side's pieces cut blocks along
    (`kvxfer.device.pieces.split_axis`); None: not said. Two sides that cut the same
    number of units along different axes stage the same bytes laid out differently: the
    axis is part of what fixes a staged block's bytes.

    A `hashing` key of `model` (`kvxfer.vllm.connector.block_hashing`: how block hashes,
    the host pool's keys, are made) is advertised beside it, under its own key, which a
    peer that knows none ignores; `check_block_compatible` compares it where either side
    keeps a pool."""
    if model is not None and not isinstance(model, Mapping):
        raise InvalidInputError(f"model must be None or a dict describing the model, got "
                                f"{model!r:.80}")
    if unit_axes is not None and (len(unit_axes) != len(layouts)
                                  or not all(is_int(a) and a >= 0 for a in unit_axes)):
        raise InvalidInputError(f"unit_axes must be None or one axis >= 0 per group "
                                f"({len(layouts)}), got {unit_axes!r:.80}")
    groups = [layout.block_fields() for layout in layouts]
    for fields, axis in zip(groups, unit_axes or ()):
        fields["unit_axis"] = int(axis)
    model = dict(model or {})
    hashing = model.pop("hashing", None)  # its own key: a peer that knows none ignores it
    return {"groups": groups, "model": model, **({"hashing": hashing} if hashing else {})}


def check_block_compatible(local: Mapping[str, Any], remote: Mapping[str, Any]) -> None:
    """Raise `LayoutMismatchError` unless blocks can move between two sides: the one check.

    Both are `advertised(...)` dicts. Every group's blocks must have the same
    bytes (`BLOCK_FIELDS`), cut into units along the same block axis (`unit_axis`);
    the number of blocks and the sharding may differ (P at TP 4, D at TP 8: each
    side stages the units it holds and re-shards). The
    model descriptions must be equal. The error lists each differing field,
    with both values.
    """
    ours, theirs = local.get("groups"), remote.get("groups")
    if not isinstance(theirs, list) or len(theirs) != len(ours):
        raise LayoutMismatchError(
            f"peer has {len(theirs) if isinstance(theirs, list) else theirs!r:.120} KV cache "
            f"groups, local has {len(ours)}")
    diffs = [  # a peer's values are cut: it may advertise a block shape of a million ints
        f"group {g} {key}: peer={_shown(t.get(key) if isinstance(t, Mapping) else t)} "
        f"local={o.get(key)!r:.120}"
        for g, (o, t) in enumerate(zip(ours, theirs))
        for key in (*BLOCK_FIELDS, "unit_axis")
        if not isinstance(t, Mapping) or not _same(o.get(key), t.get(key))
    ]
    if any(" unit_axis: " in d for d in diffs):
        diffs.append("a side cuts its blocks along the last inner axis its caches' "
                     "PartitionSpec names (axis 0 where it names none): name the same axes "
                     "on both sides, as tpu-inference names the heads at any TP")
    if diffs:
        raise LayoutMismatchError("peer cache layout differs: " + "; ".join(diffs))
    ours, theirs = local.get("model") or {}, remote.get("model")
    theirs = theirs if isinstance(theirs, Mapping) else {"(malformed)": theirs}
    diffs = [f"{_shown(key)}: peer={_shown(theirs.get(key))} local={ours.get(key)!r:.120}"
             for key in sorted({*ours, *theirs}, key=str) if ours.get(key) != theirs.get(key)]
    if diffs:
        raise LayoutMismatchError("peer holds the KV of another model (or another KV cache of it): "
                                  + "; ".join(diffs))
    _check_hashing(local.get("hashing"), remote.get("hashing"))


def _check_hashing(ours: Any, theirs: Any) -> None:
    """Where either side keeps a host pool, its keys (block hashes) must mean the same on
    both: the same algorithm, hash block size and seed, shown by equal canaries (the hash of
    one fixed block), and no side whose seed is drawn at random per process (canary None).
    Without a pool, block hashes never leave an instance and any pair."""
    if ours is None and theirs is None:
        return  # neither describes its hashing (a tool, not vLLM)
    if theirs is not None and not isinstance(theirs, Mapping):  # it may pool: not knowable
        raise LayoutMismatchError(f"the peer's hashing is not a description of how it hashes "
                                  f"blocks: {_shown(theirs)}")
    ours, theirs = ours if isinstance(ours, Mapping) else {}, theirs or {}
    if ours.get("pool") is not True and theirs.get("pool") is not True:
        return
    diffs = [f"{key}: peer={_shown(theirs.get(key), 80)} local={ours.get(key)!r:.80}"
             for key in ("algo", "block_size", "canary")
             if not _same(ours.get(key), theirs.get(key))]
    unseeded = [f"the {side}'s {_shown(h.get('algo'), 40)} seed is drawn at random per process"
                for side, h in (("peer", theirs), ("local side", ours))
                if h.get("seed") == "random"]
    if diffs or unseeded:
        raise LayoutMismatchError(
            "a host pool is on and the peer hashes blocks otherwise, so pooled blocks would "
            "not be found by their hashes: " + "; ".join(diffs + unseeded) + ". Start every "
            "instance with the same --prefix-caching-hash-algo (sha256 or sha256_cbor pair "
            "across processes) and PYTHONHASHSEED set alike everywhere or nowhere (xxhash and "
            "xxhash_cbor need it set)")


_REPR = reprlib.Repr()  # Python 3.11's takes no arguments
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxother = 3, 8, 8, 80, 80


def _shown(value: Any, limit: int = 120) -> str:
    """A peer's value in a message, cut short however long or deeply nested it is."""
    return _REPR.repr(value)[:limit]


def _same(ours: Any, theirs: Any) -> bool:
    """Whether two advertised values are the same JSON value: Python's `True == 1` and
    `1.0 == 1` would pair a peer advertising unit_axis `true` with a side cutting axis 1."""
    if isinstance(ours, (list, tuple)) or isinstance(theirs, (list, tuple)):
        return (isinstance(ours, (list, tuple)) and isinstance(theirs, (list, tuple))
                and len(ours) == len(theirs) and all(map(_same, ours, theirs)))
    return (ours == theirs and isinstance(ours, bool) == isinstance(theirs, bool)
            and isinstance(ours, float) == isinstance(theirs, float))


def _entry_to_spec(entry: tuple[str, ...]) -> str | tuple[str, ...] | None:
    if not entry:
        return None
    return entry[0] if len(entry) == 1 else entry
