"""The test network: network namespaces as separate hosts, joined by a bridge.

Hosts reach each other and the root namespace (where etcd listens) by address,
and nothing else: each has its own loopback. After `close()` nothing is left.
Skipped only where namespaces cannot be made (not root, no `ip`); CI runs as root.
"""

import json
import os
import secrets
import shutil
import subprocess
import sys

import pytest

from kvxfer.bench import hosts as netns
from kvxfer.bench.hosts import EtcdServer, HostNetwork, netns_available

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

REASON = netns_available()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")

TIMEOUT = 10
IP = netns._ip_binary() or "ip"

# Listens on argv[1], prints its port, then prints what one connection sends.
SERVER = """
import socket, sys
s = socket.socket()
s.settimeout(8)
s.bind((sys.argv[1], 0))
s.listen(1)
print(s.getsockname()[1], flush=True)
conn, _ = s.accept()
data = b""
while chunk := conn.recv(4096):
    data += chunk
print(data.decode(), flush=True)
"""

# Sends argv[3] to argv[1]:argv[2]; on failure prints the error's type and exits 1.
CLIENT = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5) as s:
        s.sendall(sys.argv[3].encode())
except OSError as e:
    print(type(e).__name__, flush=True)
    sys.exit(1)
"""


@pytest.fixture
def net():
    network = HostNetwork(2)
    yield network
    network.close()


@pytest.fixture
def servers():
    """Starts SERVER (in a namespace, or the root one for None); returns (proc, port)."""
    started = []

    def start(net, host, addr):
        argv = [sys.executable, "-c", SERVER, addr]
        if host is not None:
            argv = net.command(host, argv)
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
        started.append(proc)
        port = proc.stdout.readline().strip()
        assert port.isdigit(), f"server did not start: {port!r}"
        return proc, port
    yield start
    for proc in started:
        proc.kill()
        proc.wait(timeout=TIMEOUT)


def connect(net, host, addr, port, message):
    """Runs CLIENT in host's namespace; returns (exit status, output)."""
    done = subprocess.run(net.command(host, [sys.executable, "-c", CLIENT, addr, port, message]),
                          capture_output=True, text=True, timeout=TIMEOUT)
    return done.returncode, done.stdout.strip()


def received(proc):
    out, _ = proc.communicate(timeout=TIMEOUT)
    return out.strip()


def test_hosts_reach_each_other(net, servers):
    server, port = servers(net, 1, net.host_ip(1))
    assert connect(net, 0, net.host_ip(1), port, "hello from host 0") == (0, "")
    assert received(server) == "hello from host 0"


def test_hosts_reach_the_root_namespace_on_the_bridge(net, servers):
    server, port = servers(net, None, net.bridge_ip)
    assert connect(net, 0, net.bridge_ip, port, "hello root") == (0, "")
    assert received(server) == "hello root"


def test_hosts_have_their_own_loopback(net, servers):
    server, port = servers(net, 1, "127.0.0.1")
    assert connect(net, 0, "127.0.0.1", port, "x") == (1, "ConnectionRefusedError")
    assert connect(net, 1, "127.0.0.1", port, "from host 1 itself") == (0, "")
    assert received(server) == "from host 1 itself"


def namespaces():
    return subprocess.run([IP, "netns", "list"], capture_output=True, text=True,
                          check=True).stdout


def link_exists(name):
    return subprocess.run([IP, "link", "show", name], capture_output=True).returncode == 0


def test_close_removes_everything():
    net = HostNetwork(2)
    names = [net.namespace(0), net.namespace(1)]
    listed = namespaces()
    assert all(name in listed for name in names) and link_exists(net.bridge)
    net.close()
    listed = namespaces()
    assert not any(name in listed for name in names), listed
    assert not link_exists(net.bridge)
    assert not any(link_exists(name) for name in net._root_ends)
    net.close()  # a second close is harmless


def test_limit_rate_caps_what_a_host_sends_and_refuses_a_bad_rate(net):
    from kvxfer.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match="kbit must be a positive int, got 0"):
        net.limit_rate(1, 0)
    net.limit_rate(1, 256)  # 32 KB/s once the 16 KB burst is spent
    tc = shutil.which("tc") or "/usr/sbin/tc"
    shown = subprocess.run(net.command(1, [tc, "qdisc", "show"]), capture_output=True,
                           text=True, timeout=TIMEOUT).stdout
    assert "tbf" in shown and "rate 256Kbit" in shown, shown


def test_failed_creation_cleans_up_and_says_why(monkeypatch):
    suffix = secrets.token_hex(3)[:5]
    monkeypatch.setattr(netns, "_new_suffix", lambda: suffix)
    good = HostNetwork.host_ip
    monkeypatch.setattr(HostNetwork, "host_ip",
                        lambda self, i: "10.0.0.300" if i == 1 else good(self, i))
    with pytest.raises(RuntimeError, match="10.0.0.300/24.* failed: .+"):
        HostNetwork(2)
    assert f"kvx{suffix}" not in namespaces()
    links = subprocess.run([IP, "-o", "link"], capture_output=True, text=True).stdout
    assert f"kvx{suffix}" not in links


def test_etcd_on_the_bridge_serves_the_hosts(net):
    server = EtcdServer(host=net.bridge_ip)
    try:
        assert server.healthy()
        fetch = ("import sys, urllib.request\n"
                 "opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))\n"
                 "print(opener.open(sys.argv[1] + '/health', timeout=5).read().decode())")
        done = subprocess.run(net.command(0, [sys.executable, "-c", fetch, server.endpoint]),
                              capture_output=True, text=True, timeout=TIMEOUT)
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["health"] == "true"
    finally:
        server.stop()
