"""`kvxfer bench multihost`: P and D across hosts, 2 P hosts -> 2 D hosts against 1 -> 1.

Each "host" is a network namespace on one bridge (`kvxfer.bench.hosts`), so
NIXL's traffic crosses veth interfaces as UCX over TCP, and agent metadata
goes through an etcd server on the bridge. Each instance is one JAX mesh of
`devices` CPU devices with the heads sharded over all of them (TP
`devices`): on one host in the 1 -> 1 run, split over two JAX processes
(`jax.distributed`, gloo) in the 2 -> 2 run, where each P process stages and
holds only its own heads and each D process reads only the heads its shards
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
import time
from dataclasses import asdict, dataclass
from typing import Any, TextIO

import numpy as np

from kvxfer.bench import memcpy_gbps
from kvxfer.bench.hosts import Processes, netns_available, start_jax
from kvxfer.demo.procs import Children, Side, connector, run_child
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


def _connector(cfg: MultihostConfig, role: str, etcd: str, caches: list[Any]) -> Any:
    """P's or D's connector, its agents named `p` or `d`, metadata through `etcd`."""
    return connector(role, caches, cfg.requests * cfg.request_blocks, cfg.block_size,
                     name=role.lower(), etcd_endpoints=etcd, ucx_tls=cfg.ucx_tls,
                     transfer_timeout_s=cfg.timeout_s / 4, lease_s=cfg.timeout_s,
                     heartbeat_interval_s=min(5.0, cfg.timeout_s / 4))


def _cpu_seconds() -> float:
    """CPU time of this process so far, every thread (UCX's too), user and kernel."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class _Host(Side):
    """One process of P or D on its host. It polls its connector only inside a round: across
    hosts every poll is an agreement among the instance's processes, which meet only there."""

    wait_s = 0.01

    def __init__(self, cfg: MultihostConfig, role: str, etcd: str, out: TextIO):
        self.cfg, self.tables = cfg, cfg.tables(role.lower())
        self.caches = _caches(cfg, fill=role == "P")
        super().__init__(out, _connector(cfg, role, etcd, self.caches))

    def close(self) -> None:
        import jax

        self.conn.close()
        jax.distributed.shutdown()


class _Prefill(_Host):
    """A P process: stages each round's requests and serves them until D released them."""

    def command(self, msg: dict[str, Any]) -> None:
        """Round `k`: stage its requests, publish their params (the first process), serve D
        until all are released; say the CPU seconds that took and P's free slots after."""
        import jax

        from kvxfer.plan.save_plan import ScheduledRequest

        k, p, tokens = msg["round"], self.conn, self.cfg.request_blocks * self.cfg.block_size
        ids = [f"r{k}-{i}" for i in range(self.cfg.requests)]
        steps = []
        for req_id, table in zip(ids, self.tables, strict=True):
            p.add_request(req_id, tokens)
            steps.append(ScheduledRequest(req_id, 0, tokens, (table,), full_table=True))
        p.wait_for_save(self.caches, p.build_connector_meta(steps))
        params = {req_id: p.request_finished(req_id) for req_id in ids}
        cpu_start, deadline = _cpu_seconds(), time.monotonic() + self.cfg.timeout_s
        if jax.process_index() == 0:
            self.say(params=params)
        released: set[str] = set()
        while released != set(ids):  # agreed over P's processes: all leave together
            if time.monotonic() > deadline:
                raise TransferError(f"round {k}: D released only {sorted(released)}")
            released.update(p.get_finished())
            time.sleep(_P_STEP_S)
        self.say(round=k, cpu_s=_cpu_seconds() - cpu_start, free_slots=p.slot_map.num_free_slots)


class _Decode(_Host):
    """A D process: loads each round's requests at once; checks its bytes at the end."""

    def command(self, msg: dict[str, Any]) -> None:
        """Round `k`: load its requests at once, after a barrier over D's processes, and say
        when that started and ended; or `check`: count the bytes that differ from P's."""
        from jax.experimental import multihost_utils

        from kvxfer.connector.scheduler import LoadRequest

        if "check" in msg:
            self.say(wrong=self._wrong())
            return
        k, params, deadline = msg["round"], msg["params"], time.monotonic() + self.cfg.timeout_s
        multihost_utils.sync_global_devices(f"kvxfer-bench-round-{k}")
        start, cpu_start = time.time(), _cpu_seconds()  # the hosts share this clock
        self.conn.start_load_kv({req_id: LoadRequest(params[req_id], table)
                                 for req_id, table in zip(params, self.tables, strict=True)})
        finished: list[str] = []
        failed: list[str] = []
        while len(finished) + len(failed) < self.cfg.requests:  # agreed over D's processes
            if time.monotonic() > deadline:
                raise TransferError(f"round {k}: only {sorted(finished)} arrived")
            self.caches, done, lost = self.conn.get_finished(self.caches)
            finished += done
            failed += lost
            time.sleep(_D_STEP_S)
        self.say(round=k, start=start, end=time.time(), failed=sorted(failed),
                 cpu_s=_cpu_seconds() - cpu_start)

    def _wrong(self) -> int:
        """Bytes of this process's shards that differ from what P holds for the same blocks."""
        cfg, p_tables, wrong = self.cfg, self.cfg.tables("p"), 0
        for layer, cache in enumerate(self.caches):
            for shard in cache.addressable_shards:
                heads = range(cfg.heads)[shard.index[2]]
                want = np.concatenate([_head_rows(cfg, layer, h) for h in heads], axis=2)
                got = np.asarray(shard.data).view(np.uint16)
                for p_table, d_table in zip(p_tables, self.tables, strict=True):
                    wrong += int((got[d_table] != want[p_table]).sum())
        return wrong


def _side(role: str, fields: dict[str, Any], out: TextIO) -> Side:
    start_jax(fields["devices"], fields["coordinator"], fields["processes"], fields["rank"],
              fields["ip"])
    cfg = MultihostConfig(**fields["cfg"])
    return (_Prefill if role == "P" else _Decode)(cfg, role, fields["etcd"], out)


# -- the parent ----------------------------------------------------------------------------


def _rounds(cfg: MultihostConfig, hosts: int) -> tuple[list[list[dict]], list[list[dict]],
                                                        list[dict]]:
    """Run P on `hosts` hosts and D on `hosts` more; per round, what each P process and each
    D process said of it, then each D process's byte check."""
    world = Processes(2 * hosts, prefix="kvxfer-bench-mh-")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {"NIXL_LOG_LEVEL": "ERROR",
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    try:
        with Children("kvxfer.bench.multihost", cfg.timeout_s + 60) as children:
            for role, first in (("P", 0), ("D", hosts)):
                for rank in range(hosts):
                    fields = dict(cfg=asdict(cfg), rank=rank, processes=hosts,
                                  devices=cfg.devices // hosts, etcd=world.etcd.endpoint,
                                  ip=world.net.host_ip(first + rank),
                                  coordinator=f"{world.net.host_ip(first)}:{_COORDINATOR_PORT}")
                    children.start(role, json.dumps(fields), cfg.devices // hosts,
                                   prefix=world.net.command(first + rank, []), env=env,
                                   name=f"bench multihost: {role.lower()} process {rank} of {hosts}")
            ps, ds = children.procs[:hosts], children.procs[hosts:]
            for proc in children.procs:
                proc.read()
            p_rounds, d_rounds = [], []
            for k in range(cfg.rounds + 1):
                for p in ps:
                    p.send(round=k)
                params = ps[0].read()["params"]
                for d in ds:
                    d.send(round=k, params=params)
                d_rounds.append([d.read() for d in ds])
                p_rounds.append([p.read() for p in ps])
            for d in ds:
                d.send(check=True)
            checks = [d.read() for d in ds]
    finally:
        world.close()
    return p_rounds, d_rounds, checks


def _measure(cfg: MultihostConfig, hosts: int) -> dict[str, Any]:
    """Each round's aggregate GB/s over `hosts` P hosts and `hosts` D hosts, and the CPU
    seconds per GB; round 0 warms up."""
    p_rounds, d_rounds, checks = _rounds(cfg, hosts)
    cpu = sum(r["cpu_s"] for rounds in p_rounds[1:] + d_rounds[1:] for r in rounds)
    gbps = [cfg.round_bytes / (max(r["end"] for r in rounds) - min(r["start"] for r in rounds))
            / 1e9 for rounds in d_rounds[1:]]
    failed = {f for rounds in d_rounds for r in rounds for f in r["failed"]}
    return {"gbps": statistics.median(gbps), "rounds_gbps": [round(g, 3) for g in gbps],
            "cpu_s_per_gb": cpu / (cfg.rounds * cfg.round_bytes / 1e9),
            "failed": sorted(failed), "wrong": sum(c["wrong"] for c in checks),
            "p_slots_free": all(r["free_slots"] == cfg.requests * cfg.request_blocks
                                for r in p_rounds[-1])}


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
    run_child(_side)
