"""`kvxfer bench nixl`: D reads a request's blocks from P over NIXL, against memcpy.

P runs in a spawned process with its own agent; D is this process. Each
iteration P stages a request of `blocks` randomly placed kernel block ids in
every layer and holds it; D times `start_read` -> `poll` reporting it
finished (READ plus the done/ack round trip), registered staging to
registered staging. The reference is a numpy copy of the same number of
bytes, measured in the same run. The first read (connection set-up) is not
timed; figures are medians.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import statistics
import time
from typing import Any

import numpy as np

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


def _prefill(conn: Any, layers: int, blocks: int, block_bytes: int, placement: str,
             config_fields: dict[str, Any], seed: int) -> None:
    """P's process: stage and hold a request whenever D asks, poll otherwise."""
    from kvxfer.nixl.agent import TransportConfig
    from kvxfer.nixl.prefill import PrefillTransport

    staging = _staging(layers, blocks, block_bytes, placement)
    transport = PrefillTransport(TransportConfig(**config_fields), staging,
                                 _advertised(layers, block_bytes))
    rng = np.random.default_rng(seed)
    rows = [rng.integers(0, 256, (blocks, block_bytes), dtype=np.uint8) for _ in range(layers)]
    conn.send(transport.port)
    try:
        while True:
            if not conn.poll(0.001):
                transport.poll()
                continue
            cmd = conn.recv()
            if cmd[0] == "exit":
                break
            _, req_id, kernel_ids = cmd
            staging.stage(req_id, kernel_ids, rows)
            conn.send(transport.hold(req_id))
    finally:
        transport.close()


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
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    child = ctx.Process(
        target=_prefill,
        args=(theirs, layers, blocks, block_bytes, placement, {"name": "bench-P", **common}, seed),
        daemon=True,
    )
    child.start()
    d = None
    try:
        if not ours.poll(timeout_s):
            raise TransferError(f"benchmark P did not start within {timeout_s}s")
        port = ours.recv()
        staging = _staging(layers, blocks, block_bytes, placement)
        d = DecodeTransport(TransportConfig(name="bench-D", **common), staging,
                            _advertised(layers, block_bytes), check_block_compatible)
        d.handshakes.connect("bench-P", "127.0.0.1", port)
        rng = np.random.default_rng(seed + 1)
        src = [np.ones(blocks * block_bytes, np.uint8) for _ in range(layers)]
        dst = [np.zeros(blocks * block_bytes, np.uint8) for _ in range(layers)]
        times, memcpy_times, descriptors = [], [], 0
        for i in range(iters + 1):
            num_ids = blocks * _SLOTS_PER_BLOCK
            p_ids = [int(x) for x in rng.choice(num_ids, blocks, replace=False)]
            req_id = f"bench-{i}"
            ours.send(("stage", req_id, p_ids))
            if not ours.poll(timeout_s):
                raise TransferError(f"benchmark P did not hold {req_id} within {timeout_s}s")
            params = ours.recv()
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
        ours.send(("exit",))
    finally:
        if d is not None:
            d.close()
        child.join(5)
        if child.is_alive():
            child.kill()
            child.join(5)
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
    run()
