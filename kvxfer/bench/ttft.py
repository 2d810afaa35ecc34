"""`kvxfer bench ttft`: what the transfer adds to a request's time to first token.

P and D run as two processes (P TP 4, D TP 8, as in `kvxfer bench e2e`), with
8 layers of `[16, 8, 2, 128]` bf16 blocks (64 KiB per block per layer). P
prefills each prompt in chunks of 2,048 tokens, with a model-free forward of
fixed duration per chunk (`forward_ms`: the caches hold random bytes, so the
figures are about the transfer), and saves what the save plan says after
each chunk, as an engine's `wait_for_save` would; it polls its connector
once per step.

- `critical_ms`: from P's last chunk saved to the prompt's KV in D's caches
  (D's `get_finished` returning it), per prompt length, median of
  `repeats`. Without streaming, P hands its params to the parent, which
  relays them to D (a router's hop), and D reads the whole prompt then.
  With streaming, the parent gives D the stream first (a router sends the
  request to both), D subscribes, and reads each chunk's blocks as P names
  them final: at P's last chunk only that chunk is left to read.
- `critical_over_last_chunk`: streaming's critical time at the longest
  prompt over the time to read one chunk alone (the critical time of a
  one-chunk prompt, without streaming).
- `small_request_ms`: the critical time of a 32-block prompt (16 MiB), without
  streaming, and `small_over_memcpy` over numpy's copy of the same bytes in
  D's process (median of 7, in the same run): the fixed cost per request.

The processes share the machine's monotonic clock.
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvxfer.bench import random_caches
from kvxfer.demo.procs import Children, Load, Proc, Reader, Saver, Side, connector, run_child
from kvxfer.plan.blocks import cdiv

__all__ = ["TTFTConfig", "run"]

_STEP_S = 0.0005
"""How long P's and D's loops wait for a message between two steps, as an engine with
nothing scheduled waits (vLLM's steps with no tokens to run take about this long): a loop
that polled without waiting would measure its own spinning, not the library's."""


@dataclass
class TTFTConfig:
    layers: int = 8
    block_size: int = 16
    heads: int = 8
    head_dim: int = 128
    tp_p: int = 4
    tp_d: int = 8
    chunk: int = 2048
    lengths: list[int] = field(default_factory=lambda: [1024, 8192, 32768])
    small_blocks: int = 32
    forward_ms: float = 60.0
    repeats: int = 3
    timeout_s: float = 600.0

    @property
    def num_blocks(self) -> int:
        """Blocks per cache and staging: the longest prompt's, and the null block."""
        return cdiv(max(*self.lengths, self.chunk + self.small_blocks * self.block_size),
                    self.block_size) + 1

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.block_size, self.heads, 2, self.head_dim)

    @property
    def block_bytes(self) -> int:
        """Bytes of one block of one layer (bf16)."""
        return self.block_size * self.heads * 2 * self.head_dim * 2


class _Prefill(Saver):
    """P's engine: one request at a time, in chunks; polls its connector once per step."""

    wait_s = _STEP_S

    def __init__(self, cfg: TTFTConfig, out: Any):
        self.cfg = cfg
        self.caches = random_caches(cfg.layers, cfg.block_shape, cfg.tp_p, cfg.num_blocks, seed=1)
        super().__init__(out, connector("P", self.caches, cfg.num_blocks, cfg.block_size,
                                        lease_s=600.0))

    def command(self, msg: dict[str, Any]) -> None:
        from kvxfer.plan.save_plan import ScheduledRequest

        conn, req_id, prompt = self.conn, msg["run"], msg["prompt"]
        conn.add_request(req_id, prompt, stream=msg.get("stream"))
        table = list(range(1, cdiv(prompt, self.cfg.block_size) + 1))
        done = 0
        while done < prompt:
            self.step()  # the engine's step polls the connector
            n = min(self.cfg.chunk, prompt - done)
            time.sleep(self.cfg.forward_ms / 1e3)  # the forward pass
            step = ScheduledRequest(req_id, done, n, (table,) if done == 0 else None,
                                    full_table=done == 0)
            conn.wait_for_save(self.caches, conn.build_connector_meta([step]))
            done += n
        self.say(req_id=req_id, done=time.monotonic(), params=conn.request_finished(req_id))


class _Decode(Reader):
    """D's engine: loads each request it is given into its own block ids, polling often."""

    wait_s = _STEP_S

    def __init__(self, cfg: TTFTConfig, out: Any):
        caches = random_caches(cfg.layers, cfg.block_shape, cfg.tp_d, cfg.num_blocks, seed=2)
        super().__init__(out, connector("D", caches, cfg.num_blocks, transfer_timeout_s=120.0),
                         caches)
        self.cfg = cfg
        small = cfg.small_blocks * cfg.layers * cfg.block_bytes
        self.src, self.dst = np.ones(small, np.uint8), np.empty(small, np.uint8)

    def command(self, msg: dict[str, Any]) -> None:
        if "memcpy" in msg:
            times = []
            for _ in range(8):
                start = time.perf_counter()
                np.copyto(self.dst, self.src)
                times.append(time.perf_counter() - start)
            self.say(memcpy_s=statistics.median(times[1:]))
            return
        n = self.cfg.num_blocks
        self.load(msg["req_id"], msg["params"], list(range(n - 1, n - 1 - msg["blocks"], -1)))

    def loaded(self, load: Load, now: float) -> None:
        self.say(req_id=load.req_id, ok=True, at=now)

    def lost(self, load: Load, now: float, errors: list[int]) -> None:
        self.say(req_id=load.req_id, ok=False, at=now)


def _side(role: str, fields: dict[str, Any], out: Any) -> Side:
    return (_Prefill if role == "P" else _Decode)(TTFTConfig(**fields), out)


def _one(p: Proc, d: Proc, peer: dict[str, Any], cfg: TTFTConfig, req_id: str, prompt: int,
         stream: bool) -> float:
    """One request through P and D; its critical time in seconds."""
    from kvxfer.nixl.wire import StreamParams, new_stream_id

    blocks = cdiv(prompt, cfg.block_size)
    sid = new_stream_id() if stream else None
    if sid is not None:  # the router sends the request to both
        d.send(req_id=req_id, blocks=blocks,
               params=StreamParams(peer["peer"], peer["host"], peer["port"], sid).to_dict())
    p.send(run=req_id, prompt=prompt, stream=sid)
    finished = p.read()
    if sid is None:
        d.send(req_id=req_id, blocks=blocks, params=finished["params"])
    got = d.read()
    if not got["ok"] or got["req_id"] != req_id:
        raise RuntimeError(f"D failed to load {req_id} ({'streamed' if stream else 'params'})\n"
                           f"{d.tail()}")
    return got["at"] - finished["done"]


def run(cfg: TTFTConfig | None = None) -> dict[str, Any]:
    """Critical times with and without streaming, and the small request's fixed cost."""
    cfg = cfg or TTFTConfig()
    cfg_json = json.dumps(asdict(cfg))
    with Children("kvxfer.bench.ttft", cfg.timeout_s) as children:
        p, d, peer = children.pair(cfg_json, cfg.tp_p, cfg.tp_d)
        small = cfg.small_blocks * cfg.block_size
        for i, prompt in enumerate([small, cfg.chunk, cfg.chunk + small]):  # compile, connect
            for stream in (False, True):
                _one(p, d, peer, cfg, f"warm{i}{stream:d}", prompt, stream)
        times: dict[tuple[int, bool], list[float]] = {}
        runs = [(n, False) for n in dict.fromkeys([small, cfg.chunk, *cfg.lengths])]
        runs += [(n, True) for n in cfg.lengths]
        for r in range(cfg.repeats):
            for prompt, stream in runs:
                times.setdefault((prompt, stream), []).append(
                    _one(p, d, peer, cfg, f"r{r}-{prompt}-{stream:d}", prompt, stream))
        d.send(memcpy=True)
        memcpy_s = d.read()["memcpy_s"]
    ms = {key: 1e3 * statistics.median(v) for key, v in times.items()}
    one_chunk = ms[(cfg.chunk, False)]
    longest = max(cfg.lengths)
    return {
        "critical_ms": {str(n): round(ms[(n, False)], 2) for n in cfg.lengths},
        "critical_ms_streaming": {str(n): round(ms[(n, True)], 2) for n in cfg.lengths},
        "one_chunk_ms": round(one_chunk, 2),
        "critical_over_last_chunk": round(ms[(longest, True)] / one_chunk, 3),
        "small_request_ms": round(ms[(small, False)], 3),
        "small_memcpy_ms": round(1e3 * memcpy_s, 3),
        "small_over_memcpy": round(ms[(small, False)] / (1e3 * memcpy_s), 2),
        "chunk_tokens": cfg.chunk,
        "forward_ms": cfg.forward_ms,
        "repeats": cfg.repeats,
    }


if __name__ == "__main__":
    run_child(_side)
