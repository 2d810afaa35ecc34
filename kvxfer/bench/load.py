"""`kvxfer bench serve --load`: P/D under load, sent by vLLM's own benchmark client.

Three stacks, started in turn by `scripts/pd-up` on the same cores (tpu-inference 0.32's
runner on JAX CPU, from `.venv-tpu`, the tiny float32 Llama, TP 1): kvxfer's connector
behind `kvxfer proxy`, tpu-inference's own `TPUConnector` behind the same proxy, and one
colocated `vllm serve` (the baseline disaggregation has to beat or explain). Against each,
`vllm bench serve` (random dataset, fixed seed, the completions endpoint, `--ignore-eos`)
at each load point: a prompt length and a number of requests in flight
(`--max-concurrency`), after one unrecorded run per prompt length that compiles the
batch shapes.

Per stack and load point: completed and failed requests, p50/p90/p99 TTFT, TPOT and ITL,
throughput, and `kv_moved`: the share of requests D loaded from P (kvxfer's
`vllm:kvxfer_num_transfers` on D, against the requests completed; None for the stacks
that do not count it). `ratios` are kvxfer's over tpu-inference's (p90 TTFT, p50 TPOT),
per load point. `breakdown` says where the TTFT went, as means per request from the
engines' own histograms (deltas of `/metrics` around the load point): P's queue and
prefill and D's queue and first step (vLLM's, for every stack: the colocated one is P
alone), P's gather into staging and D's wait for the KV (connect, read, ack, scatter:
kvxfer's, None elsewhere), and D's handover (D's queue time outside the KV wait, plus its
first step). A progress line per load point goes to stderr; `.pd/bench/load.json` and
`load.png` (TTFT and TPOT against load, one line per stack; with matplotlib) keep them.

`--hosts 2` (`run(hosts=2)`): P and D each over two hosts against each on one, kvxfer's
connector and the same TP 4 in both: `scripts/ray-pd-up` (two Ray nodes of two devices per
instance, tpu-inference's Ray executor, each node its own network namespace) against
`scripts/pd-up` (one process of four devices per instance), at `HOSTS_LOADS`; and P over
two hosts with D on one (`RAY_PD_D_NODES=1`: one process of four devices, staging units).
One request's TTFT is the one-in-flight point's; `ratios` are two hosts over one,
`ratios_d_one_host` P over two hosts and D on one over both on one;
`.pd/bench/hosts.json` and `hosts.png` keep them.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

from kvxfer.errors import InvalidInputError

__all__ = ["run", "HOSTS", "HOSTS_LOADS", "LOADS", "STACKS", "Stack", "bench_model", "need_stack",
           "deltas", "pyplot", "ratio", "roles", "samples", "save", "scrape",
           "started"]

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / ".pd" / "bench"


class Stack(NamedTuple):
    """How to start and stop one stack, and what it counts."""

    env: dict[str, str]
    up: str = "pd-up"
    down: str = "pd-down"
    d_workers: int = 1
    """D's worker processes: each counts a transfer when it has read its piece of the KV."""

    @property
    def counts(self) -> bool:
        """Whether D runs kvxfer's connector, and so has its counters (else `kv_moved` is
        None)."""
        return self.env.get("PD_CONNECTOR", "kvxfer") == "kvxfer"


STACKS = {"kvxfer": Stack({}),
          "tpu_inference": Stack({"PD_CONNECTOR": "tpu"}),
          "colocated": Stack({"PD_CONNECTOR": "none"})}
LOADS = ((256, 1), (256, 2), (256, 4), (1024, 1), (1024, 2), (1024, 4))
"""(prompt tokens, requests in flight) of each load point."""
HOSTS = {"one_host": Stack({"PD_P_TP": "4", "PD_D_TP": "4"}),
         "two_hosts": Stack({"RAY_PD_NODES": "2", "RAY_PD_DEVICES": "2"}, up="ray-pd-up",
                            down="ray-pd-down", d_workers=2),
         "d_one_host": Stack({"RAY_PD_NODES": "2", "RAY_PD_DEVICES": "2", "RAY_PD_D_NODES": "1"},
                             up="ray-pd-up", down="ray-pd-down")}
HOSTS_LOADS = ((256, 1), (256, 4))
OUTPUT_TOKENS = 32
PER_POINT = 3
"""Requests per load point: this many times the concurrency (at least 4)."""

_HIST = {  # breakdown name: (role, histogram)
    "p_queue": ("P", "vllm:request_queue_time_seconds"),
    "p_prefill": ("P", "vllm:request_prefill_time_seconds"),
    "p_gather": ("P", "vllm:kvxfer_gather_time_seconds"),
    "d_kv_wait": ("D", "vllm:kvxfer_kv_wait_time_seconds"),
    "d_connect": ("D", "vllm:kvxfer_connect_time_seconds"),
    "d_read": ("D", "vllm:kvxfer_read_time_seconds"),
    "d_ack": ("D", "vllm:kvxfer_ack_time_seconds"),
    "d_scatter": ("D", "vllm:kvxfer_scatter_time_seconds"),
    "d_queue": ("D", "vllm:request_queue_time_seconds"),
    "d_first_step": ("D", "vllm:request_prefill_time_seconds"),
}
_COUNTERS = {"d_transfers": ("D", "vllm:kvxfer_num_transfers_total"),
             "d_fallbacks": ("D", "vllm:kvxfer_num_fallbacks_total")}


def run(loads: tuple[tuple[int, int], ...] | None = None, hosts: int = 1) -> dict[str, Any]:
    if hosts not in (1, 2):
        raise InvalidInputError(f"--hosts takes 1 (kvxfer, tpu-inference's connector and one "
                                f"colocated instance) or 2 (P and D over two hosts against one), "
                                f"got {hosts!r}")
    stacks, (mine, theirs), name = ((STACKS, ("kvxfer", "tpu_inference"), "load") if hosts == 1
                                    else (HOSTS, ("two_hosts", "one_host"), "hosts"))
    loads = loads or (LOADS if hosts == 1 else HOSTS_LOADS)
    need_stack("kvxfer bench serve --load")
    OUT.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"loads": [list(x) for x in loads], "output_tokens": OUTPUT_TOKENS,
                              "date": time.strftime("%Y-%m-%d"), "cores": os.cpu_count()}
    for stack, how in stacks.items():
        result[stack] = _stack(stack, how, loads)
    result["ratios"] = _ratios(result[mine], result[theirs])
    if hosts == 2:
        result["ratios_d_one_host"] = _ratios(result["d_one_host"], result[theirs])
    result["ok"] = all(p.get("failed", 1) == 0 for s in stacks for p in result[s].values()) and \
        all(p.get("kv_moved") == 1.0 for s, how in stacks.items() if how.counts
            for p in result[s].values())
    (OUT / f"{name}.json").write_text(json.dumps(result, indent=1))
    result["plot"] = _plot(result, loads, stacks, OUT / f"{name}.png")
    return result


def need_stack(command: str) -> None:
    """Raise unless this is a checkout of kvxfer with `scripts/pd-up` and `.venv-tpu`."""
    vllm = ROOT / ".venv-tpu" / "bin" / "vllm"
    if not (ROOT / "scripts" / "pd-up").exists() or not vllm.exists():
        raise InvalidInputError(f"{command} runs from a checkout of kvxfer with .venv-tpu built "
                                f"(bash scripts/tpu-inference-env); {vllm} is missing")


def bench_model() -> Path:
    """The tiny float32 Llama every serving benchmark runs, built on first use."""
    model = ROOT / ".pd" / "bench-model"
    if not (model / "config.json").exists():
        subprocess.run([str(ROOT / ".venv-tpu/bin/python"), "scripts/tiny-model", str(model)],
                       cwd=ROOT, check=True, timeout=300, stdout=sys.stderr)
    return model


@contextlib.contextmanager
def started(run_dir: Path, how: Stack, settings: dict[str, str]) -> Iterator[dict[str, str]]:
    """Stack `how` up in `run_dir` with pd-up's `settings` (`PD_...`, over the caller's
    environment), serving `bench_model()` as "tiny"; yields `stack.env`'s addresses, and
    stops the stack however the block ends. A failed start raises `CalledProcessError`
    (pd-up has stopped what it started and printed the logs' tails)."""
    environ = {**os.environ, "PD_DIR": str(run_dir), "RAY_PD_DIR": str(run_dir),
               "PD_MODEL_NAME": "tiny", "PD_EXTRA_ARGS": "", **settings, **how.env}
    try:
        subprocess.run(["bash", f"scripts/{how.up}", str(bench_model())], cwd=ROOT, env=environ,
                       check=True, timeout=600, stdout=sys.stderr)
        yield dict(line.split("=", 1) for line in (run_dir / "stack.env").read_text().splitlines()
                   if "=" in line)
    finally:
        subprocess.run(["bash", f"scripts/{how.down}"], cwd=ROOT, env=environ, timeout=120,
                       stdout=sys.stderr)


@contextlib.contextmanager
def front(run_dir: Path, name: str, port: int, argv: list[str]) -> Iterator[str]:
    """A router (`argv`: `kvxfer proxy ...` or `vllm-router ...`, from `.venv-tpu`, listening
    on `port`) until the block ends; yields its URL once its `/health` answers. Its log is
    `run_dir/NAME.log`."""
    url = f"http://127.0.0.1:{port}"
    run_dir.mkdir(parents=True, exist_ok=True)
    log = open(run_dir / f"{name}.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([str(ROOT / ".venv-tpu" / "bin" / argv[0]), *argv[1:]], stdout=log,
                            stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=5):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{name} did not start: see {log.name}") from None
                time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def roles(urls: dict[str, str]) -> dict[str, str | None]:
    """P's and D's base URLs from `stack.env`'s addresses (D None for one colocated
    instance)."""
    return {"P": urls["P_URL"], "D": urls.get("D_URL") or None}


def _stack(name: str, how: Stack, loads: tuple[tuple[int, int], ...]
           ) -> dict[str, dict[str, Any]]:
    run_dir = ROOT / ".pd" / f"load-{name}"
    model = bench_model()
    longest = max(n for n, _ in loads) + OUTPUT_TOKENS
    settings = {"PD_MAX_MODEL_LEN": str(-(-longest // 128) * 128),
                "PD_MAX_NUM_SEQS": str(max(c for _, c in loads))}
    points: dict[str, dict[str, Any]] = {}
    with started(run_dir, how, settings) as urls:
        front = urls.get("PROXY_URL") or urls["P_URL"]
        for n in dict.fromkeys(n for n, _ in loads):  # compiles every batch shape, unrecorded
            _client(front, model, n, max(c for _, c in loads), run_dir / f"warm-{n}.json",
                    seed=n, ready_check=True)
        for i, (n, concurrency) in enumerate(loads):
            before = scrape(roles(urls))
            point = _client(front, model, n, concurrency, run_dir / f"{n}-{concurrency}.json",
                            seed=1_000_000 + i)
            point.update(deltas(before, scrape(roles(urls)), point["completed"], how.d_workers))
            points[f"{n}x{concurrency}"] = point
            print(f"bench serve --load: {name} {n} tokens x {concurrency} in flight: p90 TTFT "
                  f"{point['p90_ttft_ms']} ms, p50 TPOT {point['median_tpot_ms']} ms, "
                  f"{point['completed']} done, {point['failed']} failed, KV moved "
                  f"{point.get('kv_moved')}", file=sys.stderr, flush=True)
    return points


def _client(url: str, model: Path, prompt: int, concurrency: int, out: Path, seed: int,
            ready_check: bool = False) -> dict[str, Any]:
    """One `vllm bench serve` run; its figures. Each run has prompts of its own (`seed`): a
    prompt an engine saw before would be a prefix-cache hit, on D not loaded at all. Only
    the warm-up sends vLLM's ready-check request, which `completed` would not count."""
    num = max(4, PER_POINT * concurrency)
    argv = [str(ROOT / ".venv-tpu/bin/vllm"), "bench", "serve", "--backend", "vllm",
            "--base-url", url, "--endpoint", "/v1/completions", "--model", "tiny",
            "--tokenizer", str(model), "--dataset-name", "random",
            "--random-input-len", str(prompt), "--random-output-len", str(OUTPUT_TOKENS),
            "--random-range-ratio", "0", "--num-prompts", str(num),
            "--max-concurrency", str(concurrency), "--request-rate", "inf", "--ignore-eos",
            "--temperature", "0", "--seed", str(seed), "--num-warmups", "0",
            "--percentile-metrics", "ttft,tpot,itl", "--metric-percentiles", "50,90,99",
            "--disable-tqdm", "--save-result", "--result-dir", str(out.parent),
            "--result-filename", out.name,
            "--ready-check-timeout-sec", "60" if ready_check else "0"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "JAX_PLATFORMS": "cpu"}
    returncode = _relay(argv, env, timeout_s=900)
    if returncode or not out.exists():
        raise InvalidInputError(f"vllm bench serve against {url} failed (exit "
                                f"{returncode}); its output is above")
    raw = json.loads(out.read_text())
    point = {"completed": raw.get("completed", 0),
             "failed": raw.get("failed", num - raw.get("completed", 0)),
             "request_throughput": _round(raw.get("request_throughput")),
             "output_throughput": _round(raw.get("output_throughput"))}
    for metric in ("ttft", "tpot", "itl"):
        for stat in ("median", "p90", "p99"):
            point[f"{stat}_{metric}_ms"] = _round(raw.get(f"{stat}_{metric}_ms"))
    return point


def _relay(argv: list[str], env: dict[str, str], timeout_s: float) -> int:
    """Run `argv`, its output passed on to stderr as it comes and ended by a newline
    (nanobind's leak warning at exit has none: the progress line would follow it on the
    same line); killed after `timeout_s`. Its exit status."""
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, errors="replace")
    timer = threading.Timer(timeout_s, proc.kill)
    timer.start()
    last = "\n"
    try:
        for line in proc.stdout:
            sys.stderr.write(line)
            last = line[-1:]
    finally:
        timer.cancel()
        proc.stdout.close()
        proc.wait()
    if last != "\n":
        sys.stderr.write("\n")
    return proc.returncode


_LINE = re.compile(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})?\s+(\S+)")


def samples(url: str) -> Iterator[tuple[str, str, float]]:
    """Every sample of `url`'s `/metrics`: its name, its label set as written (`{...}`, or
    "" for none) and its value."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as response:
        text = response.read().decode()
    for line in text.splitlines():
        m = _LINE.match(line)
        if m and not line.startswith("#"):
            yield m.group(1), m.group(2) or "", float(m.group(3))


def scrape(roles: dict[str, str | None]) -> dict[tuple[str, str], float]:
    """Every sample of P's and D's `/metrics`, summed over label sets: `(role, name)`."""
    out: dict[tuple[str, str], float] = {}
    for role, url in roles.items():
        for name, _, value in samples(url) if url is not None else ():
            out[(role, name)] = out.get((role, name), 0.0) + value
    return out


def deltas(before: dict, after: dict, completed: int, d_workers: int = 1) -> dict[str, Any]:
    """KV moved and the breakdown (mean seconds per request, as ms) between two scrapes.

    Each of D's `d_workers` counts a transfer once it read its piece of a request's KV, so
    `kv_moved` is the transfers over `completed * d_workers`.
    """
    def delta(role: str, name: str) -> float | None:
        if (role, name) not in after:
            return None
        return after[(role, name)] - before.get((role, name), 0.0)

    moved = delta(*_COUNTERS["d_transfers"])
    out: dict[str, Any] = {"kv_moved": None if moved is None or not completed
                           else round(moved / (completed * d_workers), 3)}
    fallbacks = delta(*_COUNTERS["d_fallbacks"])
    if fallbacks is not None:
        out["fallbacks"] = int(fallbacks)
    breakdown = {}
    for key, (role, name) in _HIST.items():
        total, count = delta(role, name + "_sum"), delta(role, name + "_count")
        breakdown[key] = round(1e3 * total / count, 2) if total is not None and count else None
    wait, queue = breakdown.get("d_kv_wait"), breakdown.get("d_queue")
    breakdown["d_handover"] = (round(queue - wait + (breakdown.get("d_first_step") or 0), 2)
                               if wait is not None and queue is not None else None)
    if any(v is not None for v in breakdown.values()):
        out["breakdown_ms"] = breakdown
    return out


def _ratios(mine: dict[str, dict[str, Any]], theirs: dict[str, dict[str, Any]]
            ) -> dict[str, dict[str, float | None]]:
    """Per load point, `mine` over `theirs` for p50 and p90 TTFT and p50 TPOT."""
    return {key: {m: ratio(point.get(m), theirs.get(key, {}).get(m))
                  for m in ("median_ttft_ms", "p90_ttft_ms", "median_tpot_ms")}
            for key, point in mine.items()}


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def _round(v: Any) -> float | None:
    return None if v is None else round(float(v), 2)


def _plot(result: dict[str, Any], loads: tuple[tuple[int, int], ...], stacks: dict[str, Stack],
          path: Path) -> str | None:
    """TTFT and TPOT against load, one line per stack and prompt length; the file's path, or
    None without matplotlib."""
    plt = pyplot()
    if plt is None:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric, title in zip(axes, ("p90_ttft_ms", "median_tpot_ms"),
                                 ("p90 TTFT (ms)", "p50 TPOT (ms)")):
        for stack in stacks:
            for n in dict.fromkeys(n for n, _ in loads):
                xs = [c for m, c in loads if m == n]
                ys = [result[stack].get(f"{n}x{c}", {}).get(metric) for c in xs]
                ax.plot(xs, ys, marker="o", label=f"{stack}, {n} tokens")
        ax.set_xlabel("requests in flight")
        ax.set_title(title)
    return save(plt, fig, axes, path)


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files only), or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save(plt: Any, fig: Any, axes: Any, path: Path) -> str:
    """The first panel's legend, then `fig` saved to `path` and closed; the path."""
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)
