"""tpu_cpu's attention stand-in against tpu-inference's own reference, `ref_ragged_paged_attention`.

The reference is the kernel's specification in plain (not jittable) JAX: a Python loop over the
sequences. The stand-in must write the cache identically and attend within rounding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tpu_cpu import attention
from tpu_inference.kernels.ragged_paged_attention.v3.kernel import (
    get_kv_cache_shape,
    ref_ragged_paged_attention,
)

Q_HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE, PAGES, MAX_SEQS, PAGES_PER_SEQ, TOKENS = 4, 2, 128, 16, 64, 4, 8, 40
TOLERANCE = {jnp.float32: 1e-5, jnp.bfloat16: 3e-2}


def batch(dtype, q_lens, kv_lens, seed=0):
    """A ragged batch: sequence i has q_lens[i] new tokens ending at kv_lens[i]; TOKENS rows in all."""
    rng = np.random.default_rng(seed)
    cu_q_lens = np.zeros(MAX_SEQS + 1, np.int32)
    cu_q_lens[1 : len(q_lens) + 1] = np.cumsum(q_lens)
    cu_q_lens[len(q_lens) + 1 :] = cu_q_lens[len(q_lens)]
    lens = np.zeros(MAX_SEQS, np.int32)
    lens[: len(kv_lens)] = kv_lens
    pages = rng.permutation(np.arange(1, PAGES))[: MAX_SEQS * PAGES_PER_SEQ].astype(np.int32)
    shape = get_kv_cache_shape(PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM, dtype)
    decode = sum(1 for q in q_lens if q == 1)
    args = (
        jnp.asarray(rng.standard_normal((TOKENS, Q_HEADS, HEAD_DIM)), dtype),
        jnp.asarray(rng.standard_normal((TOKENS, KV_HEADS, HEAD_DIM)), dtype),
        jnp.asarray(rng.standard_normal((TOKENS, KV_HEADS, HEAD_DIM)), dtype),
        jnp.asarray(rng.standard_normal(shape), dtype),
        jnp.asarray(lens),
        jnp.asarray(pages),
        jnp.asarray(cu_q_lens),
        jnp.asarray([decode, decode, len(q_lens)], jnp.int32),
    )
    return args, int(cu_q_lens[len(q_lens)])


def run_both(args, **kwargs):
    expected_out, expected_cache = ref_ragged_paged_attention(*args, **kwargs)
    out, cache = jax.jit(lambda *a: attention.ragged_paged_attention(*a, **kwargs))(*args)
    return (expected_out, expected_cache), (out, cache)


def max_diff(a, b):
    return float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_matches_reference_on_decode_prefill_and_chunked_prefill(dtype):
    # A decode (1 token after 32), a whole prefill of 7, a chunk of 20 ending at 50 (pages straddled).
    args, live = batch(dtype, q_lens=[1, 7, 20], kv_lens=[33, 7, 50])
    (expected_out, expected_cache), (out, cache) = run_both(args, sm_scale=HEAD_DIM**-0.5)
    assert out.shape == (TOKENS, Q_HEADS, HEAD_DIM) and out.dtype == expected_out.dtype
    assert max_diff(cache, expected_cache) == 0
    assert max_diff(out[:live], expected_out[:live]) < TOLERANCE[dtype]


def test_padding_tokens_write_nothing_and_attend_to_nothing():
    args, live = batch(jnp.float32, q_lens=[3, 5], kv_lens=[3, 21])
    _, (out, cache) = run_both(args, sm_scale=HEAD_DIM**-0.5)
    expected_cache = ref_ragged_paged_attention(*args, sm_scale=HEAD_DIM**-0.5)[1]
    assert live < TOKENS
    assert max_diff(cache, expected_cache) == 0
    assert float(jnp.max(jnp.abs(out[live:]))) == 0


@pytest.mark.parametrize(
    "options", [{"sliding_window": 8}, {"soft_cap": 2.0}, {"k_scale": 0.5, "v_scale": 2.0}]
)
def test_matches_reference_with_window_cap_and_scales(options):
    args, live = batch(jnp.float32, q_lens=[1, 20, 4], kv_lens=[40, 20, 35], seed=1)
    (expected_out, expected_cache), (out, cache) = run_both(args, sm_scale=HEAD_DIM**-0.5, **options)
    assert max_diff(cache, expected_cache) == 0
    assert max_diff(out[:live], expected_out[:live]) < TOLERANCE[jnp.float32]


def test_install_replaces_the_kernel_tpu_inference_calls():
    from tpu_inference.layers.common import attention_interface

    attention.install()
    assert attention_interface.ragged_paged_attention is attention.ragged_paged_attention
    with pytest.raises(NotImplementedError, match="head_dim 128"):
        attention_interface.ragged_paged_attention_hd64()


def test_matches_reference_on_metadata_padded_as_tpu_inference_pads_it_over_garbage():
    # As tpu-inference's `_prepare_inputs` lays a step out: decodes first, then prefills and
    # chunks; cu_q_lens repeats its last value, seq_lens is 0 and block-table rows are 0 for the
    # unused sequence slots; a live row keeps stale page ids past the request's allocation. Every
    # page no live sequence reads (page 0 included) holds NaN and Inf, as stale or uninitialised
    # memory may: the kernel never reads them, and neither may the stand-in (0 * NaN is NaN).
    q_lens, kv_lens = [1, 1, 13, 7], [17, 40, 13, 56]
    rng = np.random.default_rng(3)
    cu_q_lens = np.zeros(MAX_SEQS + 1, np.int32)
    cu_q_lens[1:] = np.cumsum(q_lens + [0] * (MAX_SEQS - len(q_lens)))
    lens = np.array(kv_lens + [0] * (MAX_SEQS - len(kv_lens)), np.int32)
    table = np.zeros((MAX_SEQS, PAGES_PER_SEQ), np.int32)
    free = list(rng.permutation(np.arange(1, PAGES)))
    live_pages = set()
    for i, kv in enumerate(kv_lens):
        need = -(-kv // PAGE_SIZE)
        table[i, :need] = [free.pop() for _ in range(need)]
        live_pages |= set(table[i, :need].tolist())
        table[i, need:] = rng.integers(0, PAGES, PAGES_PER_SEQ - need)  # stale ids
    shape = get_kv_cache_shape(PAGES, PAGE_SIZE, KV_HEADS, HEAD_DIM, jnp.float32)
    cache = rng.standard_normal(shape).astype(np.float32)
    for page in range(PAGES):
        if page not in live_pages:
            cache[page] = np.nan
            cache[page, ::3] = np.inf
    for i, kv in enumerate(kv_lens):  # the live pages' slots past kv_len: garbage too
        last, used = table[i, (kv - 1) // PAGE_SIZE], (kv - 1) % PAGE_SIZE + 1
        cache[last, used:] = np.nan
    args = (
        jnp.asarray(rng.standard_normal((TOKENS, Q_HEADS, HEAD_DIM)), jnp.float32),
        jnp.asarray(rng.standard_normal((TOKENS, KV_HEADS, HEAD_DIM)), jnp.float32),
        jnp.asarray(rng.standard_normal((TOKENS, KV_HEADS, HEAD_DIM)), jnp.float32),
        jnp.asarray(cache),
        jnp.asarray(lens),
        jnp.asarray(table.reshape(-1)),
        jnp.asarray(cu_q_lens),
        jnp.asarray([2, 2, len(q_lens)], jnp.int32),
    )
    live = int(cu_q_lens[len(q_lens)])
    (expected_out, expected_cache), (out, cache_out) = run_both(args, sm_scale=HEAD_DIM**-0.5)
    assert not bool(jnp.isnan(expected_out[:live]).any())
    assert not bool(jnp.isnan(out).any())
    assert max_diff(out[:live], expected_out[:live]) < TOLERANCE[jnp.float32]
    same = (cache_out == expected_cache) | (jnp.isnan(cache_out) & jnp.isnan(expected_cache))
    assert bool(same.all())
    assert float(jnp.max(jnp.abs(out[live:]))) == 0
