"""Hosts on one machine for multi-host runs: network namespaces on a bridge, and etcd.

`HostNetwork(n)` makes `n` separate "hosts", each a Linux network namespace
with one veth into a bridge in the root namespace, on a random /24 under
10.0.0.0/8: the bridge (the root namespace) is .1, host i is .(10+i). Every
network has its own subnet and names, so concurrent runs do not collide.
Traffic between hosts crosses network interfaces (veth, bridge), not shared
memory: UCX over TCP, as between real hosts. Needs root and `ip` (Debian's
`iproute2`, installed by `scripts/test-deps`). Everything made is named
`kvx<suffix>...`: a run killed before `close()` leaves those behind (`ip
netns list`, `ip link`).

`EtcdServer` is a throwaway etcd (Debian's `etcd-server`) with its own data
directory and free ports, on loopback or on the bridge, where every host
reaches it: NIXL's metadata service for the agents of many processes.

`start_jax` starts one process of a multi-process JAX instance inside a host.

`Processes(n)` puts the two together for runs across hosts: `n` hosts, etcd on
their bridge, a directory the processes it starts log and report into (JSON
files, `wait_report`: the multi-host tests' processes), and one `close()` for
all of it. `kvxfer bench multihost` starts its processes in these hosts as
`kvxfer.demo.procs.Children` that answer in JSON lines instead.

Used by `kvxfer bench multihost` and by the multi-host tests. A missing tool
is an error (`SetupError`), not a skip.
"""

from __future__ import annotations

import json
import logging
import os
import random
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request

from kvxfer.errors import InvalidInputError, SetupError
from kvxfer.nixl.agent import free_port

__all__ = ["EtcdServer", "HostNetwork", "MAX_HOSTS", "Processes", "netns_available", "start_jax"]

log = logging.getLogger(__name__)

MAX_HOSTS = 244  # host i is .(10+i), at most .254


def _ip_binary():
    """`ip`'s path: on PATH, else where Debian puts it (/usr/sbin may be off a user's PATH)."""
    for candidate in (shutil.which("ip"), "/usr/sbin/ip", "/sbin/ip"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def _run_ip(*args):
    """Runs `ip args`; raises `SetupError` with its stderr if it fails."""
    binary = _ip_binary()
    if binary is None:
        raise SetupError("`ip` is not installed: run `bash scripts/test-deps` (Debian's iproute2)")
    done = subprocess.run([binary, *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise SetupError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done.stdout


def _new_suffix():
    """5 hex characters that make this instance's names its own."""
    return secrets.token_hex(3)[:5]


def _free_subnet():
    """`10.a.b.` for a random /24 that no interface here has an address in."""
    used = _run_ip("-4", "-o", "addr", "show")
    rng = random.SystemRandom()
    for _ in range(100):
        prefix = f"10.{rng.randint(64, 250)}.{rng.randint(0, 255)}."
        if f" {prefix}" not in used:
            return prefix
    raise SetupError("no free 10.x.y.0/24 subnet found")


def netns_available():
    """None if `TestNetwork` can work here, else a short reason why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if _ip_binary() is None:
        return "`ip` (iproute2) is not installed"
    probe = f"kvx{_new_suffix()}probe"
    try:
        _run_ip("netns", "add", probe)
    except (SetupError, OSError, subprocess.TimeoutExpired) as e:
        return f"cannot create a network namespace: {e}"
    try:
        _run_ip("netns", "del", probe)
    except (SetupError, OSError, subprocess.TimeoutExpired) as e:
        return f"cannot delete a network namespace: {e}"
    return None


class HostNetwork:
    """`num_hosts` namespaces on one bridge. Always `close()` it (or use `with`)."""

    def __init__(self, num_hosts):
        if not 1 <= num_hosts <= MAX_HOSTS:
            raise InvalidInputError(f"num_hosts must be 1..{MAX_HOSTS}, got {num_hosts}")
        self.num_hosts = num_hosts
        suffix = _new_suffix()
        self.bridge = f"kvx{suffix}br"
        self._namespaces = [f"kvx{suffix}h{i}" for i in range(num_hosts)]
        self._root_ends = [f"kvx{suffix}r{i}" for i in range(num_hosts)]  # on the bridge
        self._host_ends = [f"kvx{suffix}n{i}" for i in range(num_hosts)]  # in the namespaces
        self._made = []  # ("link" | "netns", name), in the order they were made
        self._closed = False
        self._prefix = _free_subnet()
        self.bridge_ip = f"{self._prefix}1"
        try:
            self._build()
        except BaseException:
            self.close()
            raise

    def _build(self):
        _run_ip("link", "add", self.bridge, "type", "bridge")
        self._made.append(("link", self.bridge))
        _run_ip("addr", "add", f"{self.bridge_ip}/24", "dev", self.bridge)
        _run_ip("link", "set", self.bridge, "up")
        for i, (ns, root_end, host_end) in enumerate(
                zip(self._namespaces, self._root_ends, self._host_ends)):
            _run_ip("netns", "add", ns)
            self._made.append(("netns", ns))
            _run_ip("link", "add", root_end, "type", "veth", "peer", "name", host_end, "netns", ns)
            self._made.append(("link", root_end))
            _run_ip("link", "set", root_end, "master", self.bridge, "up")
            _run_ip("-n", ns, "addr", "add", f"{self.host_ip(i)}/24", "dev", host_end)
            _run_ip("-n", ns, "link", "set", host_end, "up")
            _run_ip("-n", ns, "link", "set", "lo", "up")

    def host_ip(self, i):
        """Host i's address (on the bridge's subnet)."""
        self._check(i)
        return f"{self._prefix}{10 + i}"

    def namespace(self, i):
        """Host i's namespace name."""
        self._check(i)
        return self._namespaces[i]

    def command(self, i, argv):
        """The argv that runs `argv` inside host i's namespace."""
        return [_ip_binary() or "ip", "netns", "exec", self.namespace(i), *argv]

    def popen(self, i, argv, **kwargs):
        """`subprocess.Popen` of `argv` inside host i's namespace."""
        return subprocess.Popen(self.command(i, argv), **kwargs)

    def limit_rate(self, i, kbit):
        """Caps what host i sends to `kbit` kbit/s (`tc`'s token bucket on its veth)."""
        self._check(i)
        if not isinstance(kbit, int) or isinstance(kbit, bool) or kbit <= 0:
            raise InvalidInputError(f"kbit must be a positive int, got {kbit!r}")
        tc = shutil.which("tc") or "/usr/sbin/tc"
        argv = [_ip_binary() or "ip", "netns", "exec", self.namespace(i), tc, "qdisc", "add",
                "dev", self._host_ends[i], "root", "tbf", "rate", f"{kbit}kbit",
                "burst", "16kb", "latency", "10s"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise SetupError(f"`{' '.join(argv[4:])}` failed: {done.stderr.strip()}")

    def close(self):
        """Deletes the veths, namespaces and bridge; never raises. Idempotent.

        Veths go first and by name: deleting a namespace only queues its
        teardown, and its veths would linger a moment after `ip netns del`.
        Processes still inside a namespace keep it alive, though unnamed.
        """
        if self._closed:
            return
        self._closed = True
        for kind, name in reversed(self._made):
            try:
                if kind == "netns":
                    _run_ip("netns", "del", name)
                else:
                    _run_ip("link", "del", name)
            except Exception as e:  # cleanup goes on
                log.warning("TestNetwork.close: %s", e)
        self._made.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _check(self, i):
        if not 0 <= i < self.num_hosts:
            raise IndexError(f"host {i} out of range (0..{self.num_hosts - 1})")


class EtcdServer:
    """`etcd` on `host` (loopback by default); `endpoint` is its client URL. Always `stop()` it.

    `port`: its client port (None: a free one), for an etcd started after its clients.
    """

    def __init__(self, start_timeout=20.0, host="127.0.0.1", port=None):
        binary = shutil.which("etcd")
        if binary is None:
            raise SetupError("etcd is not installed: run `bash scripts/test-deps` "
                             "(Debian's etcd-server)")
        self.dir = tempfile.mkdtemp(prefix="kvxfer-etcd-")
        client, peer = port or free_port(host), free_port(host)
        self.endpoint = f"http://{host}:{client}"
        self.log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [binary, "--name", "kvxfer-test", "--data-dir", self.dir,
             "--listen-client-urls", self.endpoint, "--advertise-client-urls", self.endpoint,
             "--listen-peer-urls", f"http://{host}:{peer}",
             "--initial-advertise-peer-urls", f"http://{host}:{peer}",
             "--initial-cluster", f"kvxfer-test=http://{host}:{peer}"],
            stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + start_timeout
        while not self.healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.log.seek(0)
                output = self.log.read().decode()[-3000:]
                self.stop()
                raise SetupError(f"etcd did not start:\n{output}")
            time.sleep(0.05)

    def healthy(self):
        try:
            with urllib.request.urlopen(f"{self.endpoint}/health", timeout=1) as r:
                return json.loads(r.read()).get("health") == "true"
        except OSError:
            return False

    def stop(self):
        """Kills etcd and removes its data; idempotent."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class Processes:
    """`hosts` hosts (`HostNetwork`), etcd on their bridge, and a directory (`dir`) that the
    processes started here log into (`<name>.log`) and report into (`<name>.json`)."""

    def __init__(self, hosts: int, prefix: str = "kvxfer-hosts-"):
        self.net = HostNetwork(hosts)
        try:
            self.etcd = EtcdServer(host=self.net.bridge_ip)
        except BaseException:
            self.net.close()
            raise
        self.dir = tempfile.mkdtemp(prefix=prefix)
        self.started: list[subprocess.Popen] = []

    def popen(self, host: int, argv: list[str], name: str, env: dict[str, str],
              cwd: str | None = None) -> subprocess.Popen:
        """Starts `argv` in host `host`, its output appended to `<name>.log`."""
        with open(os.path.join(self.dir, f"{name}.log"), "a") as log:
            proc = self.net.popen(host, argv, stdout=log, stderr=subprocess.STDOUT, env=env,
                                  cwd=cwd)
        self.started.append(proc)
        return proc

    def wait_report(self, name: str, proc: subprocess.Popen, timeout: float,
                    key: str | None = None) -> dict | None:
        """`<name>.json` once it exists (with `key`, once it has that key); None if `proc`
        exits without writing it, or after `timeout` seconds."""
        path = os.path.join(self.dir, f"{name}.json")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if os.path.exists(path):
                with open(path) as f:
                    out = json.load(f)
                if key is None or key in out:
                    return out
            elif proc.poll() is not None:
                return None
            time.sleep(0.05)
        return None

    def log(self, name: str, tail: int = 3000) -> str:
        """The end of `<name>.log`."""
        with open(os.path.join(self.dir, f"{name}.log")) as f:
            return f.read()[-tail:]

    def close(self) -> None:
        """Kills every process started, stops etcd, deletes the hosts and the directory."""
        for proc in self.started:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
        self.etcd.stop()
        self.net.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def start_jax(devices: int, coordinator: str, processes: int, rank: int, ip: str) -> None:
    """Join this process to a JAX instance of `processes` processes on CPU, `devices` each.

    Call it before anything imports JAX. Collectives go over gloo (TCP). Gloo
    finds its own address from the host name, which resolves to loopback
    inside a namespace: it is given this host's address `ip` instead.
    """
    if "jax" in sys.modules:
        raise SetupError("start_jax must run before JAX is imported")
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    import jax
    from jax._src import xla_bridge

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    make = xla_bridge._jax.make_gloo_tcp_collectives
    xla_bridge._jax.make_gloo_tcp_collectives = lambda **kw: make(**kw, hostname=ip)
    jax.distributed.initialize(coordinator, num_processes=processes, process_id=rank,
                               initialization_timeout=60)
