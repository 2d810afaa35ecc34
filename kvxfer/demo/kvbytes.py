"""`kvxfer kvbytes`: random KV bytes in any cache layout, P to D in two processes.

The layout check beside `kvxfer demo` (which runs a real model). P shards its
KV caches over its own CPU (or TPU) devices, prefills several prompts in
chunks (with a straddling block, speculative lookahead blocks and a
prefix-cache hit), writing random KV for each token, and saves what
`SaveTracker` plans through `PrefillConnector`. D, in its own process with its
own mesh, reads each finished request over NIXL into its own block ids,
checks P's fingerprints, scatters into its caches, and compares every prompt
token's KV with what P computed, byte for byte.

The parent only relays `kv_transfer_params` from P to D, as a router would.
Processes talk JSON lines over pipes; every wait has a deadline.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from kvxfer.demo.procs import Children, Load, Reader, Saver, Side, connector, run_child
from kvxfer.errors import InvalidInputError, KvxferError
from kvxfer.plan.blocks import cdiv, is_int

__all__ = ["BytesConfig", "LAYOUTS", "cache_shape", "report_bytes", "run_bytes", "token_rows"]

LAYOUTS = ("attention", "mla", "attention4d")


@dataclass
class BytesConfig:
    """One demo run. Layouts: tpu-inference attention (5-D), MLA, the older 4-D."""

    layout: str = "attention"
    dtype: str = "bfloat16"
    layers: int = 4
    num_blocks: int = 256
    block_size: int = 16
    heads: int = 8  # kv heads (K and V interleave to 2 * heads rows)
    head_dim: int = 128
    tp_p: int = 4
    tp_d: int = 8
    prompts: list[int] = field(default_factory=lambda: [40, 300, 517, 130])
    cached: list[int] = field(default_factory=lambda: [0, 0, 64, 0])
    budget: int = 96
    lookahead: int = 3
    seed: int = 0
    timeout_s: float = 120.0

    def validate(self) -> None:
        """Raise `InvalidInputError` naming the first bad field (by its flag) and value.

        `run_demo` calls it before starting any process, so a bad setting fails
        at once in the parent rather than as a child's crash, or a P that never
        finishes prefilling, found only when a read times out.
        """
        flags = {"layout", "dtype", "layers", "num_blocks", "block_size", "tp_p", "tp_d", "budget"}
        dtypes = ("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2", "int8")
        max_tp = 8  # the CPU devices a child emulates; kept for TPU runs too, for simplicity

        def name(f: str) -> str:
            return "--" + f.replace("_", "-") if f in flags else f"BytesConfig.{f}"

        if self.layout not in LAYOUTS:
            raise InvalidInputError(
                f"unknown demo layout {self.layout!r}; choose one of {', '.join(LAYOUTS)}")
        if self.dtype not in dtypes:
            raise InvalidInputError(
                f"{name('dtype')} {self.dtype!r} is not one of {', '.join(dtypes)}")
        for f in ("layers", "num_blocks", "block_size", "heads", "head_dim", "budget",
                  "tp_p", "tp_d"):
            value = getattr(self, f)
            if not is_int(value) or value <= 0:
                raise InvalidInputError(f"{name(f)} must be a positive int, got {value!r}")
        for f in ("lookahead", "seed"):
            value = getattr(self, f)
            if not is_int(value) or value < 0:
                raise InvalidInputError(f"{name(f)} must be a non-negative int, got {value!r}")
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
            raise InvalidInputError(f"{name('timeout_s')} must be a positive number, got {t!r}")
        shape = cache_shape(self)  # raises for an MLA block size the packing does not divide
        for f in ("tp_p", "tp_d"):
            tp = getattr(self, f)
            if tp > max_tp:
                raise InvalidInputError(
                    f"{name(f)} {tp} is more than the {max_tp} devices the demo gives a side")
            # MLA caches are replicated; the others shard axis 2 (K/V heads) over the model axis.
            if self.layout != "mla" and shape[2] % tp:
                fits = [n for n in range(1, max_tp + 1) if shape[2] % n == 0]
                raise InvalidInputError(
                    f"{name(f)} {tp} does not divide the {shape[2]} head rows of the "
                    f"{self.layout} cache {shape}; use one of {fits}")
        prompts, cached = self.prompts, self.cached
        if (not isinstance(prompts, (list, tuple)) or not prompts
                or not all(is_int(n) and n > 0 for n in prompts)):
            raise InvalidInputError(
                f"{name('prompts')} must be a non-empty list of positive ints, got {prompts!r}")
        if not isinstance(cached, (list, tuple)) or len(cached) != len(prompts):
            raise InvalidInputError(
                f"{name('cached')} {cached!r} must give one prefix hit per prompt of {prompts}")
        for i, (hit, prompt) in enumerate(zip(cached, prompts)):
            if not is_int(hit) or not 0 <= hit < prompt or hit % self.block_size:
                raise InvalidInputError(
                    f"{name('cached')}[{i}] {hit!r} must be a multiple of {name('block_size')} "
                    f"{self.block_size} in [0, prompt {prompt})")
        # P's engine allocates up to prompt + lookahead tokens per request and frees
        # nothing until the end; block 0 is the null block.
        need = sum(cdiv(n + self.lookahead, self.block_size) for n in prompts)
        if need > self.num_blocks - 1:
            raise InvalidInputError(
                f"prompts {list(prompts)} with lookahead {self.lookahead} need {need} blocks of "
                f"{self.block_size} tokens, more than the {self.num_blocks - 1} usable of "
                f"{name('num_blocks')} {self.num_blocks}; raise {name('num_blocks')} or lower "
                f"the prompts")


def cache_shape(cfg: BytesConfig) -> tuple[int, ...]:
    """Per-layer global cache shape of the chosen layout."""
    p = 32 // (8 * _itemsize(cfg.dtype))
    if cfg.layout == "attention":
        return (cfg.num_blocks, cfg.block_size, cdiv(2 * cfg.heads, p), p, cfg.head_dim)
    if cfg.layout == "mla":
        if cfg.block_size % p:
            raise InvalidInputError(f"--block-size {cfg.block_size} must be a multiple of {p} "
                                    f"for an MLA cache of {cfg.dtype}")
        return (cfg.num_blocks, cfg.block_size // p, p, cfg.head_dim)
    if cfg.layout == "attention4d":
        return (cfg.num_blocks, cfg.block_size, 2 * cfg.heads, cfg.head_dim)
    raise KvxferError(f"unknown demo layout {cfg.layout!r}; choose one of {LAYOUTS}")


def _itemsize(dtype: str) -> int:
    import jax.numpy as jnp

    return jnp.dtype(dtype).itemsize


# -- the two sides, each in its own process ------------------------------------------


def _caches(cfg: BytesConfig, tp: int):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    devices = np.array(jax.devices()[:tp]).reshape(1, tp)
    mesh = Mesh(devices, ("data", "model"))
    spec = PartitionSpec() if cfg.layout == "mla" else PartitionSpec(None, None, "model")
    sharding = NamedSharding(mesh, spec)
    shape = cache_shape(cfg)
    return [jax.device_put(jnp.zeros(shape, cfg.dtype), sharding) for _ in range(cfg.layers)]


def token_rows(cache, table, n_tokens: int, block_size: int):
    """The KV of tokens `[0, n_tokens)` through a block table, as `[n_tokens, rest]` numpy.

    Every demo layout keeps a block's tokens on its leading inner axes
    (attention: axis 1; MLA: axes 1-2, `(block / p, p)`), so a block reshapes
    to `[block_size, rest]`.
    """
    import numpy as np

    host = np.asarray(cache)
    per_block = host.reshape(host.shape[0], block_size, -1)[np.asarray(table)]
    return per_block.reshape(len(table) * block_size, -1)[:n_tokens]


def _writer(cfg: BytesConfig, caches):
    """A jitted 'forward pass': writes given rows at (block, offset) token positions."""
    import jax

    shape, shardings = caches[0].shape, [c.sharding for c in caches]
    tpb = cfg.block_size

    def write(caches, blocks, offsets, rows):
        # On the bits: a float scatter may canonicalize NaN payloads of other blocks.
        out = []
        for cache, row in zip(caches, rows):
            bits = jax.numpy.dtype(f"uint{8 * cache.dtype.itemsize}")
            flat = jax.lax.bitcast_convert_type(cache, bits).reshape(shape[0], tpb, -1)
            flat = flat.at[blocks, offsets].set(jax.lax.bitcast_convert_type(row, bits), mode="drop")
            out.append(jax.lax.bitcast_convert_type(flat.reshape(shape), cache.dtype))
        return out

    return jax.jit(write, out_shardings=shardings, donate_argnums=0)


class _Prefill(Saver):
    """P: prefills every prompt in chunks, writing random KV for each token, and saves what
    `SaveTracker` plans; then holds them for D's reads until told to stop."""

    wait_s = 0.01

    def __init__(self, cfg: BytesConfig, out):
        import numpy as np

        caches = _caches(cfg, cfg.tp_p)
        super().__init__(out, connector("P", caches, cfg.num_blocks, cfg.block_size))
        self.cfg, self.caches, self.write = cfg, caches, _writer(cfg, caches)
        self.rng = np.random.default_rng(cfg.seed)

    def run(self) -> None:
        import numpy as np

        from kvxfer.plan.save_plan import GroupSpec
        from kvxfer.plan.simulate import SimEngine

        cfg, conn = self.cfg, self.conn
        engine = SimEngine([GroupSpec(cfg.block_size)], num_blocks=cfg.num_blocks,
                           lookahead=cfg.lookahead)
        for i, (prompt, hit) in enumerate(zip(cfg.prompts, cfg.cached)):
            engine.add(f"req{i}", prompt, hit)
            conn.add_request(f"req{i}", prompt)
        pending = set(engine.requests)
        steps, copies = 0, Counter()
        while pending:
            scheduled = engine.schedule(cfg.budget)
            for s in scheduled:
                # A new request's first step also writes its prefix-cache hit's KV.
                start = 0 if s.full_table else s.num_computed_tokens
                self.forward(start, s.num_computed_tokens + s.num_scheduled_tokens,
                             engine.requests[s.req_id].tables[0])
            engine.forward(scheduled)
            meta = conn.build_connector_meta(scheduled)
            conn.wait_for_save(self.caches, meta)
            steps += 1
            for req_id, ids in meta.kernel_ids.items():
                copies.update((req_id, k) for k in ids)
            for req_id in meta.completed:
                req = engine.requests[req_id]
                expected = tempfile.NamedTemporaryFile(suffix=".npy", delete=False).name
                np.save(expected, np.stack([
                    token_rows(c, req.tables[0], req.num_prompt_tokens, cfg.block_size).view(np.uint8)
                    for c in self.caches]))
                self.say(params=conn.request_finished(req_id), expected=expected,
                         prompt=req.num_prompt_tokens)
                pending.discard(req_id)
            self.step()
        self.wait_freed(len(cfg.prompts), cfg.timeout_s)
        self.say(freed=sorted(self.freed), steps=steps, copied=sum(copies.values()),
                 recopied=sum(1 for n in copies.values() if n > 1))

    def forward(self, start: int, stop: int, table: list[int]) -> None:
        """Random KV for tokens `[start, stop)` through `table`, padded to a bucket (padding
        rows land past the last block and are dropped) so a new token count does not compile
        a new program."""
        import jax.numpy as jnp
        import numpy as np

        from kvxfer.device.gather import bucket_size

        cfg, caches = self.cfg, self.caches
        n, row_bytes = stop - start, int(np.prod(caches[0].shape[1:])) // cfg.block_size
        bucket = bucket_size(n)
        pos = np.arange(start, start + bucket)
        blocks = np.full(bucket, cfg.num_blocks)
        blocks[:n] = np.asarray(table)[pos[:n] // cfg.block_size]
        rows = [self.rng.integers(0, 256, (bucket, row_bytes * caches[0].dtype.itemsize),
                                  np.uint8).view(caches[0].dtype) for _ in caches]
        self.caches = self.write(caches, jnp.asarray(blocks), jnp.asarray(pos % cfg.block_size),
                                 rows)


class _Decode(Reader):
    """D: reads each request the router forwards into its own block ids, as soon as it
    arrives, and compares every prompt token's KV with P's."""

    def __init__(self, cfg: BytesConfig, out):
        caches = _caches(cfg, cfg.tp_d)
        super().__init__(out, connector("D", caches, cfg.num_blocks), caches)
        self.cfg = cfg
        self.free = list(range(cfg.num_blocks - 1, 0, -1))  # D's ids: reversed, unlike P's

    def command(self, msg: dict[str, Any]) -> None:
        table = [self.free.pop(0) for _ in range(cdiv(msg["prompt"], self.cfg.block_size))]
        self.load(msg["params"]["req_id"], msg["params"], table, expected=msg["expected"],
                  prompt=msg["prompt"])

    def loaded(self, load: Load, now: float) -> None:
        import numpy as np

        prompt, expected = load.about["prompt"], load.about["expected"]
        want = np.load(expected)
        got = np.stack([token_rows(c, load.table, prompt, self.cfg.block_size).view(np.uint8)
                        for c in self.caches])
        bad = int((got != want).any(axis=(0, 2)).sum())
        self.say(req_id=load.req_id, ok=bad == 0, stale_tokens=bad, tokens=prompt,
                 mb=want.nbytes / 1e6, seconds=time.perf_counter() - load.started)
        os.unlink(expected)

    def lost(self, load: Load, now: float, errors: list[int]) -> None:
        self.say(req_id=load.req_id, ok=False, error="load failed", logical_blocks=errors)


def _side(role: str, fields: dict[str, Any], out) -> Side:
    return (_Prefill if role == "P" else _Decode)(BytesConfig(**fields), out)


# -- the parent: start both, relay params, collect results ----------------------------


def run_bytes(cfg: BytesConfig) -> dict[str, Any]:
    """Run P and D as two processes; returns per-request results and totals."""
    cfg.validate()  # reject a bad setting before starting anything
    cfg_json = json.dumps(asdict(cfg))
    with Children("kvxfer.demo.kvbytes", cfg.timeout_s) as children:
        p, d, _ = children.pair(cfg_json, max(cfg.tp_p, 1), max(cfg.tp_d, 1))
        for _ in cfg.prompts:
            d.send(**p.read())  # relay each finished request's kv_transfer_params at once
        results = sorted((d.read() for _ in cfg.prompts), key=lambda r: r["req_id"])
        p_side = p.read()
    return {"ok": all(r["ok"] for r in results), "requests": results,
            "p_freed": p_side["freed"], "p_steps": p_side["steps"],
            "p_blocks_copied": p_side["copied"], "p_blocks_recopied": p_side["recopied"]}


def report_bytes(result: dict[str, Any], cfg: BytesConfig) -> list[str]:
    lines = [f"P: TP {cfg.tp_p}, D: TP {cfg.tp_d}, layout {cfg.layout} {cfg.dtype}, "
             f"{cfg.layers} layers, block {cfg.block_size}, budget {cfg.budget}, "
             f"lookahead {cfg.lookahead}",
             f"P: {len(cfg.prompts)} prompts prefilled in {result['p_steps']} steps; "
             f"{result['p_blocks_copied']} block copies to staging, {result['p_blocks_recopied']} "
             f"blocks copied again after a chunk boundary"]
    for r in result["requests"]:
        if r["ok"]:
            lines.append(f"{r['req_id']}: {r['tokens']} prompt tokens on D equal P's, byte for "
                         f"byte ({r['mb']:.2f} MB; read, verify, scatter in {r['seconds']:.3f} s)")
        else:
            lines.append(f"{r['req_id']}: FAILED {r}")
    lines.append(f"P freed after D's reads: {', '.join(result['p_freed'])}")
    lines.append("all requests intact" if result["ok"] else "SOME REQUESTS FAILED")
    return lines


if __name__ == "__main__":
    run_child(_side)
