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
