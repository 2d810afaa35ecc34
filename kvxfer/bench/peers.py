"""`kvxfer bench serve --peer-reads`: a conversation's next turn through P, reading the last
answer from D (`kvxfer proxy --peer-reads`) against computing it on P, by the answer's length.

kvxfer's stack (`scripts/pd-up` with `PD_PEER_READS=1`: P and D `kv_both`, each with a host
pool; P and D on the same cores, the tiny model) with two `kvxfer proxy`s in front of it, both
sending every prompt through P (`--local-prefill-tokens 0`): `pd`, and `peer`, with
`--peer-reads`. For each answer length A (`ANSWERS`) and each proxy, `REPS` times, under a
session of its own: turn 1 (a fresh `TURN1`-token prompt and its A-token answer, streamed
without asking for its usage, as the OpenAI client streams by default: the `peer` proxy asks D
for it), then turn 2 (turn 1, the answer, `NEW` new tokens), streamed: its time to
first token. P holds turn 1's prompt either way (its prefix cache and pool); what it lacks is
the answer, which `pd` computes on P and `peer` reads from D after a lookup.

Per A: p50 TTFT through each proxy, `peer_over_pd` (measured in the same run) and the
`peer` proxy's lookups by outcome. A progress line per point goes to stderr;
`.pd/bench/peers.json` keeps the figures.
"""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import ExitStack
from typing import Any

import numpy as np

from kvxfer.bench import multiturn
from kvxfer.bench.load import OUT, ROOT, STACKS, bench_model, front, need_stack, ratio, started
from kvxfer.bench.serve import block_bytes, stream

__all__ = ["ANSWERS", "run"]

ANSWERS = (32, 256)
"""Answer lengths of turn 1: under a block of the stack's 64 tokens (nothing to read), and four
blocks."""
REPS = 3
TURN1, NEW = 128, 64
PROXIES = {"pd": ("--local-prefill-tokens", "0"),
           "peer": ("--local-prefill-tokens", "0", "--peer-reads")}
_PORTS = {"pd": 8053, "peer": 8054}


def run() -> dict[str, Any]:
    need_stack("kvxfer bench serve --peer-reads")
    OUT.mkdir(parents=True, exist_ok=True)
    per_block, _ = block_bytes(bench_model())
    rng = np.random.default_rng(11)
    settings = {"PD_PEER_READS": "1", "PD_HOST_POOL_BYTES": str(256 * per_block // 2)}
    points: dict[int, dict[str, Any]] = {}
    with started(ROOT / ".pd" / "peers", STACKS["kvxfer"], settings) as urls, ExitStack() as stack:
        fronts = {name: stack.enter_context(front(
            ROOT / ".pd" / "peers", f"proxy-{name}", _PORTS[name],
            ["kvxfer", "proxy", "--prefill", urls["P_URL"], "--decode", urls["D_URL"],
             "--port", str(_PORTS[name]), *PROXIES[name]]))
                  for name in PROXIES}
        _sample(fronts["pd"], "warm", 8, rng)  # compiles, unrecorded
        for answer in ANSWERS:
            point: dict[str, Any] = {}
            for name, url in fronts.items():
                before = multiturn.peer_reads(url)
                ttfts = [_sample(url, f"{name}-{answer}-{i}", answer, rng) for i in range(REPS)]
                after = multiturn.peer_reads(url)
                point[name] = {"p50_ttft_ms": round(float(np.percentile(ttfts, 50)), 1),
                               "lookups": {k: v - before.get(k, 0) for k, v in after.items()}}
            point["peer_over_pd"] = ratio(point["peer"]["p50_ttft_ms"], point["pd"]["p50_ttft_ms"])
            points[answer] = point
            print(f"bench serve --peer-reads: answer {answer}: turn 2 TTFT through P "
                  f"{point['pd']['p50_ttft_ms']} ms, reading it from D "
                  f"{point['peer']['p50_ttft_ms']} ms ({point['peer_over_pd']}x), lookups "
                  f"{point['peer']['lookups'] or '-'}", file=sys.stderr, flush=True)
    result = {"date": time.strftime("%Y-%m-%d"), "cores": os.cpu_count(), "reps": REPS,
              "turn1": TURN1, "new": NEW, "points": {str(a): p for a, p in points.items()}}
    (OUT / "peers.json").write_text(json.dumps(result, indent=1))
    return result


def _sample(url: str, session: str, answer: int, rng: np.random.Generator) -> float:
    """Turn 1 with an `answer`-token answer, then turn 2's TTFT in ms, through `url`."""
    turn1 = rng.integers(3, 500, TURN1).tolist()
    headers = {"X-Session-Id": session}
    _, _, choices = stream(url, _body(turn1, answer), headers)
    said = [t for c in choices for t in c.get("token_ids") or ()]
    ttft, _, _ = stream(url, _body(turn1 + said + rng.integers(3, 500, NEW).tolist(), 1), headers)
    return ttft * 1e3


def _body(prompt: list[int], max_tokens: int) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
