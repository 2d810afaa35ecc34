"""One host (process) of a multi-host vLLM P or D instance, for `test_vllm_across_hosts.py`.

    python host.py '<spec json>'

Every process of an instance runs this with the same spec but its `rank`:
`jax.distributed` over the instance's processes (CPU devices, gloo), one mesh over
all of them, an `engine.Engine` whose caches span it, and kvxfer's `TPUConnector`
on both roles, loaded through vLLM's factory. As under tpu-inference's multi-host
executor, one scheduler drives every worker: rank 0's real vLLM `Scheduler`
schedules, and its `SchedulerOutput` (with the connector's metadata) and the
scheduled requests' tokens go to the other ranks, which run the same worker half
of the step (`Engine.execute`); the other ranks' schedulers never schedule.
Files in `spec["dir"]` are the only channel: rank 0 writes `<role>-step-<n>.pkl`
(None: stop, or the D request's table to check), P's rank 0 writes
`params.json`, and each process writes `<role><rank>.json` with what it saw.
"""

import json
import os
import pickle
import sys
import time

spec = json.loads(sys.argv[1])
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kvxfer.bench.hosts import start_jax  # noqa: E402

start_jax(spec["devices"], spec["coordinator"], spec["processes"], spec["rank"], spec["ip"])

import jax  # noqa: E402
import numpy as np  # noqa: E402
from engine import Engine, layer_name  # noqa: E402

ROLE, RANK, DIR = spec["role"], spec["rank"], spec["dir"]
REQ = "r" if ROLE == "p" else "r-d"


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


def report(**fields):
    write(f"{ROLE}{RANK}.json", fields)


def make_engine():
    extra = {"etcd_endpoints": spec["etcd"], "ucx_tls": "tcp,self", "name": ROLE,
             "staging_blocks": 32, "transfer_timeout_s": spec.get("transfer_timeout_s", 20.0),
             "lease_s": 30.0}
    role = "kv_producer" if ROLE == "p" else "kv_consumer"
    return Engine(spec["model_dir"], kv_role=role, extra_config=extra, devices=jax.devices(),
                  num_blocks=32, max_num_batched_tokens=spec["chunk"],
                  engine_id=f"{ROLE}-engine", instance_id=f"{ROLE}-instance")


class Seen:
    """What this process's worker reported: the requests received, failed, and the logical
    block ids of failed loads."""

    def __init__(self):
        self.received, self.failed, self.errors = set(), set(), set()

    def add(self, kv_out):
        if kv_out is not None:
            self.received |= set(kv_out.finished_recving or ())
            self.failed |= set(kv_out.failed_recving or ())
            self.errors |= set(kv_out.invalid_block_ids or ())


def mark_loading(engine, marked):
    """D: once this process's READ of the request is posted, say where each leg stands."""
    if marked or not spec.get("mark_loading"):
        return marked
    reads = engine.worker._worker._decode.transport._reads  # instrumentation
    read = next((r for key, r in reads.items() if key.startswith(REQ)), None)
    if read is None:
        return False
    write(f"{ROLE}{RANK}-loading.json", {p: leg.state.value for p, leg in read.legs.items()})
    return True


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
    prompt = spec["prompt"]
    if ROLE == "p":
        engine.add_request(REQ, prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        params = None
        while time.monotonic() < deadline and not os.path.exists(os.path.join(DIR, "d-done")):
            result = engine.step()
            seen.add(result.connector_output)
            if REQ in result.finished:
                params = result.finished[REQ]
                write("params.json", params)
                report(staged=True)
            if result.scheduler_output is None:
                time.sleep(0.002)
        write(f"{ROLE}-step-{next(steps)}.pkl", None, binary=True)
        held = engine.connector.has_pending_push_work()
        report(staged=True, params=params, held=held)
        return
    params = wait_for("params.json", deadline)
    engine.add_request(REQ, prompt, max_tokens=2, kv_transfer_params=params)
    first, marked = None, False
    while time.monotonic() < deadline:
        result = engine.step()
        seen.add(result.connector_output)
        marked = mark_loading(engine, marked)
        so = result.scheduler_output
        if so is not None and first is None and REQ in so.num_scheduled_tokens:
            first = next((n.num_computed_tokens for n in so.scheduled_new_reqs
                          if n.req_id == REQ), None)
        if REQ in result.finished:
            break
        if so is None:
            time.sleep(0.002)
    table = engine.table(REQ)
    write(f"{ROLE}-step-{next(steps)}.pkl", {"check": table}, binary=True)
    write("d-done", {})
    report(received=sorted(seen.received), failed=sorted(seen.failed), errors=sorted(seen.errors),
           first_computed=first, wrong=wrong_bytes(engine, prompt, table),
           shards=len(engine.runner.kv_caches[0].addressable_shards))


def follow(engine, seen):
    """Other ranks: run each step rank 0 scheduled, in order, until it says stop."""
    deadline = time.monotonic() + spec["serve_s"]
    marked = False
    for n in range(1 << 30):
        step = wait_for(f"{ROLE}-step-{n}.pkl", deadline, binary=True)
        if step is None:
            report(done=True)
            return
        if isinstance(step, dict):  # D's request is finished: check this process's shards
            report(received=sorted(seen.received), failed=sorted(seen.failed),
                   errors=sorted(seen.errors), wrong=wrong_bytes(engine, spec["prompt"],
                                                                 step["check"]),
                   shards=len(engine.runner.kv_caches[0].addressable_shards))
            return
        kv_out, _ = engine.execute(*step)
        seen.add(kv_out)
        if ROLE == "d":
            marked = mark_loading(engine, marked)


engine = make_engine()
try:
    (lead if RANK == 0 else follow)(engine, Seen())
finally:
    engine.close()
    os._exit(0)  # jax.distributed's shutdown waits for every process, dead ones too
