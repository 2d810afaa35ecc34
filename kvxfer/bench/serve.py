"""`kvxfer bench serve`: D's time to first token with kvxfer's connector and with tpu-inference's.

For each connector in turn, `scripts/pd-up` starts the same P/D pair of `vllm serve`
(tpu-inference 0.32's runner on JAX CPU, from `.venv-tpu`; P and D at TP 1, a 64-token
chunk budget) with that connector; `scripts/pd-down` stops it. tpu-inference's own
`TPUConnector` is configured as its docs say (module
`tpu_inference.distributed.tpu_connector`, its side-channel and transfer ports per
process); the one patch it gets beyond the CPU shims is the load order it needs
(tpu_cpu's `tpu_connector.load_before_forward`, with `PD_CONNECTOR=tpu`): vLLM 0.32 calls
`start_load_kv` after the forward, where that connector inserts the KV it pulled.

Per prompt length, a warm-up request (compiles) and then `rounds` requests, each a fresh
random prompt so neither P nor D holds any of it: prefill on P (`max_tokens=1`,
`do_remote_decode`), then D, streaming, with P's `kv_transfer_params`. D's time to first
token runs from sending D's request to its first streamed token: the transfer and one
decode step. D's text is compared with P answering the same prompt alone. `kv_mb` is the
KV of the prompt's blocks (layers x blocks x block bytes, from the model's config), what
kvxfer moves. `ttft_ratio` is kvxfer's median over tpu-inference's, per length and their
geometric mean (below 1: kvxfer is faster).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from kvxfer.errors import InvalidInputError

__all__ = ["run", "block_bytes", "stream"]

ROOT = Path(__file__).resolve().parents[2]
LENGTHS = (64, 256, 512, 900)
CONNECTORS = {"kvxfer": {}, "tpu_inference": {"PD_CONNECTOR": "tpu"}}
TIMEOUT_S = 120


def run(rounds: int = 5, lengths: tuple[int, ...] = LENGTHS) -> dict[str, Any]:
    pd_up = ROOT / "scripts" / "pd-up"
    if not pd_up.exists() or not (ROOT / ".venv-tpu" / "bin" / "vllm").exists():
        raise InvalidInputError(
            f"kvxfer bench serve runs from a checkout of kvxfer with .venv-tpu built "
            f"(bash scripts/tpu-inference-env); {pd_up} or {ROOT / '.venv-tpu'} is missing")
    result: dict[str, Any] = {"lengths": list(lengths), "rounds": rounds}
    for name, env in CONNECTORS.items():
        result[name] = _one_connector(name, env, rounds, lengths)
    ratios = {str(n): round(result["kvxfer"]["ttft_ms"][str(n)]["median"]
                            / result["tpu_inference"]["ttft_ms"][str(n)]["median"], 3)
              for n in lengths}
    result["ttft_ratio"] = {**ratios, "geomean": round(math.exp(statistics.fmean(
        math.log(r) for r in ratios.values())), 3)}
    result["ok"] = all(result[name]["tokens_equal"] == result[name]["requests"]
                       for name in CONNECTORS)
    return result


def _one_connector(name: str, env: dict[str, str], rounds: int, lengths: tuple[int, ...]
                   ) -> dict[str, Any]:
    run_dir = ROOT / ".pd" / f"bench-{name}"
    model = ROOT / ".pd" / "bench-model"
    if not (model / "config.json").exists():
        subprocess.run([str(ROOT / ".venv-tpu/bin/python"), "scripts/tiny-model", str(model)],
                       cwd=ROOT, check=True, timeout=300, stdout=sys.stderr)
    environ = {**os.environ, "PD_DIR": str(run_dir), "PD_MODEL_NAME": "tiny", **env}
    try:
        subprocess.run(["bash", "scripts/pd-up", str(model)], cwd=ROOT, env=environ,
                       check=True, timeout=600, stdout=sys.stderr)  # stdout: the figures only
        urls = dict(line.split("=", 1) for line in (run_dir / "stack.env").read_text().splitlines()
                    if "=" in line)
        return _measure(urls["P_URL"], urls["D_URL"], model, rounds, lengths)
    finally:
        subprocess.run(["bash", "scripts/pd-down"], cwd=ROOT, env=environ, timeout=120,
                       stdout=sys.stderr)


def _measure(p_url: str, d_url: str, model: Path, rounds: int, lengths: tuple[int, ...]
             ) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    per_block, block = block_bytes(model)
    ttft: dict[str, dict[str, float]] = {}
    equal = requests = 0
    for n in lengths:
        times = []
        for r in range(rounds + 1):  # the first compiles
            prompt = rng.integers(3, 500, n).tolist()
            alone = _complete(p_url, prompt, 8)["choices"][0]["text"]
            prefill = _complete(p_url, prompt, 1, kv_transfer_params={"do_remote_decode": True})
            first_s, text = _stream(d_url, prompt, 8, prefill.get("kv_transfer_params"))
            if r:
                times.append(first_s * 1e3)
                requests += 1
                equal += text == alone
        ttft[str(n)] = {"median": round(statistics.median(times), 1),
                        "p90": round(float(np.percentile(times, 90)), 1)}
    return {"ttft_ms": ttft, "tokens_equal": equal, "requests": requests,
            "kv_mb": {str(n): round(math.ceil(n / block) * per_block / 1e6, 3) for n in lengths}}


def block_bytes(model: Path) -> tuple[int, int]:
    """Bytes of one 64-token block over every layer (K and V, the config's dtype), and 64."""
    config = json.loads((model / "config.json").read_text())
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[config.get("dtype", "float32")]
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    block = 64  # tpu-inference's block size for this model on CPU (its log says so)
    return (config["num_hidden_layers"] * block * 2 * config["num_key_value_heads"] * head_dim
            * itemsize), block


def _post(url: str, body: dict, headers: dict[str, str] | None = None):
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json", **(headers or {})})
    return urllib.request.urlopen(request, timeout=TIMEOUT_S)


def _complete(url: str, prompt: list[int], max_tokens: int, **extra) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **extra}
    with _post(url + "/v1/completions", body) as response:
        return json.loads(response.read())


def _stream(url: str, prompt: list[int], max_tokens: int, params: dict | None
            ) -> tuple[float, str]:
    """(seconds to the first streamed token, the whole text) of D's streamed answer."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "kv_transfer_params": params}
    first, _, choices = stream(url, body)
    return first, "".join(choice.get("text", "") for choice in choices)


def stream(url: str, body: dict, headers: dict[str, str] | None = None
           ) -> tuple[float, float, list[dict]]:
    """Seconds from sending `body` (a completion, sent with `stream: true`, and `headers`) to
    `url`'s first streamed chunk and to its last, and each chunk's first choice."""
    start = time.perf_counter()
    first, last, choices = None, 0.0, []
    with _post(url + "/v1/completions", {**body, "stream": True}, headers) as response:
        for line in response:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choices.append((json.loads(line[6:]).get("choices") or [{}])[0])
            last = time.perf_counter() - start
            if first is None:  # a token's chunk (its text may be empty: part of a UTF-8 character)
                first = last
    if first is None:
        raise InvalidInputError(f"{url} streamed no token")
    return first, last, choices
