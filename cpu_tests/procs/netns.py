"""Separate test "hosts" on one machine: Linux network namespaces joined by a bridge.

Each host is a network namespace with one veth into a bridge in the root
namespace, on a random /24 under 10.0.0.0/8: the bridge (the root namespace)
is .1, host i is .(10+i). Every instance has its own subnet and names, so
concurrent runs do not collide. Needs root and `ip` (Debian's `iproute2`,
installed by `scripts/test-deps`). Everything made is named `kvx<suffix>...`:
a run killed before `close()` leaves those behind (`ip netns list`, `ip link`).
"""

import logging
import os
import random
import secrets
import shutil
import subprocess

log = logging.getLogger(__name__)

MAX_HOSTS = 244  # host i is .(10+i), at most .254


def _ip_binary():
    """`ip`'s path: on PATH, else where Debian puts it (/usr/sbin may be off a user's PATH)."""
    for candidate in (shutil.which("ip"), "/usr/sbin/ip", "/sbin/ip"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


def _run_ip(*args):
    """Runs `ip args`; raises RuntimeError with its stderr if it fails."""
    binary = _ip_binary()
    if binary is None:
        raise RuntimeError("`ip` is not installed: run `bash scripts/test-deps` (Debian's iproute2)")
    done = subprocess.run([binary, *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
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
    raise RuntimeError("no free 10.x.y.0/24 subnet found")


def netns_available():
    """None if `TestNetwork` can work here, else a short reason why not."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if _ip_binary() is None:
        return "`ip` (iproute2) is not installed"
    probe = f"kvx{_new_suffix()}probe"
    try:
        _run_ip("netns", "add", probe)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        return f"cannot create a network namespace: {e}"
    try:
        _run_ip("netns", "del", probe)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        return f"cannot delete a network namespace: {e}"
    return None


class TestNetwork:
    """`num_hosts` namespaces on one bridge. Always `close()` it (or use `with`)."""

    __test__ = False  # a helper, not a pytest test class

    def __init__(self, num_hosts):
        if not 1 <= num_hosts <= MAX_HOSTS:
            raise ValueError(f"num_hosts must be 1..{MAX_HOSTS}, got {num_hosts}")
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
