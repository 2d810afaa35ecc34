"""`kvxfer bench serve --equal-hardware`: kvxfer's P/D against colocated instances, every engine
on cores of its own.

On shared cores P/D runs two engines where a colocated stack runs one, with no compute of its
own to win with. Here every engine is pinned from its start (`scripts/pd-up`'s `PD_P_CPUS`,
`PD_D_CPUS`; JAX sizes its thread pools from the cores it may use) to one core of its own,
the two cores this process may use, with the same model, `max_model_len`, chunk budget,
prefix caching and KV cache size per engine. Client and proxy are not pinned. Each arm has its
best settings for that hardware:

- `colocated`: two `vllm serve` instances (pd-up's `PD_CONNECTOR=none`), one per core, each
  with `SEQS` decode slots; each conversation (or request) kept on one of them, in turn (the
  best routing two independent instances get for these workloads: every turn finds its
  history in its instance's prefix cache).
- `kvxfer`: P on one core, D on the other, D with both instances' decode slots
  (`PD_D_MAX_NUM_SEQS`: D alone holds the decode batch), behind `kvxfer proxy` splitting
  every request (neither of the choices below).
- `kvxfer_whole`: the same, the proxy serving a request whole on P while D's slots are all
  taken (`--decode-slots`, `--whole-slots`: P is then a colocated instance whose decode
  capacity would otherwise idle between prefills).
- `kvxfer_adaptive`: that, and D prefilling a request itself while P has one in flight and
  D a slot free (`--prefill-queue 1`: D is then a colocated instance whose core would
  otherwise wait for P's queue).

Workloads (`WORKLOADS`), each at its levels of requests in flight (closed loop: a
conversation's next turn starts when every conversation's turn has ended):

- `multi_turn`: conversations resending their history: a shared 256-token system prompt, per
  turn a 96-token message and a 64-token answer (greedy, `ignore_eos`), 4 turns.
- `chat`: independent 300-token prompts, 64-token answers.
- `long_in`: independent 900-token prompts, 8-token answers: where aggregation should win.

**The limit first.** On one pinned colocated instance, `SEQS` requests decode alone, then the
same beside `SEQS` prompts of `LIMIT_PROMPT` tokens prefilled in the chunk budget's steps:
their p50 TPOT over the alone one is the most any split of prefill from decode can win on
TPOT here (`limit.tpot_beside_prefill_over_alone`).

Per arm, workload and level: TTFT p50/p90/p99 (and `ttft_p50_later`, turns 2 and later),
TPOT p50/p90/p99, output tokens per second of wall time, and SLO attainment: the share of
requests whose TTFT is within `TTFT_SLO` times, and TPOT within `TPOT_SLO` times, the
workload's unloaded figures (one request alone on a colocated instance, measured first);
`goodput` is those requests per second. Repeats alternate the arms' order. With `--json` the
last line is one JSON object whose `ratios` hold, per workload, kvxfer's best arm over the
best colocated arm (at the highest level): `tpot_p90`, `ttft_p90`, `goodput`, and for
`multi_turn` `ttft_p50_later`. tpu-inference's connector is not an arm yet (its stack fails
requests under this pinning from the second turn on: the issue that asked for this says
so), so `kvxfer_over_tpu` is None. `.pd/bench/equal.json` keeps the figures.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvxfer.bench.load import OUT, ROOT, Stack, need_stack, ratio, started
from kvxfer.bench.multiturn import pct, wave
from kvxfer.errors import InvalidInputError

__all__ = ["ARMS", "WORKLOADS", "Workload", "attainment", "run", "summary"]

SEQS = 4
"""Decode slots of each colocated instance and of P (`--max-num-seqs`); D gets twice that."""
TTFT_SLO, TPOT_SLO = 5.0, 2.0
"""The objectives, as multiples of the workload's unloaded TTFT and TPOT."""
LIMIT_PROMPT = 900


@dataclass(frozen=True)
class Workload:
    system: int
    user: int
    answer: int
    turns: int
    levels: tuple[int, ...]


WORKLOADS = {"multi_turn": Workload(256, 96, 64, 4, (8,)),
             "chat": Workload(0, 300, 64, 1, (8,)),
             "long_in": Workload(0, 900, 8, 1, (4,))}
_WHOLE = f"--decode-slots {2 * SEQS} --whole-slots {SEQS}"
ARMS = {"colocated": None,  # first: the limit and the objectives are measured on it
        "kvxfer": {"PD_PROXY_ARGS": "--decode-slots 0 --whole-slots 0 --prefill-queue 0"},
        "kvxfer_whole": {"PD_PROXY_ARGS": f"{_WHOLE} --prefill-queue 0"},
        "kvxfer_adaptive": {"PD_PROXY_ARGS": f"{_WHOLE} --prefill-queue 1"}}


def run(repeats: int = 1, workloads: tuple[str, ...] = tuple(WORKLOADS)) -> dict[str, Any]:
    need_stack("kvxfer bench serve --equal-hardware")
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise InvalidInputError(f"--equal-hardware pins each engine to a core of its own: this "
                                f"process may use {len(cores)} core(s), it needs 2")
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown or not workloads:
        raise InvalidInputError(f"workloads are some of {', '.join(WORKLOADS)}, got {workloads!r}")
    p_cpu, d_cpu = str(cores[0]), str(cores[1])
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "cores": [p_cpu, d_cpu],
                              "seqs": SEQS, "slo": {"ttft": TTFT_SLO, "tpot": TPOT_SLO},
                              "arms": {arm: {} for arm in ARMS}}
    for r in range(repeats):
        for arm in (list(ARMS) if r % 2 == 0 else list(reversed(ARMS))):
            with _arm(arm, p_cpu, d_cpu) as (urls, sessions):
                if "unloaded" not in result:  # the first start is colocated's: on its first
                    result["limit"] = _limit(urls(0))  # instance, before any workload
                    result["unloaded"] = {w: _unloaded(urls(0), WORKLOADS[w], seed=90 + i)
                                          for i, w in enumerate(workloads)}
                for i, w in enumerate(workloads):
                    for level in WORKLOADS[w].levels:
                        figures = _workload(urls, sessions, WORKLOADS[w], level, seed=10 * r + i,
                                            unloaded=result["unloaded"][w])
                        result["arms"][arm].setdefault(w, {}).setdefault(str(level), []).append(
                            figures)
                        _say(f"{arm} {w} x{level} (repeat {r + 1}): {_line(figures)}")
    result["ratios"] = summary(result, workloads)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "equal.json").write_text(json.dumps(result, indent=1))
    return result


@contextlib.contextmanager
def _colocated(p_cpu: str, d_cpu: str):
    """Two colocated instances, one per core; yields their URLs."""
    with contextlib.ExitStack() as stack:
        urls = []
        for i, cpu in enumerate((p_cpu, d_cpu)):
            env = stack.enter_context(started(
                ROOT / ".pd" / f"equal-colocated{i}", Stack({"PD_CONNECTOR": "none"}),
                {"PD_P_PORT": str(8170 + i), "PD_P_CPUS": cpu, "PD_MAX_NUM_SEQS": str(SEQS)}))
            urls.append(env["P_URL"])
        yield urls


@contextlib.contextmanager
def _arm(arm: str, p_cpu: str, d_cpu: str):
    """`arm`'s stack up; yields the URL each request index goes to (by its conversation,
    `urls(i)`), and whether to name sessions."""
    if ARMS[arm] is None:
        with _colocated(p_cpu, d_cpu) as urls:
            yield (lambda i: urls[i % len(urls)]), False
        return
    settings = {"PD_P_CPUS": p_cpu, "PD_D_CPUS": d_cpu, "PD_MAX_NUM_SEQS": str(SEQS),
                "PD_D_MAX_NUM_SEQS": str(2 * SEQS), "PD_PROXY_PORT": "8075",
                "PD_P_PORT": "8175", "PD_D_PORT": "8275", "PD_KV_PORT": "5675", **ARMS[arm]}
    with started(ROOT / ".pd" / f"equal-{arm}", Stack({}), settings) as env:
        yield (lambda i: env["PROXY_URL"]), True


def _workload(urls, sessions: bool, w: Workload, n: int, seed: int,
              unloaded: dict[str, float]) -> dict[str, Any]:
    """`n` conversations of `w` through `urls`: every turn's answers, and the figures."""
    rng = np.random.default_rng(seed)
    system = rng.integers(3, 500, w.system).tolist()
    histories = [list(system) for _ in range(n)]
    names = [f"eq-{seed}-{i}" for i in range(n)] if sessions else None
    answers, start = [], time.perf_counter()
    for turn in range(w.turns):
        for h in histories:
            h += rng.integers(3, 500, w.user).tolist()
        got = wave([urls(i) for i in range(n)], [list(h) for h in histories], w.answer, names)
        for h, a in zip(histories, got):
            h += a.get("tokens", [])
        answers += [{**a, "turn": turn} for a in got]
    wall = time.perf_counter() - start
    return figures(answers, wall, unloaded)


def figures(answers: list[dict[str, Any]], wall: float, unloaded: dict[str, float]
            ) -> dict[str, Any]:
    """TTFT and TPOT percentiles (ms), output tokens/s, SLO attainment and goodput of one
    workload run's answers (`ttft_s`, `tpot_s`, `tokens`, `turn`; or `error`)."""
    done = [a for a in answers if "error" not in a]
    ttft = [a["ttft_s"] * 1e3 for a in done]
    later = [a["ttft_s"] * 1e3 for a in done if a["turn"] > 0]
    tpot = [a["tpot_s"] * 1e3 for a in done if a.get("tpot_s") is not None]
    met = attainment(done, unloaded)
    return {"requests": len(answers), "failed": len(answers) - len(done),
            **{f"ttft_p{q}_ms": pct(ttft, q) for q in (50, 90, 99)},
            "ttft_p50_later_ms": pct(later, 50),
            **{f"tpot_p{q}_ms": pct(tpot, q) for q in (50, 90, 99)},
            "tokens_per_s": round(sum(len(a["tokens"]) for a in done) / wall, 2),
            "attainment": round(met / len(answers), 3) if answers else None,
            "goodput": round(met / wall, 3), "wall_s": round(wall, 1)}


def attainment(answers: list[dict[str, Any]], unloaded: dict[str, float]) -> int:
    """How many answers met both objectives: TTFT within `TTFT_SLO` times the unloaded TTFT,
    TPOT within `TPOT_SLO` times the unloaded TPOT (an answer of one token has no TPOT)."""
    return sum(a["ttft_s"] <= TTFT_SLO * unloaded["ttft_s"]
               and (a.get("tpot_s") is None or a["tpot_s"] <= TPOT_SLO * unloaded["tpot_s"])
               for a in answers)


def _unloaded(url: str, w: Workload, seed: int) -> dict[str, float]:
    """One request of `w`'s first turn alone on a colocated instance: the objectives' base."""
    rng = np.random.default_rng(seed)
    [a] = wave(url, [rng.integers(3, 500, w.system + w.user).tolist()], max(w.answer, 8))
    if "error" in a:
        raise InvalidInputError(f"the unloaded request failed: {a['error']}")
    return {"ttft_s": a["ttft_s"], "tpot_s": a["tpot_s"]}


def _limit(url: str) -> dict[str, Any]:
    """On one pinned instance: `SEQS` requests decoding alone, then beside `SEQS` prompts of
    `LIMIT_PROMPT` tokens (one output token each) prefilled at once."""
    rng = np.random.default_rng(7)
    short = [rng.integers(3, 500, 64).tolist() for _ in range(SEQS)]
    alone = wave(url, short, 64)
    long = [rng.integers(3, 500, LIMIT_PROMPT).tolist() for _ in range(SEQS)]
    beside = wave(url, [rng.integers(3, 500, 64).tolist() for _ in range(SEQS)] + long,
                  64)[:SEQS]
    a = pct([x["tpot_s"] * 1e3 for x in alone if "error" not in x], 50)
    b = pct([x["tpot_s"] * 1e3 for x in beside if "error" not in x], 50)
    return {"tpot_alone_ms": a, "tpot_beside_prefill_ms": b,
            "tpot_beside_prefill_over_alone": ratio(b, a), "prompt": LIMIT_PROMPT,
            "seqs": SEQS}


def summary(result: dict[str, Any], workloads: tuple[str, ...]) -> dict[str, Any]:
    """Per workload, at its highest level: kvxfer's best arm over the best colocated arm
    (the medians over repeats): `tpot_p90`, `ttft_p90` (lower is better: the best is the
    lowest), `goodput` (the highest), and for `multi_turn` `ttft_p50_later`."""
    out: dict[str, Any] = {"kvxfer_over_tpu": None}
    for w in workloads:
        level = str(max(WORKLOADS[w].levels))
        med = {arm: {k: _median([f[k] for f in result["arms"][arm][w][level]])
                     for k in ("tpot_p90_ms", "ttft_p90_ms", "goodput", "ttft_p50_later_ms")}
               for arm in ARMS}
        ours = [a for a in ARMS if ARMS[a] is not None]
        theirs = [a for a in ARMS if ARMS[a] is None]
        keys = [("tpot_p90", "tpot_p90_ms", True), ("ttft_p90", "ttft_p90_ms", True),
                ("goodput", "goodput", False)]
        if w == "multi_turn":
            keys.append(("ttft_p50_later", "ttft_p50_later_ms", True))
        out[w] = {name: ratio(_best(med, ours, key, low), _best(med, theirs, key, low))
                  for name, key, low in keys}
    return out


def _best(med: dict[str, dict[str, Any]], arms: list[str], key: str, low: bool) -> float | None:
    """The best of `arms`' `key`: the lowest (`low`) or the highest."""
    values = [med[a][key] for a in arms if med[a][key] is not None]
    return (min(values) if low else max(values)) if values else None


def table(result: dict[str, Any]) -> list[str]:
    """A row per arm, workload and level: the medians over repeats."""
    lines = [f"the limit: p50 TPOT {result['limit']['tpot_alone_ms']} ms alone, "
             f"{result['limit']['tpot_beside_prefill_ms']} ms beside prefills "
             f"({result['limit']['tpot_beside_prefill_over_alone']}x)",
             "| arm | workload | in flight | TTFT p50/p90/p99 ms | later TTFT p50 | "
             "TPOT p50/p90/p99 ms | tokens/s | attainment | goodput | failed |",
             "| --- " * 10 + "|"]
    for arm, per in result["arms"].items():
        for w, levels in per.items():
            for level, runs in levels.items():
                m = {k: _median([f[k] for f in runs]) for k in runs[0]}
                lines.append(
                    f"| {arm} | {w} | {level} | {m['ttft_p50_ms']}/{m['ttft_p90_ms']}/"
                    f"{m['ttft_p99_ms']} | {m['ttft_p50_later_ms']} | {m['tpot_p50_ms']}/"
                    f"{m['tpot_p90_ms']}/{m['tpot_p99_ms']} | {m['tokens_per_s']} | "
                    f"{m['attainment']} | {m['goodput']} | {m['failed']} |")
    return lines


def _median(values: list[Any]) -> float | None:
    values = [v for v in values if v is not None]
    return round(float(np.median(values)), 3) if values else None


def _line(f: dict[str, Any]) -> str:
    return (f"TTFT p50/p90 {f['ttft_p50_ms']}/{f['ttft_p90_ms']} ms (later {f['ttft_p50_later_ms']}), "
            f"TPOT p50/p90 {f['tpot_p50_ms']}/{f['tpot_p90_ms']} ms, {f['tokens_per_s']} tokens/s, "
            f"attainment {f['attainment']}, {f['failed']} failed, {f['wall_s']} s")


def _say(line: str) -> None:
    print(f"bench serve --equal-hardware: {line}", file=sys.stderr, flush=True)
