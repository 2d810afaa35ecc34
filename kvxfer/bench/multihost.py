"""`kvxfer bench multihost`: P and D across hosts, 2 P hosts -> 2 D hosts against 1 -> 1.

Each "host" is a network namespace on one bridge (`kvxfer.bench.hosts`), so
NIXL's traffic crosses veth interfaces as UCX over TCP, and agent metadata
goes through an etcd server on the bridge. Each instance is one JAX mesh of
`devices` CPU devices with the heads sharded over all of them (TP
`devices`): on one host in the 1 -> 1 run, split over two JAX processes
(`jax.distributed`, gloo) in the 2 -> 2 run, where each P process stages and
serves only its own heads and each D process reads only the heads its shards
hold, from the P process that has them.

Both runs move the same requests through the connectors' public API: P
prefills `requests` requests of `request_blocks` blocks (8 layers of
`[16, 8, 2, 128]` bf16 blocks, 64 KiB per block per layer) in one step and
stages them; once every P process has staged them, every D process starts
loading all of them at once (after a barrier over D's processes) and polls
`get_finished` until they are in its caches (read, fingerprints checked,
scattered). A round's throughput is the request bytes over the time from the
first D process's start to the last one's finish. One warm-up round
(connections, compiles) is not timed; figures are medians over `rounds`.
After the last round every D process compares the blocks it holds, byte for
byte, with P's.

`scaling` is the 2 -> 2 throughput over the 1 -> 1 throughput, measured in the
same run on the same virtual network. `one_link_gbps` (the 1 -> 1 figure) is
what one P host moves to one D host over TCP here. The hosts share this
machine's cores (`cpus`): TCP over veth costs CPU on both ends, so with fewer
cores than processes the 2 -> 2 run competes for the same cores, and
`scaling` then shows that bound, not the network's. So each run also counts
the CPU seconds all its processes spend per GB moved (every thread, user and
kernel, over the timed rounds: D from its start to its last delivery, P from
publishing params to the release), and `scaling_own_cores` = 2 x CPU per GB
at 1 -> 1 over CPU per GB at 2 -> 2: what 2 -> 2 would reach with each host on
its own cores, CPU being the bound. `memcpy_gbps` (numpy, the same bytes, this
process) puts the figures in scale.

Needs root and `ip` (network namespaces) and `etcd`; without them it raises
`SetupError` naming what is missing.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvxfer.bench import memcpy_gbps
from kvxfer.bench.hosts import EtcdServer, HostNetwork, netns_available, start_jax
from kvxfer.errors import InvalidInputError, SetupError, TransferError

__all__ = ["MultihostConfig", "run"]

_COORDINATOR_PORT = 12400  # in each instance's first host's own namespace
# How often each side calls `get_finished`, as an engine does once per step. Across hosts
# every call is an agreement among the instance's processes (about 0.6 ms of CPU here).
_P_STEP_S = 0.005  # P's polls only answer D's done messages and free slots: not timed
_D_STEP_S = 0.001  # D's are: a finished read waits at most this long to be scattered


@dataclass
class MultihostConfig:
    layers: int = 8
    num_blocks: int = 1024
    block_size: int = 16
    heads: int = 8
    head_dim: int = 128
    devices: int = 4
    requests: int = 8
    request_blocks: int = 64
    rounds: int = 3
    ucx_tls: str = "tcp,self"
    seed: int = 0
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        for name in ("layers", "num_blocks", "block_size", "heads", "head_dim", "devices",
                     "requests", "request_blocks", "rounds"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidInputError(f"MultihostConfig {name} must be a positive int, "
                                        f"got {value!r}")
        if self.heads % self.devices or self.devices % 2:
            raise InvalidInputError(
                f"MultihostConfig devices must be even (split over 2 hosts) and divide heads "
                f"{self.heads}, got {self.devices}")
        if self.requests * self.request_blocks > self.num_blocks - 1:
            raise InvalidInputError(
                f"MultihostConfig requests x request_blocks = "
                f"{self.requests * self.request_blocks} must fit in num_blocks - 1 = "
                f"{self.num_blocks - 1}")

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.block_size, self.heads, 2, self.head_dim)

    @property
    def round_bytes(self) -> int:
        """Bytes of one round's requests, all layers (bf16)."""
        return (self.requests * self.request_blocks * self.layers
                * int(np.prod(self.block_shape)) * 2)

    def tables(self, role: str) -> list[list[int]]:
        """Each request's block table on P or D: distinct ids, spread over the cache."""
        rng = np.random.default_rng([self.seed, role == "d"])
        ids = rng.permutation(np.arange(1, self.num_blocks))  # block 0 stays the null block
        n = self.request_blocks
        return [ids[i * n:(i + 1) * n].tolist() for i in range(self.requests)]


# -- one host (a child process, inside its namespace) ------------------------------------


def _head_rows(cfg: MultihostConfig, layer: int, head: int) -> np.ndarray:
    """P's bytes for one head of one layer, `[num_blocks, block, 1, 2, head_dim]` uint16."""
    rng = np.random.default_rng([cfg.seed, layer, head])
    return rng.integers(0, 1 << 16, (cfg.num_blocks, cfg.block_size, 1, 2, cfg.head_dim),
                        np.uint16)


def _caches(cfg: MultihostConfig, fill: bool) -> list[Any]:
    """The instance's caches, heads sharded over all its devices; P's bytes or zeros.

    Each process makes only its own shards (head by head), so no process
    holds a whole cache.
    """
    import jax
    import ml_dtypes
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    mesh = Mesh(np.array(jax.devices()).reshape(1, -1), ("data", "model"))
    sharding = NamedSharding(mesh, PartitionSpec(None, None, "model"))
    shape = (cfg.num_blocks, *cfg.block_shape)

    def shard(layer: int, index: tuple[slice, ...]) -> np.ndarray:
        heads = range(cfg.heads)[index[2]]
        if not fill:
            return np.zeros((cfg.num_blocks, cfg.block_size, len(heads), 2, cfg.head_dim),
                            ml_dtypes.bfloat16)
        rows = np.concatenate([_head_rows(cfg, layer, h) for h in heads], axis=2)
        return rows.view(ml_dtypes.bfloat16)

    return [jax.make_array_from_callback(shape, sharding, lambda index, layer=layer:
                                         shard(layer, index))
            for layer in range(cfg.layers)]


def _config(cfg: MultihostConfig, role: str, etcd: str) -> Any:
    from kvxfer.connector.config import ConnectorConfig
    from kvxfer.nixl.agent import TransportConfig

    transport = TransportConfig(name=role, etcd_endpoints=etcd, ucx_tls=cfg.ucx_tls,
                                transfer_timeout_s=cfg.timeout_s / 4, lease_s=cfg.timeout_s,
                                heartbeat_interval_s=min(5.0, cfg.timeout_s / 4))
    return ConnectorConfig(transport, staging_blocks=cfg.requests * cfg.request_blocks)


def _write_json(path: str, value: Any) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(value, f)
    os.replace(path + ".tmp", path)


def _wait_json(path: str, deadline: float) -> Any:
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TransferError(f"timed out waiting for {path}")
        time.sleep(0.002)
    with open(path) as f:
        return json.load(f)


def _cpu_seconds() -> float:
    """CPU time of this process so far, every thread (UCX's too), user and kernel."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _serve_p(cfg: MultihostConfig, spec: dict[str, Any]) -> dict[str, Any]:
    """Stage each round's requests, publish their params, serve D until all are released."""
    import jax

    from kvxfer.connector.prefill import PrefillConnector
    from kvxfer.plan.save_plan import GroupSpec, ScheduledRequest

    caches = _caches(cfg, fill=True)
    p = PrefillConnector(_config(cfg, "p", spec["etcd"]), [GroupSpec(cfg.block_size)], caches)
    tables, tokens = cfg.tables("p"), cfg.request_blocks * cfg.block_size
    deadline, cpu = time.monotonic() + cfg.timeout_s, 0.0
    try:
        for k in range(cfg.rounds + 1):
            ids = [f"r{k}-{i}" for i in range(cfg.requests)]
            steps = []
            for req_id, table in zip(ids, tables, strict=True):
                p.add_request(req_id, tokens)
                steps.append(ScheduledRequest(req_id, 0, tokens, (table,), full_table=True))
            p.wait_for_save(caches, p.build_connector_meta(steps))
            params = {req_id: p.request_finished(req_id) for req_id in ids}
            cpu_start = _cpu_seconds()
            if jax.process_index() == 0:
                _write_json(os.path.join(spec["dir"], f"params{k}.json"), params)
            released: set[str] = set()
            while released != set(ids):  # agreed over P's processes: all leave together
                if time.monotonic() > deadline:
                    raise TransferError(f"round {k}: D released only {sorted(released)}")
                released.update(p.get_finished())
                time.sleep(_P_STEP_S)
            if k:  # round 0 warms up
                cpu += _cpu_seconds() - cpu_start
        return {"free_slots": p.slot_map.num_free_slots, "cpu_s": cpu}
    finally:
        p.close()


def _serve_d(cfg: MultihostConfig, spec: dict[str, Any]) -> dict[str, Any]:
    """Load each round's requests at once, after a barrier; time it; check bytes at the end."""
    import jax
    from jax.experimental import multihost_utils

    from kvxfer.connector.decode import DecodeConnector
    from kvxfer.connector.scheduler import LoadRequest

    caches = _caches(cfg, fill=False)
    d = DecodeConnector(_config(cfg, "d", spec["etcd"]), caches)
    tables = cfg.tables("d")
    deadline = time.monotonic() + cfg.timeout_s
    rounds = []
    try:
        for k in range(cfg.rounds + 1):
            params = _wait_json(os.path.join(spec["dir"], f"params{k}.json"), deadline)
            multihost_utils.sync_global_devices(f"kvxfer-bench-round-{k}")
            start, cpu_start = time.time(), _cpu_seconds()  # the hosts share this clock
            d.start_load_kv({req_id: LoadRequest(params[req_id], table)
                             for req_id, table in zip(params, tables, strict=True)})
            finished: list[str] = []
            failed: list[str] = []
            while len(finished) + len(failed) < cfg.requests:  # agreed over D's processes
                if time.monotonic() > deadline:
                    raise TransferError(f"round {k}: only {sorted(finished)} arrived")
                caches, done, lost = d.get_finished(caches)
                finished += done
                failed += lost
                time.sleep(_D_STEP_S)
            rounds.append({"start": start, "end": time.time(), "failed": sorted(failed),
                           "cpu_s": _cpu_seconds() - cpu_start})
    finally:
        d.close()
    p_tables, wrong = cfg.tables("p"), 0
    for layer, cache in enumerate(caches):
        for shard in cache.addressable_shards:
            heads = range(cfg.heads)[shard.index[2]]
            want = np.concatenate([_head_rows(cfg, layer, h) for h in heads], axis=2)
            got = np.asarray(shard.data).view(np.uint16)
            for p_table, d_table in zip(p_tables, tables, strict=True):
                wrong += int((got[d_table] != want[p_table]).sum())
    return {"rounds": rounds, "wrong": wrong, "process": jax.process_index()}


def _host(spec: dict[str, Any]) -> None:
    start_jax(spec["devices"], spec["coordinator"], spec["processes"], spec["rank"], spec["ip"])
    import jax

    cfg = MultihostConfig(**spec["cfg"])
    out_path = os.path.join(spec["dir"], f"{spec['role']}{spec['rank']}.json")
    out = _serve_p(cfg, spec) if spec["role"] == "p" else _serve_d(cfg, spec)
    _write_json(out_path, out)
    jax.distributed.shutdown()


# -- the parent ----------------------------------------------------------------------------


def _measure(cfg: MultihostConfig, hosts: int) -> dict[str, Any]:
    """Run P on `hosts` hosts and D on `hosts` more; each round's aggregate GB/s."""
    net = HostNetwork(2 * hosts)
    procs: dict[tuple[str, int], subprocess.Popen[bytes]] = {}
    workdir = tempfile.mkdtemp(prefix="kvxfer-bench-mh-")
    try:
        etcd = EtcdServer(host=net.bridge_ip)
        try:
            root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            env = dict(os.environ, NIXL_LOG_LEVEL="ERROR",
                       PYTHONPATH=os.pathsep.join(filter(None, [root,
                                                                os.environ.get("PYTHONPATH")])))
            env.pop("XLA_FLAGS", None)
            for role, first in (("p", 0), ("d", hosts)):
                for rank in range(hosts):
                    spec = dict(cfg=asdict(cfg), role=role, rank=rank, processes=hosts,
                                devices=cfg.devices // hosts, dir=workdir, etcd=etcd.endpoint,
                                ip=net.host_ip(first + rank),
                                coordinator=f"{net.host_ip(first)}:{_COORDINATOR_PORT}")
                    log = open(os.path.join(workdir, f"{role}{rank}.log"), "wb")
                    procs[(role, rank)] = net.popen(
                        first + rank, [sys.executable, "-m", "kvxfer.bench.multihost",
                                       json.dumps(spec)],
                        stdout=log, stderr=subprocess.STDOUT, env=env)
                    log.close()
            deadline = time.monotonic() + cfg.timeout_s + 60
            for (role, rank), proc in procs.items():
                try:
                    code = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    code = None
                if code != 0:
                    with open(os.path.join(workdir, f"{role}{rank}.log")) as f:
                        tail = f.read()[-3000:]
                    raise TransferError(f"bench multihost: {role} process {rank} of {hosts} "
                                        f"{'timed out' if code is None else f'exited {code}'}:"
                                        f"\n{tail}")
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
                proc.wait(timeout=10)
            etcd.stop()
    finally:
        net.close()
    reports = {}
    for role, rank in procs:
        with open(os.path.join(workdir, f"{role}{rank}.json")) as f:
            reports[(role, rank)] = json.load(f)
    d = [reports[("d", r)] for r in range(hosts)]
    gbps, failed = [], []
    cpu = sum(reports[("p", r)]["cpu_s"] for r in range(hosts)) + sum(
        out["rounds"][k]["cpu_s"] for out in d for k in range(1, cfg.rounds + 1))
    for k in range(cfg.rounds + 1):
        start = min(out["rounds"][k]["start"] for out in d)
        end = max(out["rounds"][k]["end"] for out in d)
        failed += [f for out in d for f in out["rounds"][k]["failed"]]
        if k:  # round 0 warms up
            gbps.append(cfg.round_bytes / (end - start) / 1e9)
    return {"gbps": statistics.median(gbps), "rounds_gbps": [round(g, 3) for g in gbps],
            "cpu_s_per_gb": cpu / (cfg.rounds * cfg.round_bytes / 1e9),
            "failed": sorted(set(failed)), "wrong": sum(out["wrong"] for out in d),
            "p_slots_free": all(reports[("p", r)]["free_slots"] == cfg.requests
                                * cfg.request_blocks for r in range(hosts))}


def run(cfg: MultihostConfig | None = None) -> dict[str, Any]:
    """Measure 1 -> 1 and 2 -> 2 hosts; returns the figures as a JSON-able dict.

    Keys: `one_link_gbps` (1 P host -> 1 D host), `two_by_two_gbps` (2 -> 2,
    aggregate), `scaling` (their ratio), `cpu_s_per_gb_one_link`,
    `cpu_s_per_gb_two_by_two`, `scaling_own_cores`, `memcpy_gbps`, `one_link_over_memcpy`,
    `round_bytes`, `rounds`, `cpus`, `ucx_tls`, `ok` (every request of every
    round delivered and byte-exact on every D shard, every P slot freed).
    """
    cfg = cfg or MultihostConfig()
    reason = netns_available()
    if reason is not None:
        raise SetupError(f"kvxfer bench multihost makes network namespaces as hosts: {reason}")
    one, two = _measure(cfg, 1), _measure(cfg, 2)
    memcpy = memcpy_gbps(cfg.round_bytes)
    ok = all(not m["failed"] and m["wrong"] == 0 and m["p_slots_free"] for m in (one, two))
    return {
        "one_link_gbps": round(one["gbps"], 3),
        "two_by_two_gbps": round(two["gbps"], 3),
        "scaling": round(two["gbps"] / one["gbps"], 3),
        "cpu_s_per_gb_one_link": round(one["cpu_s_per_gb"], 3),
        "cpu_s_per_gb_two_by_two": round(two["cpu_s_per_gb"], 3),
        "scaling_own_cores": round(2 * one["cpu_s_per_gb"] / two["cpu_s_per_gb"], 3),
        "memcpy_gbps": round(memcpy, 3),
        "one_link_over_memcpy": round(one["gbps"] / memcpy, 4),
        "one_link_rounds_gbps": one["rounds_gbps"],
        "two_by_two_rounds_gbps": two["rounds_gbps"],
        "round_bytes": cfg.round_bytes,
        "rounds": cfg.rounds,
        "cpus": os.cpu_count(),
        "ucx_tls": cfg.ucx_tls,
        "ok": ok,
    }


if __name__ == "__main__":
    _host(json.loads(sys.argv[1]))
