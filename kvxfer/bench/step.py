"""`kvxfer bench step`: what the connector calls cost an engine step when nothing moves.

vLLM calls a connector every engine step: on P `build_connector_meta` (its
scheduler side), `wait_for_save` and `get_finished`; on D `start_load_kv` and
`get_finished`. A real D calls `get_finished` thousands of times per request,
so their cost must follow the requests in flight, never the model's layers.
P (TP 4) and D (TP 4) run in this process, each with its NIXL agent, with
caches of `layers` layers, the same arrays every step.

- `idle_step_us`: one engine step of the slower side with no request in flight,
  by layer count (median of `steps`); `idle_step_us_by_side` gives both.
- `busy_step_us`: the same with 8 streamed requests in flight: P has saved their
  first chunk and D is reading them, waiting for P's next.
- `busy_calls_us`: each call's median, by layer count, in the busy step.
- `layers_80_over_32`: idle and busy steps at 80 layers over 32 (target <= 1.2).
- `in_flight`: D's reads still under way after the busy rounds; `ok` is false (and the
  command exits 1) unless all 8 were, at every layer count.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from kvxfer.bench import random_caches
from kvxfer.connector.config import ConnectorConfig
from kvxfer.connector.decode import DecodeConnector
from kvxfer.connector.prefill import PrefillConnector
from kvxfer.connector.scheduler import LoadRequest
from kvxfer.nixl.agent import TransportConfig
from kvxfer.nixl.wire import StreamParams, new_stream_id
from kvxfer.plan.save_plan import GroupSpec, ScheduledRequest

__all__ = ["run"]

_BLOCK_SHAPE = (16, 4, 2, 32)  # [tokens, kv heads x2 / p, p, head dim]: 8 KiB bf16 per layer
_BLOCKS = 64
_IN_FLIGHT = 8


def _median_us(call: Callable[[], Any], steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


class _Engines:
    """P and D connectors in this process, stepped as their engines would."""

    def __init__(self, layers: int, seed: int):
        import jax

        tp = 4 if len(jax.devices()) >= 8 else 1
        self.p_caches = random_caches(layers, _BLOCK_SHAPE, tp, _BLOCKS, seed)
        d_caches = random_caches(layers, _BLOCK_SHAPE, tp, _BLOCKS, seed + 1)
        if tp > 1:  # D on the other four devices
            d_caches = [jax.device_put(c, _other_devices(c)) for c in d_caches]
        self.d_caches = d_caches
        common = dict(staging_blocks=_BLOCKS, precompile=False)
        self.p = PrefillConnector(ConnectorConfig(TransportConfig(f"step-P{layers}"), **common),
                                  [GroupSpec(16)], self.p_caches)
        self.d = DecodeConnector(ConnectorConfig(TransportConfig(
            f"step-D{layers}", transfer_timeout_s=600.0), **common), self.d_caches)

    def p_step(self, steps: list[ScheduledRequest] | None = None) -> None:
        meta = self.p.build_connector_meta(steps or [])
        self.p.wait_for_save(self.p_caches, meta)
        self.p.get_finished()

    def d_step(self, loads: dict[str, LoadRequest] | None = None) -> None:
        self.d.start_load_kv(loads or {})
        self.d_caches, _, _ = self.d.get_finished(self.d_caches)

    def start_streams(self) -> None:
        """8 streamed requests: P saves their first chunk, D reads it and waits for more."""
        a = self.p.worker.address
        loads = {}
        for r in range(_IN_FLIGHT):
            stream = new_stream_id()
            self.p.add_request(f"r{r}", 64, stream=stream)
            loads[f"r{r}"] = LoadRequest(StreamParams(a.name, a.host, a.port, stream).to_dict(),
                                         [4 * r + k for k in range(4)])
        self.d_step(loads)
        self.p_step([ScheduledRequest(f"r{r}", 0, 32, ([4 * r, 4 * r + 1],), full_table=True)
                     for r in range(_IN_FLIGHT)])
        deadline = time.monotonic() + 2.0  # D subscribes, reads the first chunk, waits
        while time.monotonic() < deadline:
            self.p_step()
            self.d_step()
            time.sleep(0.001)

    def close(self) -> None:
        self.d.close()
        self.p.close()


def _other_devices(cache: Any) -> Any:
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding

    devices = np.array(jax.devices()[4:8]).reshape(1, 4)
    return NamedSharding(Mesh(devices, ("data", "model")), cache.sharding.spec)


def _round(e: _Engines, steps: int) -> dict[str, dict[str, float]]:
    """One round of medians: the idle step (before `start_streams`) or the busy one."""
    sides = {"p": _median_us(e.p_step, steps), "d": _median_us(e.d_step, steps)}
    calls = {
        "build_connector_meta": _median_us(lambda: e.p.build_connector_meta([]), steps),
        "wait_for_save": _median_us(
            lambda: e.p.wait_for_save(e.p_caches, e.p.build_connector_meta([])), steps),
        "p_get_finished": _median_us(e.p.get_finished, steps),
        "start_load_kv": _median_us(lambda: e.d.start_load_kv({}), steps),
        "d_get_finished": _median_us(lambda: e.d.get_finished(e.d_caches), steps),
    }
    return {"sides": sides, "calls": calls}


def _best(rounds: list[dict[str, dict[str, float]]]) -> dict[str, dict[str, float]]:
    """Each figure's least over rounds (a shared machine only ever adds time)."""
    return {part: {k: min(r[part][k] for r in rounds) for k in rounds[0][part]}
            for part in rounds[0]}


def run(layer_counts: tuple[int, ...] = (32, 80), steps: int = 1000,
        rounds: int = 3) -> dict[str, Any]:
    """Median microseconds per engine step, idle and busy, at each layer count: the least
    of `rounds` rounds, the layer counts taking turns so that a busy spell of the machine
    falls on all of them."""
    engines = {}
    try:
        for n in layer_counts:
            engines[n] = _Engines(n, seed=n)
            for _ in range(20):  # warm-up: first calls build caches of their own
                engines[n].p_step()
                engines[n].d_step()
        got: dict[str, dict[str, Any]] = {}
        for kind in ("idle", "busy"):
            if kind == "busy":
                for e in engines.values():
                    e.start_streams()
            per = {n: [] for n in layer_counts}
            for _ in range(rounds):
                for n in layer_counts:
                    per[n].append(_round(engines[n], steps))
            for n in layer_counts:
                got.setdefault(str(n), {})[kind] = _best(per[n])
        in_flight = {str(n): len(e.d.transport.pending()) for n, e in engines.items()}
    finally:
        for e in engines.values():
            e.close()

    def slower(kind: str) -> dict[str, float]:
        return {n: round(max(g[kind]["sides"].values()), 2) for n, g in got.items()}

    def rounded(kind: str, part: str) -> dict[str, dict[str, float]]:
        return {n: {k: round(v, 2) for k, v in g[kind][part].items()} for n, g in got.items()}

    idle, busy = slower("idle"), slower("busy")
    first, last = str(layer_counts[0]), str(layer_counts[-1])
    return {
        "idle_step_us": idle,
        "busy_step_us": busy,
        "idle_step_us_by_side": rounded("idle", "sides"),
        "busy_step_us_by_side": rounded("busy", "sides"),
        "busy_calls_us": rounded("busy", "calls"),
        "in_flight": in_flight,
        "ok": all(n == _IN_FLIGHT for n in in_flight.values()),  # else busy_* measured less
        f"layers_{last}_over_{first}": {
            "idle": round(idle[last] / idle[first], 3),
            "busy": round(busy[last] / busy[first], 3)},
    }
