"""`kvxfer bench e2e`: the whole path, from P's device caches into D's, against memcpy.

P (TP 4) and D (TP 8) run as two processes, as in `kvxfer demo`; the parent
relays each finished request's `kv_transfer_params` from P to D as a router
would. Both sides have 8 layers of 2,048 blocks of `[16, 8, 2, 128]` bf16
(64 KiB per block per layer) and a 2,048-block staging per side.

1. **Stream.** 64 requests with prompt lengths drawn from 128 to 8,192
   tokens. P admits a request when its blocks fit in the cache, prefills all
   admitted requests in chunks (a 4,096-token budget per step, allocating
   blocks per chunk as vLLM does), saves what `SaveTracker` plans through
   `PrefillConnector`, and frees a request's blocks once D has read it. D
   starts each request as soon as its params arrive, into its own block ids,
   and frees them once its KV is in the caches. `e2e_gbps` is the bytes
   delivered into D's caches per second of wall time, from P's first step to
   D's last delivery, less P's simulated scheduling and forward time (the
   forward pass writes no KV here: the caches hold random bytes from the
   start). Every block is verified on D against P's fingerprints.
2. **Latency.** 16 requests of 2,048 tokens, one at a time: from P's
   `request_finished` to D's `get_finished` returning the KV in D's caches
   (the processes share the machine's monotonic clock). `verify_overhead` is
   what verification adds to D's path, over that request's path time: after
   each delivery, D scatters the request's blocks again (the same bytes, from
   host rows as staging holds them) with and without the fingerprints it
   checks, and takes the difference of the best of three. `d_held_ms_2k` is
   how long D's engine thread spends in kvxfer while the request is read
   (median): in `start_load_kv` and in the `get_finished` calls before the one
   that delivers it. The READ is posted on a thread of its own, so it should
   not hold the engine; D writes the blocks into its caches as soon as they
   are read (while its `done` and P's ack travel), so that scatter counts here.
3. **Scatter.** 64 blocks into 256-block and 4,096-block caches on D's mesh:
   the cost must not grow with the cache.

With `stats=False` neither side collects counters or traces (`ConnectorConfig.
stats`), to measure what collecting costs; with `seal=True` P seals what it stages
(`ConnectorConfig.seal_kv`) and D opens it, to measure what encrypting the staged KV
costs; `trace=N` returns the P and D
traces of the last N latency requests (`traces`), which `kvxfer bench e2e
--trace N` prints as a table and draws as a timeline.

The reference is numpy's copy of a 256 MiB buffer into another, measured in D's
process before and after the stream (median); `*_over_memcpy` divide by it.
"""

from __future__ import annotations

import json
import statistics
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvxfer.bench import memcpy_gbps, random_caches
from kvxfer.demo.procs import Children, Load, Proc, Reader, Saver, Side, connector, profile_dir, run_child
from kvxfer.plan.blocks import cdiv

__all__ = ["E2EConfig", "run"]

_MEMCPY_BYTES = 256 << 20


@dataclass
class E2EConfig:
    layers: int = 8
    num_blocks: int = 2048
    block_size: int = 16
    heads: int = 8
    head_dim: int = 128
    tp_p: int = 4
    tp_d: int = 8
    requests: int = 64
    min_prompt: int = 128
    max_prompt: int = 8192
    budget: int = 4096
    latency_requests: int = 16
    latency_prompt: int = 2048
    scatter_blocks: int = 64
    scatter_caches: tuple[int, int] = (256, 4096)
    seed: int = 0
    timeout_s: float = 600.0
    stats: bool = True
    trace: int = 0
    seal: bool = False

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.block_size, self.heads, 2, self.head_dim)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer (bf16)."""
        return int(np.prod(self.block_shape)) * 2


# -- P ---------------------------------------------------------------------------------


class _Prefill(Saver):
    """P's engine loop: admission, chunked scheduling, saves, frees."""

    def __init__(self, cfg: E2EConfig, out: Any):
        self.cfg = cfg
        self.caches = random_caches(cfg.layers, cfg.block_shape, cfg.tp_p, cfg.num_blocks, seed=1)
        super().__init__(out, connector("P", self.caches, cfg.num_blocks, cfg.block_size,
                                        stats=cfg.stats, seal_kv=cfg.seal, lease_s=600.0))
        self.free = deque(range(1, cfg.num_blocks))
        self.pool, self.committed = len(self.free), 0
        self.tables: dict[str, list[int]] = {}
        self.prompts: dict[str, int] = {}
        self.computed: dict[str, int] = {}
        self.waiting: deque[tuple[str, int]] = deque()
        self.forward_s = 0.0  # simulated scheduling: excluded from the path's time
        self.save_s = 0.0

    def command(self, msg: dict[str, Any]) -> None:
        if "stream" in msg:
            self.waiting.extend((f"{msg['name']}{i}", prompt) for i, prompt in enumerate(msg["stream"]))
        elif "report" in msg:
            self.say(forward_s=self.forward_s, save_s=self.save_s)
        elif "traces" in msg:
            self.say(traces=[t.to_dict() for t in self.conn.traces()[-msg["traces"]:]])

    def step(self) -> None:
        from kvxfer.plan.save_plan import ScheduledRequest

        t0 = time.monotonic()
        bs = self.cfg.block_size
        # Admit a request once its whole prompt's blocks are free of other admitted ones.
        while self.waiting and self.committed + cdiv(self.waiting[0][1], bs) <= self.pool:
            req_id, prompt = self.waiting.popleft()
            self.committed += cdiv(prompt, bs)
            self.conn.add_request(req_id, prompt)
            self.tables[req_id], self.prompts[req_id], self.computed[req_id] = [], prompt, 0
        budget, scheduled = self.cfg.budget, []
        for req_id, table in self.tables.items():
            remaining = self.prompts[req_id] - self.computed[req_id]
            if budget <= 0 or remaining <= 0:
                continue
            n = min(budget, remaining)
            budget -= n
            first = not table
            added = [self.free.popleft()
                     for _ in range(cdiv(self.computed[req_id] + n, bs) - len(table))]
            table.extend(added)
            scheduled.append(ScheduledRequest(req_id, self.computed[req_id], n,
                                              ([*table],) if first else (added,), full_table=first))
            self.computed[req_id] += n
        t1 = time.monotonic()
        self.forward_s += t1 - t0
        if scheduled:
            meta = self.conn.build_connector_meta(scheduled)
            self.conn.wait_for_save(self.caches, meta)
            done = time.monotonic()
            self.save_s += done - t1
            for req_id in sorted(meta.completed):
                params = self.conn.request_finished(req_id)
                self.say(params=params, done=done, blocks=len(self.tables[req_id]))
        for req_id in self.conn.get_finished():
            table = self.tables.pop(req_id)
            self.free.extend(table)
            self.committed -= len(table)
            del self.prompts[req_id], self.computed[req_id]


# -- D ---------------------------------------------------------------------------------


class _Decode(Reader):
    """D's engine loop: starts each request once its blocks are free, in arrival order;
    frees them once its KV is in the caches."""

    def __init__(self, cfg: E2EConfig, out: Any):
        self.cfg, self.memcpy = cfg, [memcpy_gbps(_MEMCPY_BYTES)]
        caches = random_caches(cfg.layers, cfg.block_shape, cfg.tp_d, cfg.num_blocks, seed=2)
        super().__init__(out, connector("D", caches, cfg.num_blocks, stats=cfg.stats), caches)
        self.free = deque(range(cfg.num_blocks - 1, 0, -1))  # D's ids differ from P's
        self.waiting: deque[dict[str, Any]] = deque()

    def command(self, msg: dict[str, Any]) -> None:
        if "params" in msg:
            self.waiting.append(msg)
        elif "traces" in msg:
            self.say(traces=[t.to_dict() for t in self.conn.traces()[-msg["traces"]:]])
        elif "scatter" in msg:
            self.memcpy.append(memcpy_gbps(_MEMCPY_BYTES))
            self.say(memcpy_gbps=statistics.median(self.memcpy), **_scatter_figures(self.cfg))

    def step(self) -> None:
        while self.waiting and self.waiting[0]["blocks"] <= len(self.free):
            msg = self.waiting.popleft()
            self.load(msg["params"]["req_id"], msg["params"],
                      [self.free.popleft() for _ in range(msg["blocks"])])
        super().step()

    def loaded(self, load: Load, now: float) -> None:
        verify_s = 0.0
        if load.req_id.startswith("lat"):
            self.caches, verify_s = _verify_cost(self.caches, load.table)
        self.free.extend(load.table)
        self.say(req_id=load.req_id, ok=True, at=now,
                 bytes=len(load.table) * self.cfg.block_bytes * self.cfg.layers,
                 verify_s=verify_s, held_s=load.held_s)

    def lost(self, load: Load, now: float, errors: list[int]) -> None:
        self.free.extend(load.table)
        self.say(req_id=load.req_id, ok=False, at=now)


def _verify_cost(caches: list[Any], table: list[int]) -> tuple[list[Any], float]:
    """What verifying costs D's path: the same scatter of the request's blocks (its
    own bytes again, from host rows as staging holds them) with and without the
    fingerprints D checks, best of three each."""
    from kvxfer.device.gather import gather_blocks, scatter_blocks

    rows = [np.asarray(h)[: len(table)] for h in gather_blocks(caches, table)]
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(3):
        for fingerprints in (False, True):
            start = time.perf_counter()
            out = scatter_blocks(caches, rows, table, fingerprints=fingerprints)
            times[fingerprints].append(time.perf_counter() - start)
            caches = out[0] if fingerprints else out
    return caches, max(min(times[True]) - min(times[False]), 0.0)


def _scatter_figures(cfg: E2EConfig) -> dict[str, float]:
    from kvxfer.device.gather import scatter_blocks

    n = cfg.scatter_blocks
    rows = [np.random.default_rng(layer).integers(0, 1 << 16, (n, *cfg.block_shape), np.uint16)
            for layer in range(cfg.layers)]
    figures = {}
    for name, num_blocks in zip(("scatter_ms_small_cache", "scatter_ms_big_cache"),
                                cfg.scatter_caches):
        caches = random_caches(cfg.layers, cfg.block_shape, cfg.tp_d, num_blocks, seed=3)
        host = [r.view(caches[0].dtype) for r in rows]
        # No two ids adjacent, in either cache: the same per-block copies in both.
        ids = 2 * np.random.default_rng(4).choice(num_blocks // 2, n, replace=False)
        times = []
        for _ in range(12):
            start = time.perf_counter()
            caches = scatter_blocks(caches, host, ids)
            times.append(time.perf_counter() - start)
        figures[name] = 1e3 * min(times[1:])  # the first call copies caches numpy shares
        del caches
    figures["scatter_growth"] = figures["scatter_ms_big_cache"] / figures["scatter_ms_small_cache"]
    return figures


def _side(role: str, fields: dict[str, Any], out: Any) -> Side:
    cfg = E2EConfig(**{**fields, "scatter_caches": tuple(fields["scatter_caches"])})
    return (_Prefill if role == "P" else _Decode)(cfg, out)


# -- the parent ------------------------------------------------------------------------


def _relay(children: Children, p: Proc, d: Proc, count: int
           ) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Forward `count` finished requests from P to D; returns (P's, D's) message pairs."""
    sent: dict[str, dict[str, Any]] = {}
    results = []

    def handle(proc: Proc, msg: dict[str, Any]) -> None:
        if proc is p:
            sent[msg["params"]["req_id"]] = msg
            d.send(**msg)
        else:
            results.append((sent.pop(msg["req_id"]), msg))

    children.relay(handle, lambda: len(results) >= count, f"{count} requests from P to D")
    return results


def run(cfg: E2EConfig | None = None) -> dict[str, Any]:
    """Run the three parts; returns the figures as a JSON-able dict."""
    cfg = cfg or E2EConfig()
    profile_dir()  # a bad KVXFER_PROFILE is refused before any child starts
    cfg_json = json.dumps(asdict(cfg))
    with Children("kvxfer.bench.e2e", cfg.timeout_s) as children:
        p, d, _ = children.pair(cfg_json, cfg.tp_p, cfg.tp_d)
        # Warm up: compile every bucket the stream can use, on both sides.
        warm = [cfg.block_size * (1 << k) for k in range(3, 10)]
        p.send(stream=[min(w, cfg.max_prompt) for w in warm], name="warm")
        _check(_relay(children, p, d, len(warm)))

        rng = np.random.default_rng(cfg.seed)
        prompts = rng.integers(cfg.min_prompt, cfg.max_prompt + 1, cfg.requests).tolist()
        p.send(report=True)
        before = p.read()
        start = time.monotonic()
        p.send(stream=prompts, name="req")
        stream = _check(_relay(children, p, d, cfg.requests))
        wall = max(r["at"] for _, r in stream) - start
        p.send(report=True)
        after = p.read()
        forward_s = after["forward_s"] - before["forward_s"]
        delivered = sum(r["bytes"] for _, r in stream)

        latencies, verify, holds = [], [], []
        for i in range(cfg.latency_requests):
            p.send(stream=[cfg.latency_prompt], name=f"lat{i}-")
            (sent, got), = _check(_relay(children, p, d, 1))
            latencies.append(got["at"] - sent["done"])
            verify.append(got["verify_s"] / latencies[-1])
            holds.append(got["held_s"])
        lat_bytes = cdiv(cfg.latency_prompt, cfg.block_size) * cfg.layers * cfg.block_bytes

        traces = []
        if cfg.trace:
            for proc in (p, d):
                proc.send(traces=cfg.trace)
                traces += proc.read()["traces"]
        d.send(scatter=True)
        figures = d.read()
    memcpy = figures.pop("memcpy_gbps")
    e2e = delivered / max(wall - forward_s, 1e-9) / 1e9
    p50 = statistics.median(latencies)
    p99 = float(np.percentile(latencies, 99))
    return {
        "e2e_gbps": round(e2e, 3),
        "memcpy_gbps": round(memcpy, 3),
        "e2e_over_memcpy": round(e2e / memcpy, 3),
        "p50_ms_2k": round(1e3 * p50, 2),
        "p99_ms_2k": round(1e3 * p99, 2),
        "latency_2k_over_memcpy": round(p50 / (lat_bytes / (memcpy * 1e9)), 2),
        "scatter_ms_small_cache": round(figures["scatter_ms_small_cache"], 2),
        "scatter_ms_big_cache": round(figures["scatter_ms_big_cache"], 2),
        "scatter_growth": round(figures["scatter_growth"], 2),
        "verify_overhead": round(statistics.median(verify), 3),
        "d_held_ms_2k": round(1e3 * statistics.median(holds), 3),
        "stream_requests": cfg.requests,
        "stream_gb": round(delivered / 1e9, 3),
        "stream_wall_s": round(wall, 3),
        "p_forward_s": round(forward_s, 3),
        "p_save_s": round(after["save_s"] - before["save_s"], 3),
        "stats": cfg.stats,
        "seal": cfg.seal,
        **({"traces": traces} if cfg.trace else {}),
    }


def _check(pairs: list[tuple[dict[str, Any], dict[str, Any]]]) -> list[Any]:
    bad = [r["req_id"] for _, r in pairs if not r["ok"]]
    if bad:
        raise RuntimeError(f"D failed to load {bad}")
    return pairs


if __name__ == "__main__":
    run_child(_side)
