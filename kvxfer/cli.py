"""The `kvxfer` command: `kvxfer demo`, `kvxfer plan`, `kvxfer proxy` and `kvxfer bench ...`."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from kvxfer.errors import InvalidInputError, KvxferError, SetupError
from kvxfer.plan.blocks import cdiv, is_int
from kvxfer.plan.save_plan import GroupSpec, SaveTracker
from kvxfer.plan.simulate import SimEngine

__all__ = ["build_parser", "main", "plan_report"]


def _names(ids: Sequence[int], table: Sequence[int]) -> str:
    index = {b: i for i, b in enumerate(table)}
    return " ".join(f"b{index[b]}" for b in ids) or "nothing"


def _spans(positions: Sequence[int]) -> str:
    spans: list[list[int]] = []
    for p in positions:
        if spans and spans[-1][1] == p - 1:
            spans[-1][1] = p
        else:
            spans.append([p, p])
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in spans)


_PLAN_BLOCKS = 4096
"""Blocks in the simulated engine's pool that `kvxfer plan` runs (block 0 is the null block)."""


def _check_plan_args(prompt: int, budget: int, block_size: int, lookahead: int, cached: int,
                     dcp: int) -> None:
    """Raise `InvalidInputError` naming the first bad flag, before anything is simulated."""
    for flag, value, low in (("--prompt", prompt, 1), ("--budget", budget, 1),
                             ("--block-size", block_size, 1), ("--lookahead", lookahead, 0),
                             ("--cached", cached, 0), ("--dcp", dcp, 1)):
        if not is_int(value) or value < low:
            kind = "positive" if low else "non-negative"
            raise InvalidInputError(f"{flag} must be {kind}, got {value!r}")
    tokens_per_block = block_size * dcp
    if cached >= prompt or cached % tokens_per_block:
        raise InvalidInputError(
            f"--cached must be a whole number of {tokens_per_block}-token blocks below "
            f"--prompt {prompt}, got cached tokens {cached}"
        )
    need = cdiv(prompt + lookahead, tokens_per_block)
    if need > _PLAN_BLOCKS - 1:
        raise InvalidInputError(
            f"--prompt {prompt} plus --lookahead {lookahead} need {need} blocks of "
            f"{tokens_per_block} tokens, more than the simulated engine's {_PLAN_BLOCKS - 1}; "
            f"lower --prompt or --lookahead, or raise --block-size"
        )


def plan_report(prompt: int, budget: int, block_size: int, lookahead: int = 0,
                cached: int = 0, dcp: int = 1) -> tuple[list[str], bool]:
    """Simulate one chunked prefill; return the report lines and whether kvxfer left D current.

    Beside kvxfer's plan it runs the old rule ("copy the blocks newly
    allocated this step") on a second host buffer, to show what that leaves stale.
    """
    _check_plan_args(prompt, budget, block_size, lookahead, cached, dcp)
    group = GroupSpec(block_size, dcp_size=dcp)
    engine = SimEngine([group], num_blocks=_PLAN_BLOCKS, lookahead=lookahead)
    tracker = SaveTracker([group])
    engine.add("req", prompt, cached)
    tracker.add("req", prompt)
    old_host: dict = {}
    old_early: list[str] = []
    lines = [
        f"prompt {prompt} tokens, budget {budget}, block size {block_size}"
        f" ({group.tokens_per_block} tokens per block id), lookahead {lookahead},"
        f" cached {cached}, dcp {dcp}"
    ]
    step = 0
    while engine.requests["req"].remaining > 0:
        step += 1
        scheduled = engine.schedule(budget)
        s = scheduled[0]
        new_ids = list(s.block_ids[0]) if s.block_ids else []
        engine.forward(scheduled)
        table = engine.requests["req"].tables[0]
        plan = tracker.plan(scheduled)
        engine.copy(plan)
        unwritten = [b for b in new_ids if (0, b) not in engine.written]
        engine.copy({"req": (new_ids,)}, host=old_host)
        if unwritten:
            old_early.append(f"step {step}: {_names(unwritten, table)}")
        end = s.num_computed_tokens + s.num_scheduled_tokens
        lines.append(
            f"step {step}: writes tokens {s.num_computed_tokens}-{end - 1}"
            f" | kvxfer copies {_names(plan['req'][0], table)}"
            f" | new-blocks rule copies {_names(new_ids, table)}"
        )
    ok = True
    for name, host in (("kvxfer", engine.host), ("new-blocks rule", old_host)):
        stale = engine.stale_tokens("req", host).get(0, [])
        if stale:
            table = engine.requests["req"].tables[0]
            blocks = sorted({table[p // group.tokens_per_block] for p in stale})
            lines.append(
                f"{name}: {len(stale)} prompt tokens stale on D: tokens {_spans(stale)}"
                f" (in {_names(blocks, table)})"
            )
        else:
            lines.append(f"{name}: all {prompt} prompt tokens current on D")
        if name == "kvxfer":
            ok = not stale and not engine.violations
            lines.extend(f"kvxfer: {v}" for v in engine.violations)
    if old_early:
        lines.append("new-blocks rule copied unwritten lookahead blocks: " + "; ".join(old_early))
    return lines, ok


def _cmd_plan(args: argparse.Namespace) -> int:
    lines, ok = plan_report(args.prompt, args.budget, args.block_size, args.lookahead,
                            args.cached, args.dcp)
    print("\n".join(lines))
    return 0 if ok else 1


def _int_list(flag: str, text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise InvalidInputError(f"{flag} {text!r} must be comma-separated ints, e.g. 40,300,517") from None


def _cmd_demo(args: argparse.Namespace) -> int:
    from kvxfer.demo.disagg import DemoConfig, report, run_demo

    cfg = DemoConfig(prompts=_int_list("--prompts", args.prompts), seed=args.seed, tp_p=args.tp_p,
                     tp_d=args.tp_d, dtype=args.dtype, budget=args.budget, lookahead=args.lookahead,
                     decode_tokens=args.decode_tokens)
    result = run_demo(cfg)
    print(json.dumps(result) if args.json else "\n".join(report(result, cfg)))
    return 0 if result["ok"] else 1


def _cmd_kvbytes(args: argparse.Namespace) -> int:
    from kvxfer.demo.kvbytes import BytesConfig, report_bytes, run_bytes

    fields = dict(layout=args.layout, dtype=args.dtype, tp_p=args.tp_p, tp_d=args.tp_d,
                  layers=args.layers, budget=args.budget, block_size=args.block_size)
    if args.num_blocks is not None:
        fields["num_blocks"] = args.num_blocks
    cfg = BytesConfig(**fields)
    result = run_bytes(cfg)
    print(json.dumps(result) if args.json else "\n".join(report_bytes(result, cfg)))
    return 0 if result["ok"] else 1


def _cmd_proxy(args: argparse.Namespace) -> int:
    try:
        proxy = importlib.import_module("kvxfer.serve.proxy")
    except ImportError as e:
        if (e.name or "").split(".")[0] != "aiohttp":
            raise
        raise SetupError("kvxfer proxy needs aiohttp: pip install 'kvxfer[proxy]'") from None
    proxy.serve(proxy.ProxyConfig(prefill=proxy.parse_urls("--prefill", args.prefill),
                                  decode=proxy.parse_urls("--decode", args.decode),
                                  host=args.host, port=args.port, stream=args.stream,
                                  max_body_mb=args.max_body_mb,
                                  prefill_timeout_s=args.prefill_timeout,
                                  decode_timeout_s=args.decode_timeout,
                                  prefill_max_bytes=args.prefill_max_bytes,
                                  route=args.route,
                                  local_prefill_tokens=args.local_prefill_tokens,
                                  route_imbalance=args.route_imbalance,
                                  decode_slots=args.decode_slots,
                                  whole_slots=args.whole_slots,
                                  prefill_queue=args.prefill_queue,
                                  health_interval_s=args.health_interval,
                                  peer_reads=args.peer_reads,
                                  tenant_header=None if args.tenant_header.lower() == "none"
                                  else args.tenant_header))
    return 0


_BENCHES = {
    "plan": "kvxfer.bench.plan",
    "gather": "kvxfer.bench.gather",
    "nixl": "kvxfer.bench.nixl",
    "e2e": "kvxfer.bench.e2e",
    "multihost": "kvxfer.bench.multihost",
    "serve": "kvxfer.bench.serve",
    "ttft": "kvxfer.bench.ttft",
    "step": "kvxfer.bench.step",
}


def _emulate_cpu_devices(count: int = 8) -> None:
    """Give JAX's CPU backend `count` devices, as the benchmarks' meshes need.

    Only has an effect before JAX is first imported, and only on the CPU
    platform: a TPU or GPU backend keeps its real devices.
    """
    flag = f"--xla_force_host_platform_device_count={count}"
    if "jax" not in sys.modules and "xla_force_host_platform_device_count" not in os.environ.get(
            "XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()


def _cmd_bench(args: argparse.Namespace) -> int:
    _emulate_cpu_devices()
    if (args.trace or args.no_stats or args.seal) and args.what != "e2e":
        raise InvalidInputError("--trace, --no-stats and --seal are options of `kvxfer bench e2e`")
    if args.trace < 0:
        raise InvalidInputError(f"--trace takes a number of requests, 0 or more, got {args.trace}")
    if args.trace and args.no_stats:
        raise InvalidInputError("--trace needs stats: give --trace or --no-stats, not both")
    tp = {k: v for k, v in (("tp_p", args.tp_p), ("tp_d", args.tp_d)) if v is not None}
    if tp and args.what not in ("e2e", "ttft"):
        raise InvalidInputError("--tp-p and --tp-d are options of `kvxfer bench e2e` and `ttft`")
    if any(v < 1 for v in tp.values()):
        raise InvalidInputError(f"--tp-p and --tp-d take a device count, 1 or more, got {tp}")
    if (args.load or args.hosts is not None) and args.what != "serve":
        raise InvalidInputError("--load and --hosts are options of `kvxfer bench serve`")
    if args.equal_hardware:
        return _bench_equal(args)
    if args.repeats != 1 or args.workloads is not None:
        raise InvalidInputError("--repeats and --workloads are options of `kvxfer bench serve "
                                "--equal-hardware`")
    if args.multi_turn or args.local_prefill or args.fleet or args.peer_reads:
        return _bench_multi_turn(args)
    load = args.load or args.hosts is not None
    module = importlib.import_module("kvxfer.bench.load" if load else _BENCHES[args.what])
    if load:
        result = module.run(hosts=1 if args.hosts is None else args.hosts)
    elif args.what == "e2e":
        result = module.run(module.E2EConfig(stats=not args.no_stats, trace=args.trace, seal=args.seal,
                                             **tp))
    elif args.what == "ttft":
        result = module.run(module.TTFTConfig(**tp))
    else:
        result = module.run(verbose=False) if args.what == "nixl" else module.run()
    if args.json:
        print(json.dumps(result))
        return 1 if result.get("ok") is False else 0
    traces = result.pop("traces", [])
    for key, value in result.items():
        print(f"{key}: {value}")
    if traces:
        from kvxfer.bench.traces import table, timeline

        print("\n".join(["", *table(traces)]))
        png = timeline(traces, os.path.abspath("kvxfer-trace.png"))
        print(f"timeline: {png}" if png else "timeline: not drawn (matplotlib is not installed)")
    return 1 if result.get("ok") is False else 0


def _bench_equal(args: argparse.Namespace) -> int:
    """`kvxfer bench serve --equal-hardware`: its table, then with --json the figures as one
    JSON object on the last line."""
    if args.what != "serve" or args.load or args.hosts is not None or args.multi_turn or (
            args.local_prefill or args.fleet or args.peer_reads):
        raise InvalidInputError("--equal-hardware is an option of `kvxfer bench serve` and runs "
                                "on its own")
    if args.repeats < 1:
        raise InvalidInputError(f"--repeats takes a number of runs, 1 or more, got {args.repeats}")
    module = importlib.import_module("kvxfer.bench.equal")
    workloads = tuple(w for w in args.workloads.split(",") if w) if args.workloads else tuple(
        module.WORKLOADS)
    result = module.run(repeats=args.repeats, workloads=workloads)
    print("\n".join(module.table(result)))
    print(json.dumps(result) if args.json else f"ratios: {result['ratios']}; figures: "
          f".pd/bench/equal.json")
    return 0 if all(f["failed"] == 0 for per in result["arms"].values() for levels in per.values()
                    for runs in levels.values() for f in runs) else 1


def _bench_multi_turn(args: argparse.Namespace) -> int:
    """`kvxfer bench serve --multi-turn`: a table per regime, then with --json the figures as
    one JSON object on the last line; `--local-prefill`: its figures, one per line or (--json)
    as one object; `--multi-turn --fleet`: the same, of the fleet's."""
    if args.fleet and not args.multi_turn:
        raise InvalidInputError("--fleet is an option of `kvxfer bench serve --multi-turn`")
    flag = ("--multi-turn" if args.multi_turn else "--local-prefill" if args.local_prefill
            else "--peer-reads")
    if args.what != "serve":
        raise InvalidInputError(f"{flag} is an option of `kvxfer bench serve`")
    if args.load or args.hosts is not None or sum(
            map(bool, (args.multi_turn, args.local_prefill, args.peer_reads))) > 1:
        raise InvalidInputError(f"{flag} runs on its own: give one of --load, --hosts, "
                                f"--multi-turn, --local-prefill, --peer-reads")
    if args.local_prefill or args.fleet or args.peer_reads:
        name = "localprefill" if args.local_prefill else "fleet" if args.fleet else "peers"
        result = importlib.import_module(f"kvxfer.bench.{name}").run()
        print(json.dumps(result) if args.json else "\n".join(
            f"{key}: {value}" for key, value in result.items()))
        return 0
    module = importlib.import_module("kvxfer.bench.multiturn")
    result = module.run()
    print("\n".join(module.table(result)))
    print(json.dumps(result) if args.json else f"figures: .pd/bench/multiturn.json, plot: "
          f"{result.get('plot') or 'not drawn (matplotlib is not installed)'}")
    return 1 if result.get("ok") is False else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvxfer", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="a small model across P and D (two processes, NIXL): D's "
                          "decode against colocated decode, and the old save rule's damage")
    demo.add_argument("--prompts", default="40,300,517,130",
                      help="comma-separated prompt lengths; the prompt bytes come from --seed")
    demo.add_argument("--seed", type=int, default=0, help="seed of the prompts and the weights")
    demo.add_argument("--tp-p", type=int, default=4, help="P's devices on the model axis")
    demo.add_argument("--tp-d", type=int, default=8, help="D's devices on the model axis")
    demo.add_argument("--dtype", default="bfloat16", help="KV cache dtype (bfloat16, float32, ...)")
    demo.add_argument("--budget", type=int, default=96, help="token budget per prefill step")
    demo.add_argument("--lookahead", type=int, default=3, help="speculative lookahead tokens")
    demo.add_argument("--decode-tokens", type=int, default=16, help="tokens D decodes per prompt")
    demo.add_argument("--json", action="store_true", help="print one JSON object")
    demo.set_defaults(func=_cmd_demo)

    demo = sub.add_parser("kvbytes", help="random KV bytes in any cache layout, P to D over NIXL, "
                          "compared byte for byte")
    demo.add_argument("--layout", default="attention", choices=["attention", "mla", "attention4d"])
    demo.add_argument("--dtype", default="bfloat16",
                      help="bfloat16, float8_e4m3fn, float8_e5m2, int8, ...")
    demo.add_argument("--tp-p", type=int, default=4, help="P's devices on the model axis")
    demo.add_argument("--tp-d", type=int, default=8, help="D's devices on the model axis")
    demo.add_argument("--layers", type=int, default=4)
    demo.add_argument("--block-size", type=int, default=16)
    demo.add_argument("--budget", type=int, default=96, help="token budget per prefill step")
    demo.add_argument("--num-blocks", type=int,
                      help="blocks in each side's KV cache and staging (default 256)")
    demo.add_argument("--json", action="store_true", help="print one JSON object")
    demo.set_defaults(func=_cmd_kvbytes)

    plan = sub.add_parser("plan", help="simulate one chunked prefill and show the save plan")
    plan.add_argument("--prompt", type=int, required=True, help="prompt length in tokens")
    plan.add_argument("--budget", type=int, required=True, help="token budget per step")
    plan.add_argument("--block-size", type=int, required=True, help="tokens per block")
    plan.add_argument("--lookahead", type=int, default=0, help="speculative lookahead tokens")
    plan.add_argument("--cached", type=int, default=0, help="prefix-cache hit, in tokens")
    plan.add_argument("--dcp", type=int, default=1, help="decode context parallel size")
    plan.set_defaults(func=_cmd_plan)

    _add_proxy(sub)

    _add_bench(sub)
    return parser


def _add_proxy(sub: Any) -> None:
    """`kvxfer proxy` and its flags."""
    proxy = sub.add_parser("proxy", help="an OpenAI-compatible router in front of P and D `vllm "
                           "serve` instances: prefill on P, decode on D with P's kv_transfer_params")
    proxy.add_argument("--prefill", required=True, help="P base URLs, comma-separated "
                       "(e.g. http://10.0.0.5:8100,http://10.0.0.6:8100); chosen by --route")
    proxy.add_argument("--decode", required=True, help="D base URLs, comma-separated; chosen by --route")
    proxy.add_argument("--port", type=int, required=True, help="port to listen on")
    proxy.add_argument("--host", default="127.0.0.1",
                       help="address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)")
    proxy.add_argument("--stream", action="store_true",
                       help="send each request to P and D at once: D reads the KV chunk by chunk "
                            "while P prefills (once P's first answer gave its kvxfer address)")
    proxy.add_argument("--max-body-mb", type=float, default=64.0,
                       help="the largest request body taken, in MiB (default 64); a larger one "
                            "is refused with 413 before P or D see it")
    proxy.add_argument("--prefill-timeout", type=float, default=600.0, metavar="S",
                       help="seconds P has for its whole answer, prefill included (default 600); "
                            "a P over it is a 504 and D is not asked")
    proxy.add_argument("--decode-timeout", type=float, default=3600.0, metavar="S",
                       help="seconds D has for its whole answer, from P's answer on (default 3600); "
                            "a D over it is a 504, or an ended stream once streaming began")
    proxy.add_argument("--prefill-max-bytes", type=int, default=4 << 20, metavar="N",
                       help="the most of P's answer read, in bytes (default 4194304, 4 MiB); a "
                            "longer one is a 502")
    proxy.add_argument("--route", choices=("prefix", "round_robin"), default="prefix",
                       help="prefix (default): P and D by the prompts each was sent, load and "
                            "X-Session-Id; round_robin: each in turn")
    proxy.add_argument("--local-prefill-tokens", type=int, default=512, metavar="N",
                       help="D prefills a prompt itself, P skipped, when the prompts D was sent "
                            "cover all of it but at most N tokens (default 512; 0: never)")
    proxy.add_argument("--route-imbalance", type=int, default=4, metavar="N",
                       help="a prefix or session may choose an instance with up to N more "
                            "requests in flight than the least loaded one (default 4)")
    proxy.add_argument("--decode-slots", type=int, default=0, metavar="N",
                       help="each D decodes N requests at once (its --max-num-seqs): a request "
                            "whose D has N in flight is served whole by a P with room "
                            "(--whole-slots) instead of waiting (default 0: never)")
    proxy.add_argument("--whole-slots", type=int, default=0, metavar="N",
                       help="a P serves a request whole only while it has fewer than N in "
                            "flight (its --max-num-seqs; default 0: never)")
    proxy.add_argument("--prefill-queue", type=int, default=0, metavar="N",
                       help="a request whose P has N requests in flight is prefilled by its D "
                            "itself while D has a slot (--decode-slots) (default 0: never)")
    proxy.add_argument("--health-interval", type=float, default=5.0, metavar="S",
                       help="seconds between health checks; an instance that fails one is not "
                            "routed to until it passes one (default 5)")
    proxy.add_argument("--peer-reads", action="store_true",
                       help="a session's next turn through P reads the conversation so far from "
                            "the D that answered the last one (P and D started as kv_both)")
    proxy.add_argument("--tenant-header", default="Authorization", metavar="NAME",
                       help="the header naming a request's tenant (default Authorization, the "
                            "client's API key): the proxy sets cache_salt from it, replacing "
                            "the client's, so prefix caches, pools and routes are one tenant's; "
                            "none passes the client's salt through (a gateway in front sets it)")
    proxy.set_defaults(func=_cmd_proxy)


def _add_bench(sub: Any) -> None:
    """`kvxfer bench WHAT`."""
    bench = sub.add_parser("bench", help="run a benchmark and print its figures")
    bench.add_argument("what", choices=sorted(_BENCHES))
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    bench.add_argument("--trace", type=int, default=0, metavar="N",
                       help="e2e: print the phases of the last N latency requests on P and D, "
                            "and draw them in kvxfer-trace.png (with matplotlib)")
    bench.add_argument("--no-stats", action="store_true",
                       help="e2e: collect no counters or traces (what collecting costs)")
    bench.add_argument("--seal", action="store_true",
                       help="e2e: P seals the KV it stages (seal_kv) and D opens it "
                            "(what encrypting the staged KV costs)")
    bench.add_argument("--load", action="store_true",
                       help="serve: under load, with vLLM's own client (vllm bench serve), "
                            "kvxfer against tpu-inference's connector and one colocated instance")
    bench.add_argument("--hosts", type=int, default=None, metavar="N",
                       help="serve: 2 runs P and D each over two hosts (Ray nodes in network "
                            "namespaces, tpu-inference's Ray executor), and P over two with D "
                            "on one, against each on one, under load as --load")
    bench.add_argument("--multi-turn", action="store_true",
                       help="serve: conversations with a shared system prompt, each turn resending "
                            "the history, with every conversation in the device caches and with "
                            "more than they hold; kvxfer (with P's host pool) against "
                            "tpu-inference's connector and one colocated instance")
    bench.add_argument("--equal-hardware", action="store_true",
                       help="serve: every engine pinned to a core of its own; kvxfer's P/D (with "
                            "and without serving whole on P while D is full) against two "
                            "colocated instances, on chat, multi-turn and long-prompt workloads")
    bench.add_argument("--repeats", type=int, default=1, metavar="N",
                       help="serve --equal-hardware: runs of every arm, in alternating order")
    bench.add_argument("--workloads", default=None, metavar="W,W",
                       help="serve --equal-hardware: some of multi_turn, chat, long_in (default all)")
    bench.add_argument("--fleet", action="store_true",
                       help="serve --multi-turn: over two P and two D behind kvxfer proxy (round "
                            "robin, prefix, prefix with local prefill) against two colocated "
                            "instances behind vllm-router's cache_aware")
    bench.add_argument("--peer-reads", action="store_true",
                       help="serve: a conversation's next turn through P reading the last answer "
                            "from D (kvxfer proxy --peer-reads) against computing it, by the "
                            "answer's length")
    bench.add_argument("--local-prefill", action="store_true",
                       help="serve: a conversation's next turn prefilled by D alone against "
                            "through P, by the new suffix's length: the measurement behind "
                            "kvxfer proxy --local-prefill-tokens")
    for side, default in (("p", 4), ("d", 8)):
        bench.add_argument(f"--tp-{side}", type=int, default=None, metavar="N",
                           help=f"e2e, ttft: {side.upper()}'s devices (default {default}: emulated "
                                f"CPU devices; on an accelerator, with JAX_PLATFORMS set, as many as "
                                f"it has)")
    bench.set_defaults(func=_cmd_bench)

def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if "KVXFER_HOST_THREADS" in os.environ:  # refused here, not in a child process
            from kvxfer.device.gather import host_threads

            host_threads()
        if "KVXFER_BACKEND" in os.environ:
            from kvxfer.device.gather import backend_setting

            backend_setting()
        return args.func(args)
    except KvxferError as e:
        print(f"kvxfer: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
