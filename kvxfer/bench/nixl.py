"""`kvxfer bench nixl`: D reads a request's blocks from P over NIXL, against memcpy.

P runs in a child process with its own agent (`kvxfer.demo.procs`); D is this process. Each
iteration P stages a request of `blocks` randomly placed kernel block ids in
every layer and holds it; D times `start_read` -> `poll` reporting it
finished (READ plus the done/ack round trip), registered staging to
registered staging. The reference is a numpy copy of the same number of
bytes, measured in the same run. The first read (connection set-up) is not
timed; figures are medians.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any, TextIO

import numpy as np

from kvxfer.demo.procs import Children, Side, run_child
from kvxfer.errors import TransferError

__all__ = ["run"]

_SLOTS_PER_BLOCK = 4  # staging holds 4x the blocks read, so ids are spread out


def _staging(layers: int, blocks: int, block_bytes: int, placement: str) -> Any:
    from kvxfer.device.staging import Staging

    return Staging(layers, blocks * _SLOTS_PER_BLOCK, (block_bytes,), np.uint8, placement)


def _advertised(layers: int, block_bytes: int) -> dict[str, Any]:
    """The block fields both sides advertise (`kvxfer.device.layout.advertised`'s form)."""
    return {"groups": [{"block_shape": [block_bytes], "dtype": "uint8", "num_layers": layers,
                        "kernel_ratio": 1}]}


class _Staged(Side):
    """P's process: stages and holds a request whenever D asks, polls its transport otherwise."""

    def __init__(self, fields: dict[str, Any], out: TextIO):
        from kvxfer.nixl.agent import TransportConfig
        from kvxfer.nixl.prefill import PrefillTransport

        layers, blocks, block_bytes = fields["layers"], fields["blocks"], fields["block_bytes"]
        self.staging = _staging(layers, blocks, block_bytes, fields["placement"])
        super().__init__(out, PrefillTransport(TransportConfig(**fields["transport"]),
                                               self.staging, _advertised(layers, block_bytes)))
        rng = np.random.default_rng(fields["seed"])
        self.rows = [rng.integers(0, 256, (blocks, block_bytes), dtype=np.uint8)
                     for _ in range(layers)]

    def hello(self) -> dict[str, Any]:
        return {"port": self.conn.port}

    def command(self, msg: dict[str, Any]) -> None:
        self.staging.stage(msg["stage"], msg["kernel_ids"], self.rows)
        self.say(params=self.conn.hold(msg["stage"]))

    def step(self) -> None:
        self.conn.poll()


def _memcpy_seconds(src: list[np.ndarray], dst: list[np.ndarray]) -> float:
    start = time.perf_counter()
    for s, d in zip(src, dst, strict=True):
        np.copyto(d, s)
    return time.perf_counter() - start


def run(
    layers: int = 8,
    blocks: int = 256,
    block_bytes: int = 65536,
    iters: int = 5,
    seed: int = 0,
    placement: str = "runs",
    ucx_tls: str | None = "auto",
    timeout_s: float = 60.0,
    verbose: bool = True,
) -> dict[str, Any]:
    """Measure one P -> D read path; returns (and prints) a JSON-able dict.

    Keys: `nixl_read_gbps`, `memcpy_gbps`, `nixl_over_memcpy`, `descriptors`
    (NIXL descriptors per read, before any merging NIXL does), `bytes`,
    `placement`, `ucx_tls`, `iters`. Printed as one JSON line when `verbose`.
    """
    from kvxfer.device.layout import check_block_compatible
    from kvxfer.nixl.agent import TransportConfig
    from kvxfer.nixl.decode import DecodeTransport
    from kvxfer.nixl.wire import ReadParams
    from kvxfer.plan.blocks import coalesce_pairs

    common = {"ucx_tls": ucx_tls, "transfer_timeout_s": timeout_s,
              "handshake_timeout_s": timeout_s}
    fields = dict(layers=layers, blocks=blocks, block_bytes=block_bytes, placement=placement,
                  seed=seed, transport={"name": "bench-P", **common})
    with Children("kvxfer.bench.nixl", timeout_s) as children:
        p = children.start("P", json.dumps(fields), 1)
        port = p.read()["port"]
        staging = _staging(layers, blocks, block_bytes, placement)
        d = DecodeTransport(TransportConfig(name="bench-D", **common), staging,
                            _advertised(layers, block_bytes), check_block_compatible)
        try:
            d.handshakes.connect("bench-P", "127.0.0.1", port)
            rng = np.random.default_rng(seed + 1)
            src = [np.ones(blocks * block_bytes, np.uint8) for _ in range(layers)]
            dst = [np.zeros(blocks * block_bytes, np.uint8) for _ in range(layers)]
            times, memcpy_times, descriptors = [], [], 0
            for i in range(iters + 1):
                num_ids = blocks * _SLOTS_PER_BLOCK
                req_id = f"bench-{i}"
                p.send(stage=req_id,
                       kernel_ids=[int(x) for x in rng.choice(num_ids, blocks, replace=False)])
                params = p.read()["params"]
                start = time.perf_counter()
                d.start_read(req_id, ReadParams.parse(params, 1), [])
                finished: list[str] = []
                while req_id not in finished:
                    done, failed = d.poll()
                    if failed:
                        raise TransferError(f"benchmark read failed: {failed}")
                    finished += done
                    time.sleep(0.0001)  # leave the cores to NIXL's progress thread
                times.append(time.perf_counter() - start)
                memcpy_times.append(_memcpy_seconds(src, dst))  # interleaved: same load
                group = params["groups"][0]
                runs = coalesce_pairs(group["slots"], staging.slots(req_id, group["keys"]))
                descriptors = layers * len(runs)
                staging.free(req_id)
        finally:
            d.close()
    nbytes = layers * blocks * block_bytes
    nixl_s = statistics.median(times[1:])
    memcpy_s = statistics.median(memcpy_times[1:])
    result = {
        "nixl_read_gbps": round(nbytes / nixl_s / 1e9, 3),
        "memcpy_gbps": round(nbytes / memcpy_s / 1e9, 3),
        "nixl_over_memcpy": round(memcpy_s / nixl_s, 3),
        "descriptors": descriptors,
        "bytes": nbytes,
        "placement": placement,
        "ucx_tls": ucx_tls,
        "iters": iters,
    }
    if verbose:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    if len(sys.argv) == 3:  # P's process, started by `run`
        run_child(lambda role, fields, out: _Staged(fields, out))
    else:
        run()
