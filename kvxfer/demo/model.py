"""A small Llama-shaped decoder in `flax.nnx` whose attention reads and writes paged KV caches.

What `kvxfer demo`, its tests and the notebooks run on both sides of the
transfer, so that what is checked is what a user cares about: a decode
instance continuing from transferred KV generates exactly what one instance
doing prefill and decode would. Not part of kvxfer's transfer API.

The model: RMSNorm, RoPE, grouped-query attention, SwiGLU; a byte-level
vocabulary (256 ids, no tokenizer, nothing to download); random weights from
a fixed seed. Parameters and activations are float32; only the KV cache has
the cache dtype (bf16 by default), so every instance quantizes KV alike.

The caches are tpu-inference's: one array per layer,
`[num_blocks, block_size, cdiv(2 * kv_heads, p), p, head_dim]` with
`p = 32 // bits` of the cache dtype, K and V interleaved (row `2h` is head
`h`'s K, `2h + 1` its V) and packed `p` rows at a time, sharded over `model`
on axis 2. Weights shard as Megatron does (Q, K, V, gate and up by output
columns, O and down by input rows), so two tensor-parallel sizes sum partial
products in different orders: their logits differ by rounding, which the
demo measures as the noise floor.

Attention is pure JAX over sequences padded to a fixed shape: `[S, Q]` query
tokens (a prefill chunk or one decode token per sequence), each sequence with
its block table. A step first writes its tokens' K and V into the cache
through the table, then each query attends to the cache positions up to its
own, gathered through the same table: prefill chunks and decode steps are one
program.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from kvxfer.errors import InvalidInputError
from kvxfer.plan.blocks import cdiv, is_int

__all__ = ["Attention", "CACHE_DTYPES", "Decoder", "Layer", "MLP", "ModelConfig", "RMSNorm",
           "ShardedDecoder", "attend", "cache_sharding", "make_mesh", "pack_kv", "param_spec",
           "rope", "unpack_kv"]

CACHE_DTYPES = ("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2")


@dataclass(frozen=True)
class ModelConfig:
    """Sizes of the demo decoder and its cache. `q_heads` must be a multiple of `kv_heads`."""

    vocab: int = 256
    hidden: int = 256
    layers: int = 4
    q_heads: int = 16
    kv_heads: int = 8
    head_dim: int = 32
    mlp: int = 512
    block_size: int = 16
    cache_dtype: str = "bfloat16"
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab", "hidden", "layers", "q_heads", "kv_heads", "head_dim", "mlp",
                     "block_size"):
            value = getattr(self, name)
            if not is_int(value) or value <= 0:
                raise InvalidInputError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.head_dim % 2:
            raise InvalidInputError(f"ModelConfig.head_dim {self.head_dim} must be even (RoPE rotates "
                                    f"halves)")
        if self.q_heads % self.kv_heads:
            raise InvalidInputError(f"ModelConfig.q_heads {self.q_heads} is not a multiple of "
                                    f"kv_heads {self.kv_heads}")
        if self.cache_dtype not in CACHE_DTYPES:
            raise InvalidInputError(f"cache dtype {self.cache_dtype!r} is not one of "
                                    f"{', '.join(CACHE_DTYPES)}")
        if not is_int(self.seed) or not 0 <= self.seed < 2**32:
            raise InvalidInputError(f"ModelConfig.seed must be an int in [0, 2**32), got {self.seed!r}")
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e30:
                raise InvalidInputError(f"ModelConfig.{name} must be a positive number, got {value!r}")

    @property
    def packing(self) -> int:
        """Rows packed per 32-bit word of the cache dtype (tpu-inference's `p`)."""
        return max(1, 4 // jnp.dtype(self.cache_dtype).itemsize)

    @property
    def cache_rows(self) -> int:
        """Axis 2 of the cache: `cdiv(2 * kv_heads, p)`, the axis sharded over `model`."""
        return cdiv(2 * self.kv_heads, self.packing)

    def cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.block_size, self.cache_rows, self.packing, self.head_dim)

    def check_tp(self, tp: int, flag: str = "tp") -> None:
        """Raise unless `tp` splits heads, cache rows and MLP columns evenly."""
        fits = [n for n in range(1, 9) if self._splits(n)]
        if not is_int(tp) or tp <= 0 or not self._splits(tp):
            raise InvalidInputError(
                f"{flag} {tp!r} does not split the model ({self.kv_heads} KV heads in "
                f"{self.cache_rows} {self.cache_dtype} cache rows, {self.q_heads} query heads, "
                f"MLP {self.mlp}) evenly; use one of {fits}")

    def _splits(self, tp: int) -> bool:
        return all(n % tp == 0 for n in (self.cache_rows, self.kv_heads, self.q_heads, self.mlp))


# -- cache packing ------------------------------------------------------------------


def pack_kv(k: jax.Array, v: jax.Array, cfg: ModelConfig) -> jax.Array:
    """`[..., kv_heads, head_dim]` K and V -> `[..., rows, p, head_dim]` in the cache dtype."""
    kv = jnp.stack([k, v], axis=-2).reshape(*k.shape[:-2], 2 * cfg.kv_heads, cfg.head_dim)
    pad = cfg.cache_rows * cfg.packing - 2 * cfg.kv_heads
    if pad:
        kv = jnp.pad(kv, [(0, 0)] * (kv.ndim - 2) + [(0, pad), (0, 0)])
    return kv.reshape(*k.shape[:-2], cfg.cache_rows, cfg.packing, cfg.head_dim).astype(cfg.cache_dtype)


def unpack_kv(packed: jax.Array, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """The inverse of `pack_kv`, in float32."""
    kv = packed.reshape(*packed.shape[:-3], cfg.cache_rows * cfg.packing, cfg.head_dim)
    kv = kv[..., : 2 * cfg.kv_heads, :].astype(jnp.float32)
    return kv[..., 0::2, :], kv[..., 1::2, :]


# -- the model -----------------------------------------------------------------------


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float):
        self.weight = nnx.Param(jnp.ones((dim,), jnp.float32))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps) * self.weight[...]


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding of `[S, Q, heads, dim]` at `[S, Q]` positions (halves rotated)."""
    half = x.shape[-1] // 2
    freq = theta ** (-jnp.arange(half, dtype=jnp.float32) / half)
    angle = positions[..., None, None].astype(jnp.float32) * freq
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    a, b = x[..., :half], x[..., half:]
    return jnp.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array) -> jax.Array:
    """Causal GQA: `q [S, Q, H, d]` over `k, v [S, L, KV, d]` at key positions `0..L-1`.

    Query `i` sees keys at positions `<= q_pos[s, i]`. Whatever lies past a
    sequence's last query in its gathered pages (another request's KV, junk)
    gets probability 0 and is zeroed, so even an inf or NaN there cannot leak.
    """
    s, nq, h, d = q.shape
    kvh = k.shape[2]
    seen = jnp.arange(k.shape[1])[None, :] <= q_pos.max(axis=1)[:, None]  # [S, L]
    v = jnp.where(seen[:, :, None, None], v, 0.0)
    q = q.reshape(s, nq, kvh, h // kvh, d) * (d ** -0.5)
    scores = jnp.einsum("sqkgd,slkd->skgql", q, k)
    visible = jnp.arange(k.shape[1])[None, None, None, None, :] <= q_pos[:, None, None, :, None]
    scores = jnp.where(visible, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("skgql,slkd->sqkgd", probs, v).reshape(s, nq, h * d)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        linear = partial(nnx.Linear, use_bias=False, rngs=rngs)
        self.wq = linear(cfg.hidden, cfg.q_heads * cfg.head_dim)
        self.wk = linear(cfg.hidden, cfg.kv_heads * cfg.head_dim)
        self.wv = linear(cfg.hidden, cfg.kv_heads * cfg.head_dim)
        self.wo = linear(cfg.q_heads * cfg.head_dim, cfg.hidden)

    def qkv(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        cfg, (s, n, _) = self.cfg, x.shape
        q = rope(self.wq(x).reshape(s, n, cfg.q_heads, cfg.head_dim), positions, cfg.rope_theta)
        k = rope(self.wk(x).reshape(s, n, cfg.kv_heads, cfg.head_dim), positions, cfg.rope_theta)
        return q, k, self.wv(x).reshape(s, n, cfg.kv_heads, cfg.head_dim)


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        linear = partial(nnx.Linear, use_bias=False, rngs=rngs)
        self.gate = linear(cfg.hidden, cfg.mlp)
        self.up = linear(cfg.hidden, cfg.mlp)
        self.down = linear(cfg.mlp, cfg.hidden)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down(jax.nn.silu(self.gate(x)) * self.up(x))


class Layer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.mlp = MLP(cfg, rngs)


class Decoder(nnx.Module):
    """The demo decoder. `step` runs paged; `dense_logits` is the reference without a cache."""

    def __init__(self, cfg: ModelConfig):
        rngs = nnx.Rngs(cfg.seed)
        self.cfg = cfg
        self.embed = nnx.Embed(cfg.vocab, cfg.hidden, rngs=rngs,
                               embedding_init=nnx.initializers.normal(1.0))
        self.layers = nnx.List([Layer(cfg, rngs) for _ in range(cfg.layers)])
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.lm_head = nnx.Linear(cfg.hidden, cfg.vocab, use_bias=False, rngs=rngs)

    def step(self, caches: Sequence[jax.Array], tokens: jax.Array, positions: jax.Array,
             valid: jax.Array, tables: jax.Array,
             mesh: Mesh | None = None) -> tuple[jax.Array, list[jax.Array]]:
        """One engine step over `S` sequences of `Q` tokens each.

        Arguments:
            caches: one paged cache per layer.
            tokens, positions: `[S, Q]` int32 token ids and their positions.
            valid: `[S, Q]` bool; padding tokens write nothing and their logits are junk.
            tables: `[S, max_blocks]` int32 block tables (unused entries: any id).
            mesh: when given, activations are constrained to Megatron's sharding.

        Returns:
            `(logits [S, Q, vocab] float32, caches)`.
        """
        cfg = self.cfg
        num_blocks = caches[0].shape[0]
        blocks = jnp.take_along_axis(tables, positions // cfg.block_size, axis=1)
        blocks = jnp.where(valid, blocks, num_blocks)  # out of range: dropped
        offsets = positions % cfg.block_size
        heads = _constraint(mesh, P(None, None, "model", None))
        x = self.embed(tokens)
        out = []
        for layer, cache in zip(self.layers, caches):
            q, k, v = layer.attn.qkv(layer.attn_norm(x), positions)
            q, k, v = heads(q), heads(k), heads(v)
            cache = cache.at[blocks, offsets].set(pack_kv(k, v, cfg), mode="drop")
            pages = cache[tables]  # [S, max_blocks, block, rows, p, dim]
            s, mb = pages.shape[:2]
            k_all, v_all = unpack_kv(pages.reshape(s, mb * cfg.block_size, *pages.shape[3:]), cfg)
            x = x + layer.attn.wo(attend(q, heads(k_all), heads(v_all), positions))
            x = x + layer.mlp(layer.mlp_norm(x))
            out.append(cache)
        return self.lm_head(self.norm(x)), out

    def dense_logits(self, tokens: jax.Array) -> jax.Array:
        """Logits of `[S, n]` tokens at positions `0..n-1` with plain causal attention.

        K and V go through the cache dtype and back, as the paged path stores
        them, so the two differ only by the order of float32 sums.
        """
        cfg = self.cfg
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        x = self.embed(tokens)
        for layer in self.layers:
            q, k, v = layer.attn.qkv(layer.attn_norm(x), positions)
            k, v = unpack_kv(pack_kv(k, v, cfg), cfg)
            x = x + layer.attn.wo(attend(q, k, v, positions))
            x = x + layer.mlp(layer.mlp_norm(x))
        return self.lm_head(self.norm(x))


def _constraint(mesh: Mesh | None, spec: P):
    if mesh is None:
        return lambda x: x
    return lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))


# -- sharding -------------------------------------------------------------------------

_COLUMNS = ("wq", "wk", "wv", "gate", "up")  # sharded by output columns
_ROWS = ("wo", "down")  # sharded by input rows


def param_spec(path: Sequence[object]) -> P:
    """Megatron's placement of one parameter, from its path in the model's state."""
    names = {str(getattr(p, "key", getattr(p, "name", p))) for p in path}
    if names & set(_COLUMNS):
        return P(None, "model")
    if names & set(_ROWS):
        return P("model", None)
    return P()


def cache_sharding(mesh: Mesh) -> NamedSharding:
    """tpu-inference's: axis 2 (packed K/V head rows) over `model`."""
    return NamedSharding(mesh, P(None, None, "model"))


def make_mesh(tp: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A `("data", "model")` mesh of `1 x tp` devices (the first `tp` unless given)."""
    devices = list(jax.devices() if devices is None else devices)
    if tp > len(devices):
        raise InvalidInputError(f"TP {tp} needs {tp} devices; JAX sees {len(devices)}")
    return Mesh(np.array(devices[:tp]).reshape(1, tp), ("data", "model"))


class ShardedDecoder:
    """The decoder's weights placed on a mesh, with its jitted step.

    Arguments:
        cfg: model sizes; weights come from `cfg.seed`, so every instance
            holds the same model.
        mesh: a `("data", "model")` mesh; `model` is the TP size.
    """

    def __init__(self, cfg: ModelConfig, mesh: Mesh):
        cfg.check_tp(mesh.shape["model"])
        self.cfg, self.mesh = cfg, mesh
        graphdef, state = nnx.split(Decoder(cfg))
        shardings = jax.tree_util.tree_map_with_path(
            lambda path, _: NamedSharding(mesh, param_spec(path)), state)
        self.state = jax.device_put(state, shardings)
        cache = cache_sharding(mesh)

        def step(state, caches, tokens, positions, valid, tables):
            model = nnx.merge(graphdef, state)
            return model.step(caches, tokens, positions, valid, tables, mesh=mesh)

        def dense(state, tokens):
            return nnx.merge(graphdef, state).dense_logits(tokens)

        replicated = NamedSharding(mesh, P())
        self._step = jax.jit(step, donate_argnums=1,
                             out_shardings=(replicated, [cache] * cfg.layers))
        self._dense = jax.jit(dense, out_shardings=replicated)

    def new_caches(self, num_blocks: int) -> list[jax.Array]:
        """Zeroed caches of `num_blocks` blocks, sharded as tpu-inference shards them."""
        if not is_int(num_blocks) or num_blocks <= 0:
            raise InvalidInputError(f"num_blocks must be a positive int, got {num_blocks!r}")
        zeros = jax.jit(lambda: jnp.zeros(self.cfg.cache_shape(num_blocks), self.cfg.cache_dtype),
                        out_shardings=cache_sharding(self.mesh))
        return [zeros() for _ in range(self.cfg.layers)]

    def step(self, caches: list[jax.Array], tokens: np.ndarray, positions: np.ndarray,
             valid: np.ndarray, tables: np.ndarray) -> tuple[np.ndarray, list[jax.Array]]:
        """`Decoder.step` on this mesh; donates `caches`. Returns host logits and the new caches."""
        logits, caches = self._step(self.state, caches, jnp.asarray(tokens, jnp.int32),
                                    jnp.asarray(positions, jnp.int32), jnp.asarray(valid, bool),
                                    jnp.asarray(tables, jnp.int32))
        return np.asarray(logits), caches

    def dense_logits(self, tokens: np.ndarray) -> np.ndarray:
        return np.asarray(self._dense(self.state, jnp.asarray(tokens, jnp.int32)))
