"""`kvxfer bench serve --multi-turn --fleet`: the multi-turn conversations over two P and two
D, routed three ways by `kvxfer proxy`, against two colocated instances behind vllm-router's
`cache_aware` policy.

Two kvxfer P/D pairs (`scripts/pd-up` twice, each P and D with a host pool as in `--multi-turn`)
and, in front of all four instances, three `kvxfer proxy`s run one after another:
`round_robin` (`--route round_robin`: each turn's P and D in turn), `prefix` (by prefix, load
and session, every prompt through P: `--local-prefill-tokens 0`), `prefix_peer` (the same with
`--peer-reads`, each conversation under its own `X-Session-Id`: P reads the conversation so far
from the D that answered its last turn; the pairs run `PD_PEER_READS`) and `prefix_local` (the
defaults: a turn D holds all but 512 tokens of is prefilled on D alone). Then two colocated
`vllm serve` (pd-up's `PD_CONNECTOR=none`, twice) behind `vllm-router --policy cache_aware`.
Each policy gets `CONVERSATIONS` conversations of its own (a system prompt of its own shared
by them), `TURNS` turns as in `--multi-turn` (256-token system prompt, 96-token messages,
32-token answers), a wave per turn; every instance's device cache holds one policy's
conversations whole (40 blocks, as `--multi-turn`'s).

Per policy and turn: p50/p90 TTFT, the proxy's routes, and the tokens prefilled by all
instances against those an earlier prompt held (`multiturn.wave_figures`, P's and D's
`/metrics` summed over both pairs). With `--json` the last line adds, over turns 2 and
later: `prefix_over_cache_aware` (`prefix_local`'s p50 TTFT over the colocated pair's),
`prefix_over_round_robin` (over `round_robin`'s) and `recompute_fraction` (`prefix_local`'s).
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
from kvxfer.bench.load import (
    OUT,
    ROOT,
    STACKS,
    bench_model,
    front,
    need_stack,
    ratio,
    scrape,
    started,
)
from kvxfer.bench.serve import block_bytes

__all__ = ["run", "summary", "POLICIES"]

CONVERSATIONS = 3
"""Conversations per policy: odd, so that round robin over two instances does not send a
conversation's turns to one instance by chance."""
TURNS = multiturn.TURNS
POLICIES = {"round_robin": ["--route", "round_robin"],
            "prefix": ["--local-prefill-tokens", "0"],
            "prefix_peer": ["--local-prefill-tokens", "0", "--peer-reads"],
            "prefix_local": []}
SESSIONS = {"prefix_peer"}
"""The policies whose conversations send `X-Session-Id` (what `--peer-reads` remembers by)."""
_PROXY_PORT, _ROUTER_PORT = 8061, 8064


def run() -> dict[str, Any]:
    need_stack("kvxfer bench serve --multi-turn --fleet")
    model = bench_model()
    per_block, block = block_bytes(model)
    blocks = multiturn.cache_blocks(block)
    weights = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    settings = {"PD_MEMORY": f"{((blocks + 0.5) * per_block + weights) / multiturn.DEVICE_BYTES:.7f}",
                "PD_MAX_MODEL_LEN": str(multiturn.MAX_MODEL_LEN),
                "PD_MAX_NUM_SEQS": str(multiturn.MAX_NUM_SEQS)}
    pool = {"PD_HOST_POOL_BYTES": str(multiturn.STAGING_BLOCKS * per_block // 2),
            "PD_PEER_READS": "1"}  # P and D kv_both: what prefix_peer reads by
    OUT.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "cores": os.cpu_count(),
                              "conversations": CONVERSATIONS, "cache_blocks": blocks,
                              "block_size": block, "policies": {}}
    seed = iter(range(100, 200))
    with ExitStack() as stack:
        pairs = [stack.enter_context(started(ROOT / ".pd" / f"fleet-kvxfer-{i}", STACKS["kvxfer"],
                                             {**settings, **pool, **_ports(i)}))
                 for i in range(2)]
        ps, ds = [u["P_URL"] for u in pairs], [u["D_URL"] for u in pairs]
        _warm(ps + ds)
        for name, flags in POLICIES.items():
            argv = ["kvxfer", "proxy", "--prefill", ",".join(ps), "--decode", ",".join(ds),
                    "--port", str(_PROXY_PORT), *flags]
            with front(ROOT / ".pd" / "fleet-kvxfer-0", f"proxy-{name}", _PROXY_PORT, argv) as url:
                result["policies"][name] = _conversations(name, url, url, ps, ds, next(seed), block,
                                                          name in SESSIONS)
    with ExitStack() as stack:
        pairs = [stack.enter_context(started(ROOT / ".pd" / f"fleet-colocated-{i}",
                                             STACKS["colocated"], {**settings, **_ports(i)}))
                 for i in range(2)]
        cs = [u["P_URL"] for u in pairs]
        _warm(cs)
        argv = ["vllm-router", "--worker-urls", *cs, "--policy", "cache_aware",
                "--host", "127.0.0.1", "--port", str(_ROUTER_PORT)]
        with front(ROOT / ".pd" / "fleet-colocated-0", "vllm-router", _ROUTER_PORT, argv) as url:
            result["policies"]["cache_aware"] = _conversations("cache_aware", url, None, cs, [],
                                                               next(seed), block)
    result.update(summary(result["policies"]))
    (OUT / "fleet.json").write_text(json.dumps(result, indent=1))
    return result


def summary(policies: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Over turns 2 and later: each policy's p50 TTFT, `prefix_local`'s over the colocated
    pair's and over `round_robin`'s, `prefix_local`'s recompute fraction, and `prefix_peer`'s
    p50 TTFT over `prefix`'s (every turn through P, reading from D or computing)."""
    later = {name: p["turns"][1:] for name, p in policies.items()}
    p50 = {name: multiturn.pct([x for t in turns for x in t["ttft_ms"]], 50)
           for name, turns in later.items()}
    held = sum(t["held_tokens"] for t in later.get("prefix_local", []))
    again = sum(t["recomputed_tokens"] for t in later.get("prefix_local", []))
    return {"p50_ttft_ms_later_turns": p50,
            "prefix_over_cache_aware": ratio(p50.get("prefix_local"), p50.get("cache_aware")),
            "prefix_over_round_robin": ratio(p50.get("prefix_local"), p50.get("round_robin")),
            "recompute_fraction": round(again / held, 3) if held else None,
            "peer_over_prefix": ratio(p50.get("prefix_peer"), p50.get("prefix"))}


def _ports(i: int) -> dict[str, str]:
    return {"PD_P_PORT": str(8100 + i), "PD_D_PORT": str(8200 + i),
            "PD_PROXY_PORT": str(8010 + i), "PD_KV_PORT": str(5610 + 20 * i)}


def _warm(urls: list[str]) -> None:
    """Compile each instance's batch shapes with prompts nothing else starts with, unrecorded."""
    rng = np.random.default_rng(0)
    for url in urls:
        multiturn.wave(url, [rng.integers(3, 500, multiturn.USER + k * 64).tolist()
                              for k in range(multiturn.MAX_NUM_SEQS)], max_tokens=8)


def _conversations(name: str, url: str, proxy: str | None, ps: list[str], ds: list[str],
                   seed: int, block: int, sessions: bool = False) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    system = rng.integers(3, 500, multiturn.SYSTEM).tolist()
    histories = [list(system) for _ in range(CONVERSATIONS)]
    seen: set[tuple[int, ...]] = set()
    turns = []
    for k in range(TURNS):
        for history in histories:
            history += rng.integers(3, 500, multiturn.USER).tolist()
        prompts = [list(h) for h in histories]
        held = sum(multiturn.held_tokens(p, seen, block) for p in prompts)
        routed, read, before = multiturn.routes(proxy), multiturn.peer_reads(proxy), _scrape(ps, ds)
        answers = multiturn.wave(url, prompts, sessions=[f"{name}-{i}" for i in range(
            len(prompts))] if sessions else None)
        answered = sum(len(p) for p, a in zip(prompts, answers) if "error" not in a)
        turns.append(multiturn.wave_figures(answers, held, before, _scrape(ps, ds), 1, answered))
        turns[-1]["routes"] = {c: n - routed.get(c, 0) for c, n in multiturn.routes(proxy).items()}
        turns[-1]["peer_reads"] = {o: n - read.get(o, 0) for o, n in multiturn.peer_reads(proxy).items()}
        for prompt, history, answer in zip(prompts, histories, answers):
            multiturn.remember(prompt, seen, block)
            history += answer.get("tokens", [])
        t = turns[-1]
        print(f"bench serve --multi-turn --fleet: {name} turn {k + 1}: p50/p90 TTFT "
              f"{t['p50_ttft_ms']}/{t['p90_ttft_ms']} ms, prefilled {t['computed_tokens']} of "
              f"{t['prompt_tokens']} tokens ({t['held_tokens']} held), routes {t['routes']}, "
              f"peer reads {t['peer_reads'] or '-'}, "
              f"{t['failed']} failed", file=sys.stderr, flush=True)
    return {"turns": turns}


def _scrape(ps: list[str], ds: list[str]) -> dict[tuple[str, str], float]:
    """Every P's and every D's `/metrics`, summed per role and name."""
    out: dict[tuple[str, str], float] = {}
    for role, urls in (("P", ps), ("D", ds)):
        for url in urls:
            for key, value in scrape({role: url}).items():
                out[key] = out.get(key, 0.0) + value
    return out
