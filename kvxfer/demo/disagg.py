"""`kvxfer demo`: a real model decoding on D from KV that P prefilled, against colocated decode.

Two processes, each with its own devices and its own copy of the demo decoder
(`kvxfer.demo.model`, same seed, same weights):

- **P** (TP `tp_p`) prefills the prompts in chunks under a token budget, with
  lookahead blocks and a prefix-cache hit, and saves what `SaveTracker` plans
  through `PrefillConnector` after each step. Then it prefills them again,
  saving with the old "newly allocated blocks" rule (`NewBlocksTracker`), and
  decodes its own first run: the colocated run at `tp_p`.
- **D** (TP `tp_d`) reads each finished request over NIXL into its own block
  ids, checks fingerprints, scatters, compares the prompt's KV with P's byte
  for byte, and decodes greedily. Then it runs the colocated reference at
  `tp_d`: prefill and decode in one instance, the same steps P ran.

The parent relays `kv_transfer_params` from P to D as a router would, and
compares: D's tokens and logits against the colocated run's (bit-identical
at equal TP), the colocated runs at the two TPs against each other (the
noise floor of a TP change), and the old rule's decode against the same
reference. Processes talk JSON lines; every wait has a deadline.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvxfer.demo.kvbytes import token_rows
from kvxfer.demo.procs import Children, Load, Proc, Reader, Saver, Side, connector, run_child
from kvxfer.errors import InvalidInputError
from kvxfer.plan.blocks import cdiv, is_int

__all__ = ["BLOCK_SIZE", "DemoConfig", "MAX_PROMPT", "MAX_PROMPTS", "NOISE_FACTOR", "PHASES",
           "compare", "report", "run_demo"]

BLOCK_SIZE = 16
MAX_PROMPT = 4096  # with MAX_PROMPTS, keeps a run within a few minutes on two CPU cores
MAX_PROMPTS = 16
PHASES = ("kvxfer", "old")
# D's logits (P's KV at TP p, decode at TP d) against colocated at TP d may exceed the noise
# measured between whole runs at the two TPs by rounding luck: both come from the same
# reordered float32 sums. Twice the noise is the bound; a stale token costs ~100x.
NOISE_FACTOR = 2.0


@dataclass
class DemoConfig:
    """One demo run. `cached[i]` is prompt `i`'s prefix-cache hit in tokens (on P and on the
    colocated reference); `None` gives the third prompt, if any, a hit of up to 4 blocks."""

    prompts: list[int] = field(default_factory=lambda: [40, 300, 517, 130])
    cached: list[int] | None = None
    seed: int = 0
    tp_p: int = 4
    tp_d: int = 8
    dtype: str = "bfloat16"
    budget: int = 96
    lookahead: int = 3
    decode_tokens: int = 16
    timeout_s: float = 120.0

    def hits(self) -> list[int]:
        if self.cached is not None:
            return list(self.cached) if isinstance(self.cached, (list, tuple)) else self.cached
        hits = [0] * len(self.prompts)
        if len(self.prompts) >= 3:
            shared = min(self.prompts[2] - 1, max(self.prompts[:2]), 4 * BLOCK_SIZE)
            hits[2] = shared // BLOCK_SIZE * BLOCK_SIZE
        return hits

    def model_config(self):
        from kvxfer.demo.model import ModelConfig

        return ModelConfig(block_size=BLOCK_SIZE, cache_dtype=self.dtype, seed=self.seed)

    def validate(self) -> None:
        """Raise `InvalidInputError` naming the flag and value, before any process starts."""
        from kvxfer.demo.model import CACHE_DTYPES

        prompts = self.prompts
        if (not isinstance(prompts, (list, tuple)) or not prompts
                or not all(is_int(n) and 0 < n <= MAX_PROMPT for n in prompts)):
            raise InvalidInputError(f"--prompts must be a non-empty list of ints in [1, {MAX_PROMPT}], "
                                    f"got {prompts!r}")
        if self.dtype not in CACHE_DTYPES:
            raise InvalidInputError(f"--dtype {self.dtype!r} is not one of {', '.join(CACHE_DTYPES)}")
        if len(prompts) > MAX_PROMPTS:
            raise InvalidInputError(f"--prompts lists {len(prompts)} prompts; the demo runs at most "
                                    f"{MAX_PROMPTS}")
        if not is_int(self.seed) or not 0 <= self.seed < 2**32:
            raise InvalidInputError(f"--seed must be an int in [0, 2**32), got {self.seed!r}")
        for flag, value, low in (("--budget", self.budget, 1),
                                 ("--lookahead", self.lookahead, 0),
                                 ("--decode-tokens", self.decode_tokens, 1)):
            if not is_int(value) or value < low:
                raise InvalidInputError(f"{flag} must be an int >= {low}, got {value!r}")
        if self.budget > 1024:
            raise InvalidInputError(f"--budget {self.budget} is more than the demo's 1024 tokens a step")
        for flag, value, most in (("--lookahead", self.lookahead, 64),
                                  ("--decode-tokens", self.decode_tokens, 256)):
            if value > most:
                raise InvalidInputError(f"{flag} {value} is more than the demo's {most}")
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
            raise InvalidInputError(f"DemoConfig.timeout_s must be a positive number, got {t!r}")
        hits = self.hits()
        if not isinstance(hits, list) or len(hits) != len(prompts):
            raise InvalidInputError(f"DemoConfig.cached {hits!r} must give one hit per prompt of "
                                    f"{list(prompts)}")
        for i, (hit, n) in enumerate(zip(hits, prompts)):
            if not is_int(hit) or not 0 <= hit < n or hit % BLOCK_SIZE:
                raise InvalidInputError(f"DemoConfig.cached[{i}] {hit!r} must be a multiple of "
                                        f"{BLOCK_SIZE} in [0, prompt {n})")
        model = self.model_config()
        for flag, tp in (("--tp-p", self.tp_p), ("--tp-d", self.tp_d)):
            model.check_tp(tp, flag)  # at most 8 here: the model's 8 KV heads


# -- P and D, each in its own process -----------------------------------------------


def _model_and_prompts(cfg: DemoConfig, tp: int):
    """What P and D both build: the model at `tp`, the engine's shapes, the prompts."""
    from kvxfer.demo.engine import Shapes, demo_prompts
    from kvxfer.demo.model import ShardedDecoder, make_mesh

    model = ShardedDecoder(cfg.model_config(), make_mesh(tp))
    shapes = Shapes.of(cfg.prompts, BLOCK_SIZE, cfg.budget, cfg.lookahead, cfg.decode_tokens)
    return model, shapes, demo_prompts(cfg.seed, cfg.prompts, cfg.hits())


class _Prefill(Saver):
    """P: prefills the prompts twice (kvxfer's save rule, then the old one), saving through
    its connector; then decodes the first run itself, the colocated run at P's TP."""

    wait_s = 0.01

    def __init__(self, cfg: DemoConfig, out, workdir: str):
        from kvxfer.demo.engine import pool_blocks

        self.cfg, self.workdir = cfg, workdir
        self.model, self.shapes, self.tokens = _model_and_prompts(cfg, cfg.tp_p)
        self.pool = pool_blocks(dict(enumerate(self.tokens)), BLOCK_SIZE, cfg.lookahead)
        self.extra = self.shapes.decode_blocks * len(self.tokens)
        caches = self.model.new_caches(self.pool + self.extra)
        super().__init__(out, connector("P", caches, 2 * self.pool, BLOCK_SIZE))
        self.caches = caches

    def run(self) -> None:
        from kvxfer.demo.engine import NewBlocksTracker, decode_each, prefill
        from kvxfer.plan.save_plan import GroupSpec

        cfg, first_run = self.cfg, None
        for phase in PHASES:
            if phase == "old":
                self.conn.scheduler.tracker = NewBlocksTracker([GroupSpec(BLOCK_SIZE)])
                # Fresh zeros: blocks still holding the first run's KV would hide stale tokens.
                self.caches = self.model.new_caches(self.pool + self.extra)
            prompts = {f"{phase}-{i}": t for i, t in enumerate(self.tokens)}
            cached = {f"{phase}-{i}": hit for i, hit in enumerate(cfg.hits())}
            for req_id, prompt in prompts.items():
                self.conn.add_request(req_id, len(prompt))
            caches, done = prefill(self.model, self.caches, prompts, cached, self.shapes,
                                   lookahead=cfg.lookahead, num_blocks=self.pool,
                                   after_step=self._saver(phase))
            if phase == "kvxfer":
                first_run = (caches, {r: p.table for r, p in done.items()}, prompts)
        # P's own decode of the first run: the colocated run at P's TP.
        caches, tables, prompts = first_run
        _, decoded = decode_each(self.model, caches, prompts, tables, cfg.decode_tokens,
                                 self.shapes, iter(range(self.pool, self.pool + self.extra)),
                                 between=self.step)
        for req_id, d in decoded.items():
            self.say(reference=int(req_id.split("-")[1]), role="P", tokens=d.tokens,
                     logits=_save_logits(d.logits, self.workdir, "P", req_id))
        self.wait_freed(2 * len(self.tokens), cfg.timeout_s)
        self.say(freed=sorted(self.freed))

    def _saver(self, phase: str):
        """`after_step` for one phase's prefill: save through the connector, tell the parent
        of each finished request (with P's KV of its prompt, for D's byte check)."""
        conn, copies, chunks = self.conn, Counter(), Counter()

        def save(scheduled, caches, engine):
            meta = conn.build_connector_meta(scheduled)
            conn.wait_for_save(caches, meta)
            chunks.update(s.req_id for s in scheduled)
            for req_id, ids in meta.kernel_ids.items():
                copies.update((req_id, k) for k in ids)
            for req_id in sorted(meta.completed):
                req = engine.requests[req_id]
                expected = f"{self.workdir}/{req_id}-kv.npy"
                np.save(expected, np.stack([token_rows(c, req.tables[0], req.num_prompt_tokens,
                                                       BLOCK_SIZE).view(np.uint8) for c in caches]))
                mine = [n for (r, _), n in copies.items() if r == req_id]
                # params is None when the request did not fit P's staging: D then fails it.
                self.say(params=conn.request_finished(req_id), phase=phase,
                         index=int(req_id.split("-")[1]), expected=expected,
                         chunks=chunks[req_id], copied=sum(mine),
                         recopied=sum(1 for n in mine if n > 1))
            self.step()
            return caches

        return save


def _save_logits(logits: list[np.ndarray], workdir: str, role: str, name: str) -> str:
    path = f"{workdir}/{role}-{name}-logits.npy"
    np.save(path, np.stack(logits))
    return path


class _Decode(Reader):
    """D: reads each finished request into its own block ids, checks P's KV byte for byte,
    decodes greedily; once all have come, runs the colocated reference at D's TP."""

    def __init__(self, cfg: DemoConfig, out, workdir: str):
        from kvxfer.demo.engine import decode, decode_blocks

        self.cfg, self.workdir = cfg, workdir
        self.model, self.shapes, self.tokens = _model_and_prompts(cfg, cfg.tp_d)
        self.need = [decode_blocks(len(t), cfg.decode_tokens, BLOCK_SIZE) for t in self.tokens]
        num_blocks = 2 + len(PHASES) * sum(self.need)  # the null block, one spare, every request
        caches = self.model.new_caches(num_blocks)
        super().__init__(out, connector("D", caches, num_blocks), caches)
        # Compile the decode step now (in the spare block), not inside the first transfer's time.
        self.caches, _ = decode(self.model, self.caches, self.tokens[0][:1], [num_blocks - 1], 1,
                                self.shapes)
        self.free = list(range(num_blocks - 2, 0, -1))  # D's own ids: reversed, unlike P's
        self.arrived: list[Load] = []  # loaded, not yet decoded
        self.results, self.referenced = 0, False

    def command(self, msg: dict[str, Any]) -> None:
        if msg["params"] is None:  # P could not stage it
            self.say(phase=msg["phase"], index=msg["index"], ok=False,
                     error="P sent no kv_transfer_params (its staging was full)")
            self.results += 1
            return
        i = msg["index"]
        table = [self.free.pop() for _ in range(self.need[i])]
        self.load(msg["params"]["req_id"], msg["params"],
                  table[: cdiv(len(self.tokens[i]), BLOCK_SIZE)], msg=msg, decode_table=table)

    def loaded(self, load: Load, now: float) -> None:
        load.about["seconds"] = time.perf_counter() - load.started  # the transfer, not decode
        self.arrived.append(load)

    def lost(self, load: Load, now: float, errors: list[int]) -> None:
        msg = load.about["msg"]
        self.say(phase=msg["phase"], index=msg["index"], ok=False,
                 error=f"load failed; logical blocks {errors}")
        self.results += 1

    def step(self) -> None:
        from kvxfer.demo.engine import colocated, decode

        super().step()
        if self.arrived and not self.loads:  # decoding never stalls a read in flight
            load = self.arrived.pop(0)
            msg, table = load.about["msg"], load.about["decode_table"]
            prompt = self.tokens[msg["index"]]
            # Tokens [0, n - 1): D's first decode step rewrites the last prompt token's KV.
            want = np.load(msg["expected"])[:, : len(prompt) - 1]
            got = np.stack([token_rows(c, table, len(prompt) - 1, BLOCK_SIZE).view(np.uint8)
                            for c in self.caches])
            self.caches, d = decode(self.model, self.caches, prompt, table,
                                    self.cfg.decode_tokens, self.shapes)
            self.say(phase=msg["phase"], index=msg["index"], ok=True,
                     stale_tokens=int((got != want).any(axis=(0, 2)).sum()), mb=want.nbytes / 1e6,
                     seconds=load.about["seconds"], tokens=d.tokens,
                     logits=_save_logits(d.logits, self.workdir, "D",
                                         f"{msg['phase']}-{msg['index']}"))
            self.results += 1
        if self.results == len(PHASES) * len(self.tokens) and not self.referenced:
            self.referenced = True
            prompts = {f"ref-{i}": t for i, t in enumerate(self.tokens)}
            cached = {f"ref-{i}": hit for i, hit in enumerate(self.cfg.hits())}
            reference = colocated(self.model, prompts, cached, self.shapes,
                                  lookahead=self.cfg.lookahead, decode_tokens=self.cfg.decode_tokens)
            for req_id, d in reference.items():
                self.say(reference=int(req_id.split("-")[1]), role="D", tokens=d.tokens,
                         logits=_save_logits(d.logits, self.workdir, "D", req_id))


def _side(role: str, fields: dict[str, Any], out) -> Side:
    cfg = DemoConfig(**{k: v for k, v in fields.items() if k != "workdir"})
    return (_Prefill if role == "P" else _Decode)(cfg, out, fields["workdir"])


# -- the parent ----------------------------------------------------------------------


def compare(tokens: list[int], logits: np.ndarray, ref_tokens: list[int],
            ref_logits: np.ndarray) -> dict[str, Any]:
    """Greedy decodes compared step by step, up to and including the first differing token
    (after it the inputs differ and logits no longer compare)."""
    diverged = next((i for i, (a, b) in enumerate(zip(tokens, ref_tokens)) if a != b), None)
    upto = len(tokens) if diverged is None else diverged + 1
    diffs = np.abs(logits[:upto] - ref_logits[:upto]).max(axis=-1)
    return {"tokens_equal": diverged is None, "diverged_at": diverged,
            "max_logit_diff": float(diffs.max()), "logit_diffs": [float(x) for x in diffs]}


def _collect(children: Children, p: Proc, d: Proc, cfg: DemoConfig
             ) -> tuple[dict, dict, dict, list[str]]:
    """Relay P's params to D and gather everyone's messages until all have come."""
    n = len(cfg.prompts)
    sent: dict[tuple[str, int], dict] = {}
    got: dict[tuple[str, int], dict] = {}
    refs: dict[tuple[int, int], dict] = {}
    freed: list[list[str]] = []

    def handle(proc: Proc, msg: dict[str, Any]) -> None:
        if "reference" in msg:
            refs[msg["role"], msg["reference"]] = msg
        elif "freed" in msg:
            freed.append(msg["freed"])
        elif proc is d:
            got[msg["phase"], msg["index"]] = msg
        else:
            sent[msg["phase"], msg["index"]] = msg
            d.send(**msg)

    children.relay(handle, lambda: len(got) == len(PHASES) * n and len(refs) == 2 * n and freed,
                   "the demo")
    return sent, got, refs, freed[0]


def run_demo(cfg: DemoConfig) -> dict[str, Any]:
    """Run P and D as two processes; returns per-prompt results, the TP noise and the old rule's."""
    cfg.validate()
    t0 = time.perf_counter()
    # The children's arrays (P's KV for D's byte check, logits for the parent) live here.
    with tempfile.TemporaryDirectory(prefix="kvxfer-demo-") as workdir:
        cfg_json = json.dumps({**asdict(cfg), "workdir": workdir})
        with Children("kvxfer.demo.disagg", cfg.timeout_s) as children:
            p, d, _ = children.pair(cfg_json, cfg.tp_p, cfg.tp_d)
            sent, got, refs, freed = _collect(children, p, d, cfg)
        result = _judge(cfg, sent, got, refs)
    result.update(p_freed=freed, seconds=time.perf_counter() - t0)
    return result


def _load(msg: dict) -> tuple[list[int], np.ndarray]:
    return msg["tokens"], np.load(msg["logits"])


def _judge(cfg: DemoConfig, sent: dict, got: dict, refs: dict) -> dict[str, Any]:
    hits = cfg.hits()
    reference = {i: _load(refs["D", i]) for i in range(len(cfg.prompts))}
    # Colocated in P's process at P's TP against colocated in D's at D's TP: at equal TP
    # this must be 0 (one program, same inputs), else it is the rounding a TP change costs.
    noise = max(compare(*_load(refs["P", i]), *reference[i])["max_logit_diff"] for i in reference)
    out: dict[str, Any] = {"tp_p": cfg.tp_p, "tp_d": cfg.tp_d, "dtype": cfg.dtype,
                           "tp_noise": noise, "prompts": [], "old_rule": {"prompts": []}}
    for phase in PHASES:
        for i, n in enumerate(cfg.prompts):
            d, p = got[phase, i], sent.get((phase, i), {})
            row = {"index": i, "prompt_tokens": n, "cached_tokens": hits[i], "loaded": d["ok"]}
            if d["ok"]:
                row.update(compare(*_load(d), *reference[i]), stale_tokens=d["stale_tokens"],
                           d_tokens=d["tokens"], colocated_tokens=reference[i][0])
            else:
                row.update(tokens_equal=False, error=d["error"])
            if phase == "kvxfer":
                row.update(chunks=p["chunks"], blocks_copied=p["copied"],
                           blocks_recopied=p["recopied"], mb=d.get("mb"),
                           transfer_s=d.get("seconds"))
                exact = row.get("max_logit_diff") == 0.0 if cfg.tp_p == cfg.tp_d else \
                    row.get("max_logit_diff", np.inf) <= NOISE_FACTOR * noise
                row["ok"] = bool(d["ok"] and row["stale_tokens"] == 0 and row["tokens_equal"] and exact)
                out["prompts"].append(row)
            else:
                out["old_rule"]["prompts"].append(row)
    old = out["old_rule"]["prompts"]
    out["old_rule"]["decoded_differently"] = sum(not r["tokens_equal"] for r in old)
    out["old_rule"]["max_logit_diff"] = max(r.get("max_logit_diff", 0.0) for r in old)
    out["ok"] = all(r["ok"] for r in out["prompts"])
    return out


def _toks(tokens: list[int], k: int = 6) -> str:
    return " ".join(f"{t:3d}" for t in tokens[:k])


def report(result: dict[str, Any], cfg: DemoConfig) -> list[str]:
    same = cfg.tp_p == cfg.tp_d
    lines = [f"P: TP {cfg.tp_p}, D: TP {cfg.tp_d}; cache {cfg.dtype}, block {BLOCK_SIZE}, "
             f"budget {cfg.budget}, lookahead {cfg.lookahead}; {cfg.decode_tokens} tokens decoded",
             f"noise of a TP change (colocated TP {cfg.tp_p} vs TP {cfg.tp_d}): max logit diff "
             f"{result['tp_noise']:.3g}" if not same else
             f"same TP on P and D: D's logits must equal colocated bit for bit (colocated in P's "
             f"and in D's process differ by {result['tp_noise']:.3g})"]
    for r in result["prompts"]:
        head = (f"prompt {r['index']}: {r['prompt_tokens']} tokens"
                + (f" ({r['cached_tokens']} prefix-cached)" if r["cached_tokens"] else "")
                + f", {r['chunks']} chunks, {r['blocks_recopied']} blocks re-copied")
        if not r["loaded"]:
            lines.append(f"{head}: LOAD FAILED: {r['error']}")
            continue
        lines.append(f"{head}, {r['mb']:.2f} MB in {1e3 * r['transfer_s']:.1f} ms")
        lines.append(f"  D         {_toks(r['d_tokens'])} ...")
        lines.append(f"  colocated {_toks(r['colocated_tokens'])} ...  "
                     f"{'equal' if r['tokens_equal'] else 'DIFFERENT'}, max logit diff "
                     f"{r['max_logit_diff']:.3g}{'' if r['ok'] else '  FAILED'}")
    if not same:
        lines.append(f"(with different TP, D's logits must be within {NOISE_FACTOR:g}x the TP noise)")
    old = result["old_rule"]
    stale = sum(r.get("stale_tokens", 0) for r in old["prompts"])
    lines.append(f"old rule (copy newly allocated blocks): {stale} prompt tokens stale on D; "
                 f"{old['decoded_differently']} of {len(old['prompts'])} prompts decode differently; "
                 f"max logit diff {old['max_logit_diff']:.3g}"
                 + (f" ({old['max_logit_diff'] / result['tp_noise']:.0f}x the TP noise)"
                    if result["tp_noise"] else ""))
    lines.append("D decodes exactly as colocated" if result["ok"] else "SOME PROMPTS FAILED")
    return lines


if __name__ == "__main__":
    run_child(_side)
