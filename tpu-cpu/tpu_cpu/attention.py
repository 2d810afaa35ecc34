"""A pure-JAX stand-in for tpu-inference's ragged paged attention (RPA v3), for JAX's CPU backend.

Why: tpu-inference's attention layers always call the Pallas RPA kernel, which lowers only for
TPUs; on CPU it fails even in Pallas' interpret mode. What: `ragged_paged_attention` takes the
kernel's arguments, cache layout and write rule and returns what it returns, as plain jittable
JAX; `install()` puts it where `sharded_ragged_paged_attention` looks the kernel up
(`tpu_inference.layers.common.attention_interface`), so the `shard_map` around it, the metadata,
the KV cache allocation and the model runner all stay tpu-inference's own.

Cache layout (v3's `get_kv_cache_shape`, head_dim padded to 128; head_dim 64 models, whose
kernel packs K and V in one slot, are refused): `[pages, page_size, 2 * kv_heads // packing, packing,
head_dim padded to 128]`; flattened over the middle two axes, K of head h sits at index 2h and V
at 2h + 1 (tpu-inference's `merge_kv`). Each step writes its tokens' K/V at their positions in the
sequence's pages, then every query attends causally over its sequence's first `kv_len` tokens.

It gathers every page of a sequence for every query token: O(tokens x pages_per_seq x
page_size) memory, fine for the tiny models and short contexts these tests serve.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def ragged_paged_attention(
    queries: jax.Array,
    keys: jax.Array,
    values: jax.Array,
    kv_cache: jax.Array,
    kv_lens: jax.Array,
    page_indices: jax.Array,
    cu_q_lens: jax.Array,
    distribution: jax.Array,
    attention_sink: jax.Array | None = None,
    *,
    use_causal_mask: bool = True,
    update_kv_cache: bool = True,
    sm_scale: float = 1.0,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    out_dtype: Any = None,
    mask_value: float | None = None,
    q_scale: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    **kernel_tuning: Any,
) -> tuple[jax.Array, jax.Array]:
    """Writes this step's K/V into the paged cache, then attends each query over its sequence.

    **Arguments:**

    - `queries`: `[tokens, q_heads, head_dim]`; `keys`, `values`: `[tokens, kv_heads, head_dim]`.
    - `kv_cache`: `[pages, page_size, 2 * kv_heads // packing, packing, head_dim_padded]`.
    - `kv_lens`: `i32[max_seqs]`, each sequence's length including this step's tokens.
    - `page_indices`: `i32[max_seqs * pages_per_seq]`, each sequence's pages, row by row.
    - `cu_q_lens`: `i32[max_seqs + 1]`, where each sequence's tokens start in `queries`.
    - `distribution`: `i32[3]`; `distribution[2]` is the number of live sequences.
    - `attention_sink`: refused (tpu-inference passes one only with head_dim 64 models).
    - the keywords as for tpu-inference's kernel; its tuning keywords (block sizes, VMEM limit,
      debug switches) are accepted and ignored.

    **Returns:** `(out, kv_cache)`: `out` is `[tokens, q_heads, head_dim]` in `out_dtype` (float32
    for float32 queries, else bfloat16, as the kernel), zero for padding tokens; `kv_cache` is the
    updated cache.
    """
    del kernel_tuning
    if attention_sink is not None:
        raise NotImplementedError("tpu_cpu's attention stand-in has no attention sinks")
    from tpu_inference.kernels.ragged_paged_attention.v3.kernel import merge_kv

    if out_dtype is None:
        out_dtype = jnp.float32 if queries.dtype == jnp.float32 else jnp.bfloat16
    if mask_value is None:
        mask_value = jnp.finfo(jnp.float32).min
    num_tokens, num_q_heads, head_dim = queries.shape
    num_kv_heads = keys.shape[1]
    num_pages, page_size, heads_x2_per_packing, packing, padded_head_dim = kv_cache.shape
    max_seqs = kv_lens.shape[0]
    pages_per_seq = page_indices.shape[0] // max_seqs
    page_table = page_indices.reshape(max_seqs, pages_per_seq)
    num_seqs = distribution[2]

    # Which sequence each token belongs to and its absolute position in that sequence.
    token = jnp.arange(num_tokens, dtype=jnp.int32)
    seq = jnp.searchsorted(cu_q_lens[1:], token, side="right").astype(jnp.int32)
    seq = jnp.minimum(seq, max_seqs - 1)
    live = (token < cu_q_lens[num_seqs]) & (seq < num_seqs)
    q_start = cu_q_lens[seq]
    q_len = cu_q_lens[seq + 1] - q_start
    kv_len = kv_lens[seq]
    position = kv_len - q_len + (token - q_start)

    if update_kv_cache:
        merged = merge_kv(keys, values).astype(kv_cache.dtype)  # [tokens, heads_x2/packing, packing, hd]
        page = page_table[seq, jnp.clip(position // page_size, 0, pages_per_seq - 1)]
        page = jnp.where(live, page, num_pages)  # out of range: padding tokens write nothing
        kv_cache = kv_cache.at[page, position % page_size].set(merged, mode="drop")

    # Every token's sequence, gathered: [tokens, pages_per_seq * page_size, heads_x2, hd].
    pages = kv_cache.reshape(num_pages, page_size, heads_x2_per_packing * packing, padded_head_dim)
    context = pages[page_table[seq]].reshape(
        num_tokens, pages_per_seq * page_size, heads_x2_per_packing * packing, padded_head_dim
    )
    k = context[:, :, 0 : 2 * num_kv_heads : 2, :head_dim].astype(jnp.float32)
    v = context[:, :, 1 : 2 * num_kv_heads : 2, :head_dim].astype(jnp.float32)

    q = queries.astype(jnp.float32)
    if q_scale is not None:  # quantized queries, as the kernel: divide, round to the cache dtype
        q = (q / q_scale).astype(kv_cache.dtype).astype(jnp.float32)
    group = num_q_heads // num_kv_heads
    q = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    logits = jnp.einsum("tkgd,tskd->tkgs", q, k) * sm_scale
    for scale in (k_scale, q_scale):
        if scale is not None:
            logits = logits * scale
    if soft_cap is not None:
        logits = soft_cap * jnp.tanh(logits / soft_cap)

    slot = jnp.arange(pages_per_seq * page_size, dtype=jnp.int32)[None, :]
    visible = slot < kv_len[:, None]
    if use_causal_mask:
        visible &= slot <= position[:, None]
        if sliding_window is not None:
            visible &= slot > position[:, None] - sliding_window
    visible &= live[:, None]
    visible = visible[:, None, None, :]
    weights = jax.nn.softmax(jnp.where(visible, logits, mask_value), axis=-1)
    weights = jnp.where(visible, weights, 0.0)
    # Slots past a sequence's kv_len (stale tokens, pages past its allocation, page 0 of padding
    # rows) may hold anything, NaN included, and 0 * NaN is NaN: the kernel never reads them.
    v = jnp.where((slot < kv_len[:, None])[:, :, None, None], v, 0.0)
    out = jnp.einsum("tkgs,tskd->tkgd", weights, v).reshape(num_tokens, num_q_heads, head_dim)
    if v_scale is not None:
        out = out * v_scale
    out = jnp.where(live[:, None, None], out, 0.0).astype(out_dtype)
    return out, kv_cache


def install() -> None:
    """Makes tpu-inference's attention layers call `ragged_paged_attention` instead of the Pallas kernel."""
    from tpu_inference.layers.common import attention_interface

    attention_interface.ragged_paged_attention = ragged_paged_attention
    attention_interface.ragged_paged_attention_hd64 = _head_dim_64_unsupported


def _head_dim_64_unsupported(*args: Any, **kwargs: Any):
    # The head_dim 64 kernel keeps K and V side by side in one 128-wide slot (its own merge_kv),
    # a layout this stand-in does not implement; without this, that kernel's Pallas call would fail
    # with a less direct error.
    raise NotImplementedError("tpu_cpu serves models with head_dim 128 only (the RPA v3 layout)")
