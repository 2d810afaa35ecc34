"""`kvxfer bench serve --multi-turn`: conversations with a shared system prompt, each turn
resending the history and a new message, through the real stack.

The stacks of `kvxfer bench serve --load` (`load.STACKS`: kvxfer's connector behind
`kvxfer proxy`, tpu-inference's own connector behind the same proxy, one colocated `vllm
serve` with prefix caching), started in turn on the same cores by `scripts/pd-up` with the
same settings. A conversation is a 256-token system prompt shared by all, then per turn a
96-token user message and the 32-token answer (greedy, `ignore_eos`) the stack gave, 4 turns
(the last prompt 736 tokens, 768 with its answer: `max_model_len` 1024, so 64-token blocks).
Each turn is a wave: every conversation's turn k at once, streamed, after one unrecorded
wave of unrelated prompts that compiles the batch shapes.

Two regimes, on each stack in turn (one start per stack: a start is over a minute here):
`fits`, 3 conversations, all of whose blocks the device caches hold together (28 blocks,
answers and all); and `pressure`, 8 conversations in flight, more than the caches hold (68
blocks with the answers, what D and the colocated instance keep; 44 of prompts alone by the
last turn, what P keeps). The caches are P's and D's (or the one instance's) KV caches,
shrunk with `--gpu-memory-utilization` (pd-up's `PD_MEMORY`: tpu-inference sizes the KV
cache as 32 GiB per device times it, less the weights) to `cache_blocks(...)` (40): half of
the pressure regime's blocks, and at least what `MAX_NUM_SEQS` (3) whole conversations need
running at once, with 4 blocks spare. Each regime has its own
system prompt and messages, so nothing of one is a prefix of the other.

kvxfer's P and D each get a host pool (`PD_HOST_POOL_BYTES`: half the staging's bytes), where
the blocks of a prompt stay once D has read them (P's), and those of a finished conversation,
answers included (D's), for a later prompt that starts the same. While
kvxfer refuses that setting under vLLM, P does not start with it: the run says so and runs
kvxfer without (`"pool": false`).

Per stack, regime and turn: p50 and p90 time to first token (from sending the request to its
first streamed chunk), p50 time per output token (the rest of the stream over the tokens
after the first), and what the instances (P and D; the colocated one's only instance) did,
from their `/metrics` between waves:

- `prompt_tokens`: the wave's answered prompts' tokens.
- `held_tokens`: tokens of the wave's prompts that an earlier wave's prompt, sent to that
  instance, held: per prompt, its longest run of whole blocks (the stack's block size, from
  `vllm:cache_config_info`) that is also the start of an earlier prompt. Counted here from
  the histories, the answers left out (P never sees D's answer).
- `computed_tokens`: the tokens prefilled, by P and D: each one's prompt tokens
  (`vllm:prompt_tokens_total`) less its device prefix-cache hits
  (`vllm:prefix_cache_hits_total`) less its connector's hits
  (`vllm:external_prefix_cache_hits_total`: each one's pool, what D loaded from P);
  `computed_on_d`, D's share (the prompts `kvxfer proxy` sent D alone, its local choice).
- `recomputed_tokens`: of those, the ones that were held: the prefilled tokens beyond the
  ones never held (`prompt - held`), at most `held`; `recompute_fraction` is that over
  `held_tokens` (None with nothing held). A lower bound where the instance also kept what it
  was never sent (the colocated one caches its own answers, so held tokens it recomputed
  can hide behind answer tokens it did not).
- `kv_moved`: D's `vllm:kvxfer_num_transfers_total` over the requests (kvxfer only).
- `breakdown_ms`: mean milliseconds per request of the wave from vLLM's and kvxfer's
  histograms, as `bench serve --load` gives them: `p_queue` and `p_prefill` (the colocated
  instance's are P's), `d_queue` (waiting for a slot, and on a P/D stack for the KV) and
  `d_first_step`, and kvxfer's own steps. Where TTFT goes while prefill is cheap: the queue.

Per stack and regime: `pool`, the deltas of every `/metrics` line of P and D whose name starts
`vllm:kvxfer_pool` (histogram buckets left out; empty while kvxfer exports none; hits by
source in `vllm:kvxfer_pool_hit_tokens_total{source=...}`), and `cached_by_source`, P's prefix-hit
tokens by the tier vLLM says gave them (`vllm:prompt_tokens_cached_by_source_total`). Per
regime, over turns 2 and later: `kvxfer_over_colocated` and `kvxfer_over_tpu`, kvxfer's p50
TTFT over each other stack's, and `recompute_fraction`, kvxfer's (each stack's in
`recompute_fraction_by_stack`). A progress line per wave goes to stderr;
`.pd/bench/multiturn.json` and `multiturn.png` (p50 TTFT per turn, recompute fraction; with
matplotlib) keep them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from kvxfer.bench.load import (
    OUT,
    ROOT,
    STACKS,
    Stack,
    bench_model,
    deltas,
    need_stack,
    pyplot,
    ratio,
    roles,
    samples,
    save,
    scrape,
    started,
)
from kvxfer.bench.serve import block_bytes, stream
from kvxfer.errors import InvalidInputError
from kvxfer.plan.blocks import cdiv

__all__ = ["run", "cache_blocks", "held_tokens", "labelled_deltas", "pct", "recompute", "remember",
           "routes", "summary", "table", "wave", "wave_figures", "CONVERSATIONS"]

SYSTEM, USER, ANSWER, TURNS = 256, 96, 32, 4
"""System prompt, user message and answer tokens; turns per conversation."""
CONVERSATIONS = {"fits": 3, "pressure": 8}
"""Conversations in flight per regime."""
MAX_NUM_SEQS, MAX_MODEL_LEN = 3, 1024
DEVICE_BYTES = 32 << 30
"""tpu-inference's memory per device, which `--gpu-memory-utilization` takes a share of."""
STAGING_BLOCKS = 256
"""pd-up's `PD_STAGING_BLOCKS`: P's staging, in blocks; the pool gets half its bytes."""
TPU_PROXY = {"PD_PROXY_ARGS": "--local-prefill-tokens 0"}
"""tpu-inference's stack behind `kvxfer proxy` never prefilling on D, as its own proxy."""
_POOL = ("vllm:kvxfer_pool",)
_BY_SOURCE = ("vllm:prompt_tokens_cached_by_source_total",)


def run() -> dict[str, Any]:
    need_stack("kvxfer bench serve --multi-turn")
    model = bench_model()
    per_block, block = block_bytes(model)
    blocks = cache_blocks(block)
    weights = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    memory = ((blocks + 0.5) * per_block + weights) / DEVICE_BYTES
    pool_bytes = STAGING_BLOCKS * per_block // 2
    settings = {"PD_MEMORY": f"{memory:.7f}", "PD_MAX_MODEL_LEN": str(MAX_MODEL_LEN),
                "PD_MAX_NUM_SEQS": str(MAX_NUM_SEQS)}
    OUT.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"), "cores": os.cpu_count(),
        "conversations": CONVERSATIONS, "tokens": {"system": SYSTEM, "user": USER,
                                                   "answer": ANSWER, "turns": TURNS},
        "cache_blocks": blocks, "block_size": block, "pd_memory": settings["PD_MEMORY"],
        "host_pool_bytes": pool_bytes, "stacks": {}}
    _say(f"device caches of {blocks} blocks of {block} tokens (PD_MEMORY "
         f"{settings['PD_MEMORY']}); kvxfer's P and D each with a host pool of {pool_bytes} bytes "
         f"(PD_HOST_POOL_BYTES, half of {STAGING_BLOCKS} staging blocks)")
    for name, how in STACKS.items():
        if name == "tpu_inference":  # every request through P, as tpu-inference's proxy sends it
            result["stacks"][name] = _stack(name, how, {**settings, **TPU_PROXY})
            continue
        if name != "kvxfer":
            result["stacks"][name] = _stack(name, how, settings)
            continue
        try:
            result["stacks"][name] = _stack(name, how, {**settings,
                                                         "PD_HOST_POOL_BYTES": str(pool_bytes)})
            result["pool"] = True
        except subprocess.CalledProcessError:
            log = ROOT / ".pd" / "multiturn-kvxfer" / "P.log"
            if "host_pool_bytes" not in (log.read_text(errors="replace") if log.exists() else ""):
                raise
            _say("kvxfer's P refused host_pool_bytes (its log says so): kvxfer again, no pool")
            result["stacks"][name] = _stack(name, how, settings)
            result["pool"] = False
    result.update(summary(result["stacks"]))
    result["ok"] = all(t["failed"] == 0 for s in result["stacks"].values()
                       for r in CONVERSATIONS for t in s[r]["turns"])
    (OUT / "multiturn.json").write_text(json.dumps(result, indent=1))
    result["plot"] = _plot(result, OUT / "multiturn.png")
    return result


def cache_blocks(block: int) -> int:
    """Blocks of each device cache: half the pressure regime's blocks (its conversations
    whole, the system prompt once), and at least `MAX_NUM_SEQS` whole conversations and 4
    blocks spare; checked to hold the fits regime's beside vLLM's null block."""
    longest = SYSTEM + TURNS * (USER + ANSWER)
    if longest > MAX_MODEL_LEN:
        raise InvalidInputError(f"a conversation of {longest} tokens is over max_model_len "
                                f"{MAX_MODEL_LEN}")

    def working(n: int) -> int:
        return cdiv(SYSTEM + n * TURNS * (USER + ANSWER), block)

    blocks = max(cdiv(working(CONVERSATIONS["pressure"]), 2),
                 MAX_NUM_SEQS * cdiv(longest, block) + 4)
    if not working(CONVERSATIONS["fits"]) < blocks < working(CONVERSATIONS["pressure"]):
        raise InvalidInputError(f"caches of {blocks} blocks do not separate the regimes: fits "
                                f"needs {working(CONVERSATIONS['fits'])}, pressure "
                                f"{working(CONVERSATIONS['pressure'])}")
    return blocks


def held_tokens(prompt: list[int], seen: set[tuple[int, ...]], block: int) -> int:
    """Tokens of `prompt`'s longest run of whole blocks that starts an earlier prompt
    (`seen`: the whole-block starts of every earlier prompt, as `remember` leaves them)."""
    k = 0
    while (k + 1) * block <= len(prompt) and tuple(prompt[:(k + 1) * block]) in seen:
        k += 1
    return k * block


def remember(prompt: list[int], seen: set[tuple[int, ...]], block: int) -> None:
    seen.update(tuple(prompt[:k * block]) for k in range(1, len(prompt) // block + 1))


def recompute(prompt: int, held: int, computed: int) -> tuple[int, float | None]:
    """(held tokens prefilled again, their share of `held`, None with nothing held) from a
    wave's prompt, held and computed tokens: what was computed beyond the never-held
    tokens."""
    if not 0 <= held <= prompt:
        raise InvalidInputError(f"held tokens {held} must be within the prompt's {prompt}")
    again = min(max(computed - (prompt - held), 0), held)
    return again, (round(again / held, 3) if held else None)


def wave_figures(answers: list[dict], held: int, before: dict, after: dict,
                 d_workers: int = 1, prompt_tokens: int | None = None) -> dict[str, Any]:
    """One wave's figures from its answers (`ttft_s`, `tpot_s`, or `error`), the tokens its
    prompts held, and P's and D's `/metrics` (`scrape`) around it. `prompt_tokens`: the
    answered prompts' tokens (P's count when not given). Computed tokens are P's and D's:
    what D prefilled alone (the proxy's local choice) counts, what D loaded does not."""
    def delta(role: str, name: str) -> int:
        return int(after.get((role, name), 0.0) - before.get((role, name), 0.0))

    def computed(role: str) -> int:
        return (delta(role, "vllm:prompt_tokens_total") - delta(role, "vllm:prefix_cache_hits_total")
                - delta(role, "vllm:external_prefix_cache_hits_total"))

    done = [a for a in answers if "error" not in a]
    prompt = delta("P", "vllm:prompt_tokens_total") if prompt_tokens is None else prompt_tokens
    device, connector = delta("P", "vllm:prefix_cache_hits_total"), delta(
        "P", "vllm:external_prefix_cache_hits_total")
    on_d = max(computed("D"), 0)
    held = min(held, prompt)  # a failed request's prompt is not counted
    again, fraction = recompute(prompt, held, computed("P") + on_d)
    ttft = [round(a["ttft_s"] * 1e3, 1) for a in done]
    tpot = [a["tpot_s"] * 1e3 for a in done if a.get("tpot_s") is not None]
    return {"requests": len(answers), "failed": len(answers) - len(done), "ttft_ms": ttft,
            "p50_ttft_ms": pct(ttft, 50), "p90_ttft_ms": pct(ttft, 90),
            "p50_tpot_ms": pct(tpot, 50), "prompt_tokens": prompt, "held_tokens": held,
            "device_hits": device, "connector_hits": connector,
            "computed_tokens": computed("P") + on_d, "computed_on_d": on_d,
            "recomputed_tokens": again, "recompute_fraction": fraction,
            **{k: v for k, v in deltas(before, after, len(done), d_workers).items()
               if k in ("kv_moved", "breakdown_ms")}}


def summary(stacks: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per regime, over turns 2 and later: kvxfer's p50 TTFT over colocated's and over
    tpu-inference's, and each stack's recompute fraction (kvxfer's as `recompute_fraction`)."""
    out = {}
    for regime in CONVERSATIONS:
        later = {name: s[regime]["turns"][1:] for name, s in stacks.items()}
        p50 = {name: pct([x for t in turns for x in t["ttft_ms"]], 50)
               for name, turns in later.items()}
        fractions = {name: (round(sum(t["recomputed_tokens"] for t in turns)
                                  / sum(t["held_tokens"] for t in turns), 3)
                            if sum(t["held_tokens"] for t in turns) else None)
                     for name, turns in later.items()}
        out[regime] = {"kvxfer_over_colocated": ratio(p50.get("kvxfer"), p50.get("colocated")),
                       "kvxfer_over_tpu": ratio(p50.get("kvxfer"), p50.get("tpu_inference")),
                       "recompute_fraction": fractions.get("kvxfer"),
                       "recompute_fraction_by_stack": fractions,
                       "p50_ttft_ms_later_turns": p50}
    return out


def table(result: dict[str, Any]) -> list[str]:
    """A table per regime: per turn, each stack's p50/p90 TTFT, p50 TPOT and recompute
    fraction, and kvxfer's KV moved."""
    stacks = result["stacks"]
    lines = []
    for regime, n in CONVERSATIONS.items():
        lines += ["", f"{regime}: {n} conversations, p50/p90 TTFT and p50 TPOT in ms",
                  "| turn | " + " | ".join(f"{s} TTFT | {s} TPOT | {s} recompute"
                                          for s in stacks) + " | kvxfer KV moved |",
                  "| --- " * (3 * len(stacks) + 2) + "|"]
        for k in range(TURNS):
            row = [str(k + 1)]
            for s in stacks.values():
                t = s[regime]["turns"][k]
                row += [f"{t['p50_ttft_ms']}/{t['p90_ttft_ms']}", f"{t['p50_tpot_ms']}",
                        f"{t['recompute_fraction']}"]
            moved = stacks.get("kvxfer", {}).get(regime, {}).get("turns", [{}] * TURNS)[k]
            lines.append("| " + " | ".join(row + [str(moved.get("kv_moved"))]) + " |")
        s = result.get(regime, {})
        lines.append(f"turns 2-{TURNS}: kvxfer / colocated p50 TTFT "
                     f"{s.get('kvxfer_over_colocated')}, kvxfer / tpu-inference "
                     f"{s.get('kvxfer_over_tpu')}; recompute fraction "
                     f"{s.get('recompute_fraction_by_stack')}")
    return lines


def _stack(name: str, how: Stack, settings: dict[str, str]) -> dict[str, Any]:
    run_dir = ROOT / ".pd" / f"multiturn-{name}"
    with started(run_dir, how, settings) as urls:
        who = roles(urls)
        front = urls.get("PROXY_URL") or urls["P_URL"]
        config = {role: _cache_config(url) for role, url in who.items() if url}
        block = config["P"]["block_size"]
        rng = np.random.default_rng(0)  # compiles, unrecorded: prompts nothing else starts with
        wave(front, [rng.integers(3, 500, USER + k * 64).tolist() for k in range(MAX_NUM_SEQS)],
              max_tokens=8)
        out: dict[str, Any] = {"device_blocks": {r: c["num_gpu_blocks"] for r, c in config.items()},
                               "block_size": block}
        seen: set[tuple[int, ...]] = set()
        proxy = urls.get("PROXY_URL")
        for seed, (regime, n) in enumerate(CONVERSATIONS.items(), start=1):
            out[regime] = _regime(name, regime, n, seed, front, who, how, seen, block, proxy)
    return out


def _regime(name: str, regime: str, n: int, seed: int, front: str, who: dict, how: Stack,
            seen: set[tuple[int, ...]], block: int, proxy: str | None = None) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    system = rng.integers(3, 500, SYSTEM).tolist()
    histories = [list(system) for _ in range(n)]
    labelled = _labelled(who)
    turns = []
    for k in range(TURNS):
        for history in histories:
            history += rng.integers(3, 500, USER).tolist()
        prompts = [list(h) for h in histories]
        held = sum(held_tokens(p, seen, block) for p in prompts)
        routed, before, start = routes(proxy), scrape(who), time.perf_counter()
        answers = wave(front, prompts)
        wall = time.perf_counter() - start
        answered = sum(len(p) for p, a in zip(prompts, answers) if "error" not in a)
        turns.append(wave_figures(answers, held, before, scrape(who), how.d_workers, answered))
        turns[-1]["routes"] = {c: n - routed.get(c, 0) for c, n in routes(proxy).items()}
        for prompt, history, answer in zip(prompts, histories, answers):
            remember(prompt, seen, block)
            history += answer.get("tokens", [])
        t = turns[-1]
        _say(f"{name} {regime} turn {k + 1}: p50/p90 TTFT {t['p50_ttft_ms']}/{t['p90_ttft_ms']} "
             f"ms, p50 TPOT {t['p50_tpot_ms']} ms, prefilled {t['computed_tokens']} of "
             f"{t['prompt_tokens']} tokens ({t['held_tokens']} held, recompute "
             f"{t['recompute_fraction']}), KV moved {t['kv_moved']}, routes {t['routes']}, "
             f"mean ms {_where_time_went(t.get('breakdown_ms'))}, "
             f"{t['failed']} failed, "
             f"{wall:.1f} s")
    moved = [(t["kv_moved"], t["requests"] - t["failed"]) for t in turns]
    return {"conversations": n, "turns": turns,
            "kv_moved": (round(sum(m * c for m, c in moved) / max(1, sum(c for _, c in moved)), 3)
                         if all(m is not None for m, _ in moved) else None),
            **labelled_deltas(labelled, _labelled(who))}


def _where_time_went(breakdown: dict[str, float | None] | None) -> str:
    """A wave's mean queue and prefill (D: first step) times per request, where measured."""
    keys = ("p_queue", "p_prefill", "d_queue", "d_first_step")
    return " ".join(f"{k} {breakdown[k]}" for k in keys if (breakdown or {}).get(k) is not None) or "-"


def labelled_deltas(before: dict[str, float], after: dict[str, float]) -> dict[str, dict]:
    """`pool`: every kvxfer pool series' change (`"ROLE name{labels}"`, as `_labelled` reads
    them), zero or not; `cached_by_source`: the prefix-hit tokens by tier that changed."""
    changed = {key: round(v - before.get(key, 0.0), 3) for key, v in after.items()}
    return {"pool": {k: v for k, v in changed.items() if k.split(" ")[1].startswith(_POOL)},
            "cached_by_source": {k: v for k, v in changed.items()
                                 if k.split(" ")[1].startswith(_BY_SOURCE) and v}}


def wave(url: str | list[str], prompts: list[list[int]], max_tokens: int = ANSWER,
         sessions: list[str] | None = None) -> list[dict[str, Any]]:
    """Every prompt at once, streamed: each one's TTFT, TPOT and answer tokens (or error), sent
    to `url` (or prompt `i` to `url[i]`). With `sessions`, each prompt is sent as its
    session's (`X-Session-Id`), asking for the usage at the end of the stream (what `kvxfer
    proxy --peer-reads` reads an answer's length from)."""
    urls = [url] * len(prompts) if isinstance(url, str) else url
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda u, p, s: _answer(u, p, max_tokens, s), urls, prompts,
                             sessions or [None] * len(prompts)))


def _answer(url: str, prompt: list[int], max_tokens: int, session: str | None = None
            ) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    if session is not None:
        body["stream_options"] = {"include_usage": True}
    try:
        first, last, choices = stream(url, body, {"X-Session-Id": session} if session else None)
    except Exception as e:  # noqa: BLE001 - a failed request is counted, the wave goes on
        return {"error": f"{type(e).__name__}: {e}"}
    tokens = [t for c in choices for t in c.get("token_ids") or ()]
    return {"ttft_s": first, "tokens": tokens,
            "tpot_s": (last - first) / (len(tokens) - 1) if len(tokens) > 1 else None}


def routes(proxy: str | None) -> dict[str, int]:
    """`kvxfer proxy`'s requests so far by choice (`pd`, `local`: D prefilled alone); {} without
    one."""
    out: dict[str, int] = {}
    for name, labels, value in samples(proxy) if proxy else ():
        if name == "kvxfer_proxy_routes_total":
            choice = re.search(r'choice="(\w+)"', labels).group(1)
            out[choice] = out.get(choice, 0) + int(value)
    return out


def peer_reads(proxy: str | None) -> dict[str, int]:
    """`kvxfer proxy --peer-reads`' lookups so far by outcome; {} without any."""
    return {re.search(r'outcome="(\w+)"', labels).group(1): int(value)
            for name, labels, value in (samples(proxy) if proxy else ())
            if name == "kvxfer_proxy_peer_reads_total"}


def _cache_config(url: str) -> dict[str, int]:
    """The instance's block size and device blocks, from `vllm:cache_config_info`'s labels."""
    for name, labels, _ in samples(url):
        if name == "vllm:cache_config_info":
            return {key: int(re.search(rf'[{{,]{key}="(\d+)"', labels).group(1))
                    for key in ("block_size", "num_gpu_blocks")}
    raise InvalidInputError(f"{url}/metrics has no vllm:cache_config_info")


def _labelled(who: dict[str, str | None]) -> dict[str, float]:
    """P's and D's samples of the pool's and the cache tiers' series, one per label set:
    `"ROLE name{labels}"`."""
    return {f"{role} {name}{labels}": value for role, url in who.items() if url
            for name, labels, value in samples(url) if name.startswith(_POOL + _BY_SOURCE)
            and not name.endswith(("_created", "_bucket"))}


def pct(values: list[float], q: int) -> float | None:
    return round(float(np.percentile(values, q)), 1) if values else None


def _say(line: str) -> None:
    print(f"bench serve --multi-turn: {line}", file=sys.stderr, flush=True)


def _plot(result: dict[str, Any], path: Path) -> str | None:
    """p50 TTFT per turn, one line per stack, for each regime; and each stack's recompute
    fraction per turn under pressure. The file's path, or None without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    turns = list(range(1, TURNS + 1))
    for ax, (regime, key, title) in zip(axes, (
            ("fits", "p50_ttft_ms", "fits: p50 TTFT (ms)"),
            ("pressure", "p50_ttft_ms", "pressure: p50 TTFT (ms)"),
            ("pressure", "recompute_fraction", "pressure: recompute fraction"))):
        for stack, figures in result["stacks"].items():
            ax.plot(turns, [t[key] for t in figures[regime]["turns"]], marker="o", label=stack)
        ax.set_xlabel("turn")
        ax.set_xticks(turns)
        ax.set_title(title)
    return save(plt, fig, axes, path)
