"""`kvxfer bench serve --local-prefill`: what D prefilling a conversation's next turn alone
costs against sending it through P, by the length of the new suffix: the measurement behind
`kvxfer proxy --local-prefill-tokens`.

kvxfer's stack (`scripts/pd-up`: P and D on the same cores, the tiny model) with two more
`kvxfer proxy`s in front of its P and D: `pd`, which sends every prompt through P
(`--local-prefill-tokens 0`), and `local`, which sends a prompt D answered before to D alone
however long the rest (`--local-prefill-tokens 100000`). For each suffix length N
(`SUFFIXES`) and each proxy, `REPS` times: turn 1 (a fresh 128-token prompt and its 8-token
answer) through that proxy, then turn 2 (turn 1, the answer, N new tokens), streamed: its time
to first token. During turn 2 a long generation runs on D (started before it, ended after
turn 2's first token): the longest gap between its tokens while turn 2 waits is the **stall**,
what turn 2's prefill costs the requests D is decoding.

Per N: p50 TTFT and p50 stall through each proxy, and `local_over_pd` (local TTFT over P/D
TTFT, measured in the same run). `threshold`: the longest N at which D alone answers at
least as soon as through P and stalls D's decoding at most `STALL_LIMIT` times as long;
None when no N does. A progress line per point goes to stderr; `.pd/bench/localprefill.json`
keeps the figures.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import numpy as np

from kvxfer.bench.load import OUT, ROOT, STACKS, front, need_stack, ratio, started
from kvxfer.bench.serve import stream

__all__ = ["run", "threshold", "SUFFIXES"]

SUFFIXES = (64, 256, 512, 768)
"""New tokens of turn 2 (after turn 1's 128 and its 8-token answer: the longest 904 of the
stack's 1024)."""
REPS = 3
TURN1, ANSWER = 128, 8
STALL_LIMIT = 2.0
"""How many times P/D's stall a local prefill may cost D's decoding and still count."""
PROXIES = {"pd": ("--local-prefill-tokens", "0"), "local": ("--local-prefill-tokens", "100000")}
_PORTS = {"pd": 8051, "local": 8052}


def run() -> dict[str, Any]:
    need_stack("kvxfer bench serve --local-prefill")
    OUT.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(7)
    points: dict[int, dict[str, Any]] = {}
    with started(ROOT / ".pd" / "localprefill", STACKS["kvxfer"], {}) as urls, ExitStack() as stack:
        fronts = {name: stack.enter_context(front(
            ROOT / ".pd" / "localprefill", f"proxy-{name}", _PORTS[name],
            ["kvxfer", "proxy", "--prefill", urls["P_URL"], "--decode", urls["D_URL"],
             "--port", str(_PORTS[name]), *PROXIES[name]]))
                  for name in PROXIES}
        _turn(fronts["pd"], rng.integers(3, 500, TURN1).tolist(), ANSWER)  # compiles, unrecorded
        for n in SUFFIXES:
            point: dict[str, Any] = {}
            for name, front in fronts.items():
                samples = [_sample(front, urls["D_URL"], n, rng) for _ in range(REPS)]
                point[name] = {"p50_ttft_ms": _p50([s[0] for s in samples]),
                               "p50_stall_ms": _p50([s[1] for s in samples])}
            point["local_over_pd"] = ratio(point["local"]["p50_ttft_ms"], point["pd"]["p50_ttft_ms"])
            points[n] = point
            _say(f"suffix {n}: TTFT P/D {point['pd']['p50_ttft_ms']} ms, D alone "
                 f"{point['local']['p50_ttft_ms']} ms ({point['local_over_pd']}x); stall P/D "
                 f"{point['pd']['p50_stall_ms']} ms, D alone {point['local']['p50_stall_ms']} ms")
    result = {"date": time.strftime("%Y-%m-%d"), "cores": os.cpu_count(), "reps": REPS,
              "turn1": TURN1, "answer": ANSWER, "stall_limit": STALL_LIMIT,
              "points": {str(n): p for n, p in points.items()}, "threshold": threshold(points)}
    (OUT / "localprefill.json").write_text(json.dumps(result, indent=1))
    return result


def threshold(points: dict[int, dict[str, Any]]) -> int | None:
    """The longest suffix at which D alone is as soon as P/D and stalls at most `STALL_LIMIT`
    times P/D's stall (the shorter suffixes need not all pass: the longest that does)."""
    good = [n for n, p in points.items()
            if p["local"]["p50_ttft_ms"] <= p["pd"]["p50_ttft_ms"]
            and p["local"]["p50_stall_ms"] <= STALL_LIMIT * max(p["pd"]["p50_stall_ms"], 1e-9)]
    return max(good) if good else None


def _sample(front: str, d_url: str, n: int, rng: np.random.Generator) -> tuple[float, float]:
    """One turn 2 of a suffix of `n` tokens through `front`: (TTFT, stall) in ms."""
    turn1 = rng.integers(3, 500, TURN1).tolist()
    answer = _turn(front, turn1, ANSWER)
    prompt = turn1 + answer + rng.integers(3, 500, n).tolist()
    with _decoding(d_url, rng.integers(3, 500, 64).tolist()) as gaps:
        start = time.perf_counter()
        ttft, _, _ = stream(front, _body(prompt, 1))
        stall = gaps(start, start + ttft)
    return round(ttft * 1e3, 1), round(stall * 1e3, 1)


def _turn(front: str, prompt: list[int], max_tokens: int) -> list[int]:
    """`prompt`'s greedy answer through `front`, as token ids."""
    _, _, choices = stream(front, _body(prompt, max_tokens))
    return [t for c in choices for t in c.get("token_ids") or ()]


def _body(prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}


@contextmanager
def _decoding(d_url: str, prompt: list[int]) -> Iterator[Any]:
    """A long generation on D while the block runs (its first token seen before the block
    starts); yields `gaps(t0, t1)`: the longest gap between its tokens that overlaps
    [t0, t1] (perf_counter seconds)."""
    times: list[float] = []
    first, stop = threading.Event(), threading.Event()
    body = {**_body(prompt, 900), "stream": True,  # on D alone on purpose: no fallback counted
            "kv_transfer_params": {"do_remote_prefill": False, "local_prefill": True}}
    request = urllib.request.Request(d_url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})

    def read() -> None:
        with urllib.request.urlopen(request, timeout=600) as response:
            for line in response:
                if line.startswith(b"data: {"):
                    times.append(time.perf_counter())
                    first.set()
                if stop.is_set():
                    return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    first.wait(120)

    def gaps(t0: float, t1: float) -> float:
        stamps = list(times)
        after = next((t for t in stamps if t >= t1), time.perf_counter())
        inside = [t for t in stamps if t0 <= t < t1]
        before = [t for t in stamps if t < t0][-1:]
        edges = before + inside + [after]
        return max(b - a for a, b in zip(edges, edges[1:]))

    try:
        yield gaps
    finally:
        stop.set()
        reader.join(120)


def _p50(values: list[float]) -> float:
    return round(float(np.percentile(values, 50)), 1)


def _say(line: str) -> None:
    print(f"bench serve --local-prefill: {line}", file=sys.stderr, flush=True)
