"""The demo decoder: paged attention equals dense attention, in tpu-inference's cache layout."""

import jax.numpy as jnp
import numpy as np
import pytest

from kvxfer.demo.engine import NewBlocksTracker, Shapes, decode, prefill
from kvxfer.demo.model import ModelConfig, ShardedDecoder, make_mesh, pack_kv, unpack_kv
from kvxfer.errors import InvalidInputError
from kvxfer.plan.save_plan import GroupSpec, SaveTracker, ScheduledRequest

SMALL = dict(hidden=64, layers=2, q_heads=8, kv_heads=4, head_dim=16, mlp=128)


def paged_logits(model, tokens, chunk, decode_from):
    """Prefill `tokens[:decode_from]` in chunks of `chunk`, then one token per step; the
    logits of every position."""
    blocks = -(-len(tokens) // model.cfg.block_size)
    table = list(range(3, 3 + blocks))[::-1]  # scattered, out of order
    return paged_logits_with_table(model, tokens, chunk, decode_from, table,
                                   model.new_caches(blocks + 4))


def paged_logits_with_table(model, tokens, chunk, decode_from, table, caches):
    n = len(tokens)
    out = []
    for start, stop in [(s, min(s + chunk, decode_from)) for s in range(0, decode_from, chunk)] + \
            [(s, s + 1) for s in range(decode_from, n)]:
        width = stop - start
        pad = chunk - width if stop <= decode_from else 0
        tok = np.zeros((1, width + pad), np.int32)
        pos = np.zeros_like(tok)
        valid = np.zeros(tok.shape, bool)
        tok[0, :width], pos[0, :width], valid[0, :width] = tokens[start:stop], range(start, stop), True
        logits, caches = model.step(caches, tok, pos, valid, np.array([table], np.int32))
        out.append(logits[0, :width])
    return np.concatenate(out), caches, table


# Relative to the largest logit. Paged and dense differ by the order of float32 sums, and in
# bf16 by a rounding of one K or V element that this order tips (measured: 1e-4 at worst).
@pytest.mark.parametrize("dtype, tol", [("float32", 1e-5), ("bfloat16", 1e-3),
                                        ("float8_e4m3fn", 1e-3)])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("chunk", [5, 16])
def test_paged_attention_equals_dense_for_chunked_prefill_and_decode(dtype, tol, tp, chunk):
    model = ShardedDecoder(ModelConfig(cache_dtype=dtype, **SMALL), make_mesh(tp))
    tokens = np.random.default_rng(chunk).integers(0, 256, 61)
    dense = model.dense_logits(tokens[None])[0]
    paged, _, _ = paged_logits(model, tokens, chunk, decode_from=50)
    scale = np.abs(dense).max()
    assert np.abs(paged - dense).max() <= tol * scale
    # The check can fail: one token's KV from the wrong position moves the logits after it.
    wrong = tokens.copy()
    wrong[20] = (wrong[20] + 1) % 256
    assert np.abs(model.dense_logits(wrong[None])[0][21:] - dense[21:]).max() > 10 * tol * scale


@pytest.mark.parametrize("dtype, kv_heads", [("bfloat16", 4), ("float8_e4m3fn", 4),
                                             ("float32", 4), ("float8_e4m3fn", 1)])
def test_cache_holds_k_and_v_interleaved_and_packed_as_tpu_inference_does(dtype, kv_heads):
    cfg = ModelConfig(cache_dtype=dtype, **dict(SMALL, kv_heads=kv_heads, q_heads=2 * kv_heads))
    k = np.arange(kv_heads * 16, dtype=np.float32).reshape(kv_heads, 16) / 8
    v = -k - 1
    packed = pack_kv(jnp.asarray(k), jnp.asarray(v), cfg)
    assert packed.shape == cfg.cache_shape(1)[2:] == (-(-2 * kv_heads // cfg.packing), cfg.packing, 16)
    rows = np.asarray(packed.astype(jnp.float32)).reshape(-1, 16)  # row r = word r // p, lane r % p

    def stored(x):
        return np.asarray(jnp.asarray(x).astype(dtype).astype(jnp.float32))

    for h in range(kv_heads):
        assert (rows[2 * h] == stored(k[h])).all() and (rows[2 * h + 1] == stored(v[h])).all()
    assert (rows[2 * kv_heads:] == 0).all()  # fp8 with one KV head: 2 rows padded to 4
    k2, v2 = unpack_kv(packed, cfg)
    assert (np.asarray(k2) == stored(k)).all() and (np.asarray(v2) == stored(v)).all()


def test_each_token_kv_lands_where_its_table_says_in_prefill_and_decode():
    model = ShardedDecoder(ModelConfig(**SMALL), make_mesh(2))
    tokens = np.random.default_rng(0).integers(0, 256, 45)
    logits_a, caches_a, table_a = paged_logits(model, tokens, 16, decode_from=35)
    table_b = [9, 4, 7]
    # The same tokens through another table: the same KV, in the blocks that table names.
    _, caches_b, _ = paged_logits_with_table(model, tokens, 16, 35, table_b, model.new_caches(12))
    for ca, cb in zip(caches_a, caches_b):
        a, b = np.asarray(ca).view(np.uint16), np.asarray(cb).view(np.uint16)
        assert (a[table_a] == b[table_b]).all()
        for pos in (0, 17, 34, 35, 44):  # prefill, a chunk boundary, decode steps
            assert a[table_a[pos // 16], pos % 16].any()
        assert not a[table_a[2], 45 - 32:].any()  # past the last token: unwritten
        others = np.setdiff1d(np.arange(len(a)), table_a)
        assert not a[others].any()  # the null block 0 and every other block untouched


def test_two_tp_sizes_give_the_same_model_up_to_rounding():
    cfg = ModelConfig(**SMALL)
    tokens = np.random.default_rng(1).integers(0, 256, (1, 30))
    one = ShardedDecoder(cfg, make_mesh(1)).dense_logits(tokens)
    four = ShardedDecoder(cfg, make_mesh(4)).dense_logits(tokens)
    assert np.abs(one - four).max() < 1e-3 * np.abs(one).max()
    other = ShardedDecoder(ModelConfig(**dict(SMALL, seed=1)), make_mesh(1)).dense_logits(tokens)
    assert np.abs(one - other).max() > 0.1 * np.abs(one).max()  # the seed picks the weights


def test_engine_prefill_then_decode_matches_dense_greedy_decode():
    model = ShardedDecoder(ModelConfig(**SMALL), make_mesh(2))
    prompts = {"a": np.random.default_rng(2).integers(0, 256, 37).astype(np.int32),
               "b": np.random.default_rng(3).integers(0, 256, 20).astype(np.int32)}
    shapes = Shapes.of([37, 20], 16, budget=24, lookahead=2, decode_tokens=4)
    caches, done = prefill(model, model.new_caches(32), prompts, {"a": 16}, shapes, lookahead=2,
                           num_blocks=12)
    # Step 1: a's 21 uncached tokens and 3 of b's; step 2: b's other 17.
    assert (done["a"].chunks, done["b"].chunks) == (1, 2)
    table = done["a"].table  # cdiv(37 + 2, 16) = 3 blocks: room for the 3 tokens decoded past it
    caches, out = decode(model, caches, prompts["a"], table, 4, shapes)
    seq = list(prompts["a"])
    for _ in range(4):  # dense greedy decode from scratch
        seq.append(int(np.argmax(model.dense_logits(np.array([seq]))[0, -1])))
    assert out.tokens == seq[37:]


def test_a_step_past_its_table_or_outside_the_cache_is_refused_not_dropped():
    model = ShardedDecoder(ModelConfig(**SMALL), make_mesh(1))
    shapes = Shapes.of([20], 16, budget=8, lookahead=0, decode_tokens=4)
    caches = model.new_caches(8)
    prompt = np.arange(20, dtype=np.int32)
    with pytest.raises(InvalidInputError, match=r"does not fit 20 prompt tokens \+ 4 decoded"):
        decode(model, caches, prompt, [3], 4, shapes)  # 23 tokens in one 16-token block
    with pytest.raises(InvalidInputError, match=r"block ids \[8\] are outside \[1, 8\)"):
        decode(model, caches, prompt, [3, 8], 4, shapes)
    with pytest.raises(InvalidInputError, match=r"block ids \[0\] are outside"):
        decode(model, caches, prompt, [0, 2], 4, shapes)  # the null block


def test_model_config_and_tp_reject_bad_values_by_name():
    with pytest.raises(InvalidInputError, match="q_heads 6 is not a multiple of kv_heads 4"):
        ModelConfig(**dict(SMALL, q_heads=6))
    with pytest.raises(InvalidInputError, match="head_dim 15 must be even"):
        ModelConfig(head_dim=15)
    with pytest.raises(InvalidInputError, match=r"seed must be an int in \[0, 2\*\*32\), got -1"):
        ModelConfig(seed=-1)
    with pytest.raises(InvalidInputError, match="cache dtype 'int4'"):
        ModelConfig(cache_dtype="int4")
    with pytest.raises(InvalidInputError, match=r"--tp-d 3 does not split .* use one of \[1, 2, 4, 8\]"):
        ModelConfig().check_tp(3, "--tp-d")
    with pytest.raises(InvalidInputError, match="TP 16 needs 16 devices"):
        make_mesh(16)


def test_old_rule_tracker_copies_only_new_blocks_and_leaves_the_straddling_block_stale():
    old, new = NewBlocksTracker([GroupSpec(16)]), SaveTracker([GroupSpec(16)])
    for t in (old, new):
        t.add("r", 40)
    step1 = ScheduledRequest("r", 0, 24, ([1, 2],), full_table=True)
    step2 = ScheduledRequest("r", 24, 16, ([3],))
    assert old.plan([step1]) == new.plan([step1]) == {"r": ([1, 2],)}
    assert old.plan([step2]) == {"r": ([3],)}  # tokens 24-31 in block 2 never copied
    assert new.plan([step2]) == {"r": ([2, 3],)}
