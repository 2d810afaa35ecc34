"""One process of a vLLM P or D instance across hosts, for `test_vllm_across_hosts.py`.

    python instance_process.py '<spec json>'

Every process of an instance runs this with the same spec but its `rank`:
`jax.distributed` over the instance's processes (CPU devices, gloo), one mesh over
all of them, an `engine.Engine` whose caches span it, and kvxfer's `TPUConnector`
on both roles, loaded through vLLM's factory. As under tpu-inference's multi-host
executor, one scheduler drives every worker: rank 0's real vLLM `Scheduler`
schedules, and its `SchedulerOutput` (with the connector's metadata) and the
scheduled requests' tokens go to the other ranks, which run the same worker half
of the step (`Engine.execute`); the other ranks' schedulers never schedule.
Files in `spec["dir"]` are the only channel: rank 0 writes `<role>-step-<n>.pkl`
(None: stop; a dict: a D request finished, with its table to check), P's rank 0
writes `params-<name>.json` for each prompt, and each D process writes
`d<rank>-<name>.json` with what it saw of each request (P's: `p<rank>.json`).
D loads the prompts one after the other, each once `go-<name>` exists if the
spec gates it (the test changes the network first).
"""

import json
import logging
import os
import pickle
import sys
import time
import traceback

spec = json.loads(sys.argv[1])
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kvxfer.bench.hosts import start_jax  # noqa: E402

start_jax(spec["devices"], spec["coordinator"], spec["processes"], spec["rank"], spec["ip"])

import jax  # noqa: E402
import numpy as np  # noqa: E402
from engine import Engine, layer_name  # noqa: E402

ROLE, RANK, DIR = spec["role"], spec["rank"], spec["dir"]
PROMPTS = spec["prompts"]  # name -> token ids; P's request id is the name, D's name + "-d"


def write(name, obj, binary=False):
    path = os.path.join(DIR, name)
    with open(path + ".tmp", "wb" if binary else "w") as f:
        pickle.dump(obj, f) if binary else json.dump(obj, f)
    os.replace(path + ".tmp", path)


def wait_for(name, deadline, binary=False):
    path = os.path.join(DIR, name)
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{ROLE}{RANK}: no {name}")
        time.sleep(0.002)
    with open(path, "rb" if binary else "r") as f:
        return pickle.load(f) if binary else json.load(f)


def report(name, **fields):
    write(f"{ROLE}{RANK}{name}.json", fields)


def make_engine():
    """P or D over the instance's whole mesh, loading kvxfer through vLLM's factory."""
    extra = {"etcd_endpoints": spec["etcd"], "ucx_tls": "tcp,self", "name": ROLE,
             "staging_blocks": 32, "transfer_timeout_s": spec.get("transfer_timeout_s", 20.0),
             "lease_s": spec["serve_s"] + 60.0}  # P holds every request the whole run
    role = "kv_producer" if ROLE == "p" else "kv_consumer"
    return Engine(spec["model_dir"], kv_role=role, extra_config=extra, devices=jax.devices(),
                  num_blocks=32, max_num_batched_tokens=spec["chunk"],
                  engine_id=f"{ROLE}-engine", instance_id=f"{ROLE}-instance")


class Seen:
    """What this process's worker reported since the last `take`: the requests received,
    failed, and the logical block ids of failed loads."""

    def __init__(self):
        self.received, self.failed, self.errors = set(), set(), set()

    def add(self, kv_out):
        if kv_out is not None:
            self.received |= set(kv_out.finished_recving or ())
            self.failed |= set(kv_out.failed_recving or ())
            self.errors |= set(kv_out.invalid_block_ids or ())

    def take(self):
        out = dict(received=sorted(self.received), failed=sorted(self.failed),
                   errors=sorted(self.errors))
        self.received, self.failed, self.errors = set(), set(), set()
        return out


def mark_loading(engine, req_id, marked):
    """D: once this process's READ of `req_id` is posted (to every leg), say where each leg
    stands: `[state, posted]`."""
    if marked or req_id is None:
        return True
    read = engine.worker._worker._decode.transport.reading(req_id)
    if read is None or read.waiting:
        return False
    write(f"{ROLE}{RANK}-{req_id}-loading.json",
          {p: [leg.state.value, leg.posting is not None or leg.handle is not None]
           for p, leg in read.legs.items()})
    return True


class Warnings(logging.Handler):
    """kvxfer's warnings and errors in this process, for the reports."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines = []
        logging.getLogger("kvxfer").addHandler(self)

    def emit(self, record):
        self.lines.append(record.getMessage())


def wrong_bytes(engine, prompt, table):
    """Bytes of the prompt's KV in this process's shards that are not P's stamps."""
    wrong = 0
    for layer in range(engine.num_layers):
        cache = engine.runner.kv_caches[engine.runner.layer_name_to_kvcache_index[layer_name(layer)]]
        for shard in cache.addressable_shards:
            data = np.asarray(shard.data)
            for pos, tok in enumerate(prompt):
                block, row = table[0][pos // engine.block_size], pos % engine.block_size
                want = engine.stamp(layer, pos, tok)[shard.index[2:]]
                wrong += int((data[block, row].view(np.uint16) != want.view(np.uint16)).sum())
    return wrong


def lead(engine, seen):
    """Rank 0: the instance's scheduler; every step goes to the other ranks first."""
    steps = iter(range(1 << 30))
    engine.on_schedule = lambda so, tokens: write(f"{ROLE}-step-{next(steps)}.pkl",
                                                  (so, tokens), binary=True)
    deadline = time.monotonic() + spec["serve_s"]
    if ROLE == "p":
        for name, prompt in PROMPTS.items():
            engine.add_request(name, prompt, max_tokens=1,
                               kv_transfer_params={"do_remote_decode": True})
        params = {}
        while time.monotonic() < deadline and not os.path.exists(os.path.join(DIR, "d-done")):
            result = engine.step()
            for name in set(result.finished) & set(PROMPTS):
                params[name] = result.finished[name]
                write(f"params-{name}.json", params[name])
            if result.scheduler_output is None:
                time.sleep(0.002)
        write(f"{ROLE}-step-{next(steps)}.pkl", None, binary=True)
        report("", params=params, held=engine.connector.has_pending_push_work())
        return
    for name in PROMPTS:
        if name in spec.get("gated", []):
            wait_for(f"go-{name}", deadline)
        req, params = f"{name}-d", wait_for(f"params-{name}.json", deadline)
        engine.add_request(req, PROMPTS[name], max_tokens=2, kv_transfer_params=params)
        first, marked = None, name not in spec.get("gated", [])
        while time.monotonic() < deadline:
            result = engine.step()
            seen.add(result.connector_output)
            marked = mark_loading(engine, req, marked)
            so = result.scheduler_output
            if so is not None and first is None and req in so.num_scheduled_tokens:
                first = next((n.num_computed_tokens for n in so.scheduled_new_reqs
                              if n.req_id == req), None)
            if req in result.finished:
                break
            if so is None:
                time.sleep(0.002)
        table = engine.table(req)
        write(f"{ROLE}-step-{next(steps)}.pkl", {"name": name, "table": table}, binary=True)
        report(f"-{name}", **seen.take(), first_computed=first, table=table, log=LOG.lines,
               wrong=wrong_bytes(engine, PROMPTS[name], table),
               shards=len(engine.runner.kv_caches[0].addressable_shards))
    write(f"{ROLE}-step-{next(steps)}.pkl", None, binary=True)
    write("d-done", {})


def follow(engine, seen):
    """Other ranks: run each step rank 0 scheduled, in order, until it says stop."""
    deadline = time.monotonic() + spec["serve_s"]
    marked = {name: name not in spec.get("gated", []) for name in PROMPTS}
    for n in range(1 << 30):
        step = wait_for(f"{ROLE}-step-{n}.pkl", deadline, binary=True)
        if step is None:
            report("", done=True)
            return
        if isinstance(step, dict):  # a D request is finished: check this process's shards
            name = step["name"]
            report(f"-{name}", **seen.take(), table=step["table"], log=LOG.lines,
                   wrong=wrong_bytes(engine, PROMPTS[name], step["table"]),
                   shards=len(engine.runner.kv_caches[0].addressable_shards))
            continue
        kv_out, _ = engine.execute(*step)
        seen.add(kv_out)
        for name in PROMPTS if ROLE == "d" else ():
            marked[name] = mark_loading(engine, f"{name}-d", marked[name])


LOG = Warnings()
code = 0
try:
    engine = make_engine()
    try:
        (lead if RANK == 0 else follow)(engine, Seen())
    finally:
        engine.close()
except BaseException:
    traceback.print_exc()
    code = 1
finally:
    sys.stdout.flush()
    os._exit(code)  # jax.distributed's shutdown waits for every process, dead ones too
