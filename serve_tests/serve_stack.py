"""A real P/D pair for the serving tests: `vllm serve` on tpu-inference's runner (JAX CPU).

The fixtures that start one per test module are in conftest.py.

Each stack is started by `scripts/pd-up` (P `kv_producer`, D `kv_consumer` with kvxfer's
connector, `kvxfer proxy` in front) in a run directory of its own, and stopped by
`scripts/pd-down` when its tests are done, whatever they did. Every wait is bounded: pd-up's
(`PD_TIMEOUT`), and each request's (`TIMEOUT_S`). Runs from `.venv-tpu`
(`scripts/tpu-inference-env`); its python runs these tests too.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT_S = 120  # one request, prefill and decode included
START_S = 300  # pd-up's bound on the stack becoming healthy (compiles included)
CHUNK = 80  # tokens per prefill step: not a multiple of the 64-token block, so blocks straddle


@dataclass
class Stack:
    """A running P/D pair and its proxy (the addresses pd-up recorded)."""

    dir: Path
    model: str  # served model name
    p_url: str
    d_url: str
    proxy_url: str
    d1_url: str | None = None  # a second D on one host (scripts/ray-pd-up with RAY_PD_D1=1)
    d1_proxy_url: str | None = None  # `kvxfer proxy` to P, then D1

    def complete(self, url: str, prompt: list[int], max_tokens: int = 8, **extra) -> dict:
        """A greedy `/v1/completions` of token ids `prompt` at `url`, with top-3 logprobs;
        raises `urllib.error.HTTPError` for an error status (its body readable)."""
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0, "logprobs": 3, "return_token_ids": True, **extra}
        return post(url + "/v1/completions", body)

    def pid(self, name: str) -> int:
        return int((self.dir / f"{name}.pid").read_text())


def random_prompt(n: int, seed: int) -> list[int]:
    """`n` token ids of the tiny model's vocabulary, none of them special."""
    return np.random.default_rng(seed).integers(3, 500, n).tolist()


def post(url: str, body: dict, headers: dict | None = None) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
        return json.loads(response.read())


def start(name: str, **env: str) -> Iterator[Stack]:
    run_dir = ROOT / ".pd" / f"serve_tests-{name}"
    environ = {**os.environ, "PD_DIR": str(run_dir), "PD_CHUNK": str(CHUNK),
               "PD_TIMEOUT": str(START_S), "PD_MODEL_NAME": "tiny",
               "PD_EXTRA_ARGS": "--enable-prompt-tokens-details", **env}  # stats on: /metrics
    model = ROOT / ".pd" / "serve_tests-model"  # built once, shared by every stack
    if not (model / "config.json").exists():
        subprocess.run([ROOT / ".venv-tpu/bin/python", "scripts/tiny-model", str(model)],
                       cwd=ROOT, check=True, timeout=300)
    try:
        subprocess.run(["bash", "scripts/pd-up", str(model)], cwd=ROOT, env=environ, check=True,
                       timeout=START_S + 60)
        recorded = dict(line.split("=", 1) for line in
                        (run_dir / "stack.env").read_text().splitlines() if "=" in line)
        yield Stack(run_dir, recorded["MODEL_NAME"], recorded["P_URL"], recorded["D_URL"],
                    recorded["PROXY_URL"])
    finally:
        subprocess.run(["bash", "scripts/pd-down"], cwd=ROOT, env=environ, timeout=120)


def http_error(call) -> urllib.error.HTTPError:
    """The HTTP error `call()` raises (fails the test if it answers)."""
    try:
        answer = call()
    except urllib.error.HTTPError as e:
        return e
    pytest.fail(f"expected an error status, got an answer: {json.dumps(answer)[:300]}")


def _ray_env(name: str) -> dict[str, str]:
    return {**os.environ, "RAY_PD_DIR": str(ROOT / ".pd" / f"serve_tests-{name}"),
            "RAY_PD_TAG": "st", "RAY_PD_D1": "1", "PD_CHUNK": str(CHUNK), "PD_MODEL_NAME": "tiny",
            "PD_EXTRA_ARGS": "--enable-prompt-tokens-details",
            "RAY_SERVE_KV_EXTRA": f'"host_pool_bytes": {16 << 20}'}  # P's pool (D: ignored)


def restart_ray_p(name: str) -> None:
    """Start P's server of `start_ray(name)`'s stack again (`scripts/ray-pd-up --restart-p`)."""
    subprocess.run(["bash", "scripts/ray-pd-up", "--restart-p"], cwd=ROOT, env=_ray_env(name),
                   check=True, timeout=START_S)


def start_ray(name: str) -> Iterator[Stack]:
    """P and D each over two Ray nodes of their own (network namespaces), tpu-inference's Ray
    executor running their workers, and D1 on one host of its own (vLLM's one-process
    executor), started by `scripts/ray-pd-up` and stopped by `scripts/ray-pd-down` whatever
    the tests did. Skipped where namespaces cannot be made (not root, no `ip`) or Ray is not
    installed; CI runs as root, and the set-up installs Ray."""
    from kvxfer.bench.hosts import netns_available

    reason = netns_available()
    if reason is None and not (ROOT / ".venv-tpu" / "bin" / "ray").exists():
        reason = "Ray is not installed in .venv-tpu (scripts/tpu-inference-env installs it)"
    if reason is not None:
        pytest.skip(reason)
    environ = _ray_env(name)
    run_dir = Path(environ["RAY_PD_DIR"])
    model = ROOT / ".pd" / "serve_tests-model"
    if not (model / "config.json").exists():
        subprocess.run([ROOT / ".venv-tpu/bin/python", "scripts/tiny-model", str(model)],
                       cwd=ROOT, check=True, timeout=300)
    try:
        try:
            subprocess.run(["bash", "scripts/ray-pd-up", str(model)], cwd=ROOT, env=environ,
                           check=True, timeout=600)  # two clusters, three servers compiling
        except subprocess.CalledProcessError:
            # Once (2026-12-06, CI) a Ray worker process died while P's engine warmed up,
            # with nothing in any log: the start is tried again, its first logs kept.
            failed = run_dir.with_name(run_dir.name + "-failed-start")
            shutil.rmtree(failed, ignore_errors=True)
            shutil.copytree(run_dir, failed)
            print(f"ray-pd-up failed; starting the stack again (the first start's logs: "
                  f"{failed})", file=sys.stderr)
            subprocess.run(["bash", "scripts/ray-pd-down"], cwd=ROOT, env=environ, timeout=180)
            subprocess.run(["bash", "scripts/ray-pd-up", str(model)], cwd=ROOT, env=environ,
                           check=True, timeout=600)
        recorded = dict(line.split("=", 1) for line in
                        (run_dir / "stack.env").read_text().splitlines() if "=" in line)
        yield Stack(run_dir, recorded["MODEL_NAME"], recorded["P_URL"], recorded["D_URL"],
                    recorded["PROXY_URL"], recorded["D1_URL"], recorded["D1_PROXY_URL"])
    finally:
        subprocess.run(["bash", "scripts/ray-pd-down"], cwd=ROOT, env=environ, timeout=180)
