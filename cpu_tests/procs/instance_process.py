"""One process of a P or D instance across hosts, for `test_connector_across_hosts.py`.

    python instance_process.py '<spec json>'

Every process of an instance runs this with the same spec but its `rank`:
`jax.distributed` over the instance's processes (CPU devices, gloo
collectives), one mesh over all of them, caches sharded over it, and a
kvxfer connector whose agent finds its peers through etcd. The processes of
one instance do the same thing in the same order (SPMD), as an engine's
hosts do. Files in `spec["dir"]` are the only channel to the test and to
the other instance: P's rank 0 writes `params.json`; each process writes
`<role><rank>.json` with what it saw.

P prefills request "r" in two chunks (a prefix-cache hit covers its first
block; the second chunk completes a block the first one started), then
serves D until every process has released it. D loads it (its own prefix
hit covers its first table entry), then checks every block of the request
on every shard it holds, byte for byte, against the reference.
"""

import json
import os
import sys
import time

spec = json.loads(sys.argv[1])
from kvxfer.bench.hosts import start_jax  # noqa: E402

start_jax(spec["devices"], spec["coordinator"], spec["processes"], spec["rank"], spec["ip"])

import jax  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

from kvxfer.connector.config import ConnectorConfig  # noqa: E402
from kvxfer.connector.decode import DecodeConnector  # noqa: E402
from kvxfer.connector.prefill import PrefillConnector  # noqa: E402
from kvxfer.connector.scheduler import LoadRequest  # noqa: E402
from kvxfer.nixl.agent import TransportConfig  # noqa: E402
from kvxfer.plan.save_plan import GroupSpec, ScheduledRequest  # noqa: E402

BLOCK = 16
LAYERS = 2
SHAPES = {"heads": (32, BLOCK, 8, 2, 32), "mla": (32, BLOCK, 1, 64)}
P_TABLE, D_TABLE = [5, 9, 12, 3], [7, 2, 30, 11]
PROMPT, CHUNKS = 56, [(16, 20), (36, 20)]  # (computed, scheduled): P's prefix hit is block 0
ROLE, RANK, DIR = spec["role"], spec["rank"], spec["dir"]


def bits(seed):
    """One random bf16 cache (as uint16 bits) per layer: the same in every process."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1 << 16, SHAPES[spec["layout"]], dtype=np.uint16)
            for _ in range(LAYERS)]


FINAL, STALE = bits(1), bits(2)


def p_state(upto):
    """P's caches once tokens [0, upto) of the request are written: the rest is stale."""
    out = [s.copy() for s in STALE]
    for layer in range(LAYERS):
        for i, block in enumerate(P_TABLE):
            n = max(0, min(BLOCK, upto - i * BLOCK))
            out[layer][block, :n] = FINAL[layer][block, :n]
    return out


def d_expected():
    """D's caches once the request is loaded: its prefix hit (entry 0) and P's blocks."""
    out = [s.copy() ^ 0x5555 for s in STALE]
    final = p_state(PROMPT)
    for layer in range(LAYERS):
        for d_block, p_block in zip(D_TABLE, P_TABLE):
            out[layer][d_block] = final[layer][p_block]
    return out


def d_initial():
    out = [s.copy() ^ 0x5555 for s in STALE]
    for layer in range(LAYERS):
        out[layer][D_TABLE[0]] = FINAL[layer][P_TABLE[0]]  # D's own prefix-cache hit
    return out


def to_caches(arrays):
    mesh = Mesh(np.array(jax.devices()).reshape(1, -1), ("data", "model"))
    spec_ = PartitionSpec(None, None, "model") if spec["layout"] == "heads" else PartitionSpec()
    sharding = NamedSharding(mesh, spec_)
    return [jax.make_array_from_callback(a.shape, sharding,
                                         lambda index, a=a: a[index].view(ml_dtypes.bfloat16))
            for a in arrays]


def report(**fields):
    """Writes what this process saw, with the backend its pieces moved by."""
    from kvxfer.device.gather import backend_for

    fields["backend"] = backend_for(d.platform for d in jax.local_devices())
    path = os.path.join(DIR, f"{ROLE}{RANK}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(fields, f)
    os.replace(path + ".tmp", path)


def config():
    transport = TransportConfig(name=ROLE, etcd_endpoints=spec["etcd"], ucx_tls="tcp,self",
                                transfer_timeout_s=spec.get("transfer_timeout_s", 10.0),
                                lease_s=spec.get("lease_s", 30.0),
                                heartbeat_interval_s=min(5.0, spec.get("lease_s", 30.0) / 4))
    return ConnectorConfig(transport, staging_blocks=16, seal_kv=spec.get("seal", False))


def prefill():
    p = PrefillConnector(config(), [GroupSpec(BLOCK)], to_caches(p_state(0)))
    p.add_request("r", PROMPT)
    for n, ((computed, scheduled), table) in enumerate(zip(CHUNKS, [P_TABLE[:3], P_TABLE[3:]])):
        step = ScheduledRequest("r", computed, scheduled, (table,), full_table=n == 0)
        meta = p.build_connector_meta([step])
        p.wait_for_save(to_caches(p_state(computed + scheduled)), meta)
    params = p.request_finished("r")
    if RANK == 0:
        path = os.path.join(DIR, spec.get("params_name", "params.json"))
        with open(path + ".tmp", "w") as f:
            json.dump(params, f)
        os.replace(path + ".tmp", path)
    report(staged=True)
    released, deadline = [], time.monotonic() + spec["serve_s"]
    while "r" not in released and time.monotonic() < deadline:
        released += p.get_finished()
        time.sleep(0.005)
    report(released=released, free_slots=p.slot_map.num_free_slots,
           staged_here="r" in p.staging, held=p.transport.held(),
           pinned=type(p.staging.regions).__name__ == "PinnedRegions")
    p.close()


def wait_params(name, deadline):
    path = os.path.join(DIR, name)
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            return None
        time.sleep(0.01)
    with open(path) as f:
        return json.load(f)


def decode():
    d = DecodeConnector(config(), to_caches(d_initial()))
    caches = to_caches(d_initial())
    deadline = time.monotonic() + spec["serve_s"]
    outcomes = []
    for name in spec.get("loads", ["params.json"]):  # one request "r" after another
        params = wait_params(name, deadline)
        if params is None:
            report(error=f"no {name}")
            return
        started = time.monotonic()
        d.start_load_kv({"r": LoadRequest(params, D_TABLE, [1])})
        if spec.get("mark_loading"):  # the test kills a P process once every READ is in flight
            d.get_finished(caches)
            read = d.transport._reads.get("r")  # instrumentation: where each leg stands
            report(loading=True, legs={peer: leg.state.value for peer, leg in read.legs.items()}
                   if read else {})
        if spec.get("die_after_read") == RANK:  # its READs land; it never says done
            time.sleep(1.0)
            os._exit(3)
        finished, failed = [], []
        while not finished and not failed and time.monotonic() < deadline:
            caches, f, x = d.get_finished(caches)
            finished, failed = finished + f, failed + x
            time.sleep(0.002)
        outcomes.append(dict(finished=finished, failed=failed, took_s=time.monotonic() - started,
                             errors=sorted(d.get_block_ids_with_load_errors())))
    expected = d_expected()
    wrong = 0
    for layer, cache in enumerate(caches):
        for shard in cache.addressable_shards:
            got = np.asarray(shard.data).view(np.uint16)[D_TABLE]
            wrong += int((got != expected[layer][(D_TABLE, *shard.index[1:])]).sum())
    report(**outcomes[-1], outcomes=outcomes, wrong=wrong,
           shards=len(caches[0].addressable_shards),
           staged_here=any("r" in s for s in d.stagings))
    d.close()


prefill() if ROLE == "p" else decode()
jax.distributed.shutdown()
