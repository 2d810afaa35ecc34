"""P and D agents that find each other by name in etcd, NIXL's metadata service.

Every agent publishes its metadata to a real etcd server (started here, on
loopback) and fetches its peers' from it; P starts no listener. The failures
a deployment meets: a name nobody published, a P that went away cleanly
(its record removed) or was killed (its record left behind, stale), and a P
restarted under the same name.
"""

import base64
import http.server
import json
import os
import sys
import threading
import time
import urllib.request

import pytest

from kvxfer.bench.hosts import EtcdServer
from kvxfer.device.staging import Staging
from kvxfer.errors import InvalidInputError
from kvxfer.nixl import etcd as etcd_records
from kvxfer.nixl.agent import TransportConfig, close_agent, free_port, release_name, start_agent

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from procs.harness import Peer, PeerError, wait_until  # noqa: E402
from test_nixl import TIMEOUT, assert_read_intact, read, spec, stage_and_hold  # noqa: E402

pytest.importorskip("nixl_cu12._api", reason="NIXL (nixl-cu12) is not installed")

# P's republishing backs off to 5 s; NIXL's etcd client (gRPC) reconnects with a backoff of
# its own, a few seconds after an outage this short.
FOUND_WITHIN_S = 20.0


@pytest.fixture(scope="module")
def etcd():
    server = EtcdServer()
    yield server.endpoint
    server.stop()


@pytest.fixture
def peers(etcd):
    started = []

    def start(role, name, **config):
        started.append(Peer(role, spec(name, etcd_endpoints=etcd, **config)))
        return started[-1]
    yield start
    for peer in started:
        peer.kill()


def connect(d, name):
    return d.call("connect", peer=name, host="127.0.0.1", port=0, timeout=TIMEOUT + 10)


def test_d_reads_from_a_p_it_finds_by_name_with_no_listener(peers):
    p, d = peers("P", "P_etcd"), peers("D", "D_etcd")
    assert p.port == 0 and d.port == 0  # neither listens
    params = stage_and_hold(p, "r", [3, 4, 9], seed=5)
    assert params["port"] == 0
    assert_read_intact(d, "r", params, [1, 2, 3], {3: 5, 4: 5, 9: 5})
    assert p.call("freed")["held"] == []
    # A second D finds the same P the same way, concurrently with the first.
    d2 = peers("D", "D2_etcd")
    params = stage_and_hold(p, "r2", [7], seed=6)
    assert_read_intact(d2, "r2", params, [4], {7: 6})


def test_a_name_nobody_published_is_a_clear_error_within_the_deadline(peers):
    d = peers("D", "D_alone")
    start = time.monotonic()
    with pytest.raises(PeerError, match=r"'nobody' in etcd at http://127\.0\.0\.1:\d+ sent no "
                                        r"NIXL metadata .*not published") as e:
        connect(d, "nobody")
    assert e.value.kind == "TransferError"
    assert time.monotonic() - start < TIMEOUT + 5


def test_a_p_that_closed_is_gone_from_etcd(peers):
    p, d = peers("P", "P_closed"), peers("D", "D_closed")
    p.port  # noqa: B018 - published
    p.close()
    with pytest.raises(PeerError, match="no NIXL metadata"):
        connect(d, "P_closed")


def test_a_killed_ps_stale_record_fails_its_requests_and_a_restart_serves_new_ones(peers):
    p, d = peers("P", "P_stale"), peers("D", "D_stale")
    old = stage_and_hold(p, "r", [1, 2], seed=7)
    p.kill()  # its record stays in etcd: stale
    start = time.monotonic()
    assert read(d, "r", old, [5, 6]).get("failed") == [5, 6]  # in D's logical ids, no hang
    assert time.monotonic() - start < 2 * TIMEOUT + 5
    p = peers("P", "P_stale")  # restarted under the same name: a new record
    new = stage_and_hold(p, "r", [1, 2], seed=8)
    assert new["instance"] != old["instance"]
    assert read(d, "r", old, [5, 6]).get("failed") == [5, 6]  # old params stay refused
    assert_read_intact(d, "r", new, [5, 6], {1: 8, 2: 8})


def test_a_second_agent_under_a_live_agents_name_is_refused_at_start_naming_it(peers, etcd):
    d = peers("D", "D_twice")
    d.port  # noqa: B018 - started: it holds its name
    with pytest.raises(InvalidInputError, match=rf"name 'D_twice' is already in use by process "
                                                rf"{d.proc.pid} on host .*claimed in etcd at "
                                                rf"{etcd}"):
        start_agent(TransportConfig("D_twice", etcd_endpoints=etcd), [Staging(1, 4, (8,))])
    p = peers("P", "P_twice")
    assert_read_intact(d, "r", stage_and_hold(p, "r", [4], seed=2), [1], {4: 2})


def test_ps_left_at_the_default_name_are_each_reachable(peers):
    first, second, d = peers("P", None), peers("P", None), peers("D", "D_defaults")
    assert first.name != second.name and first.name.startswith("kvxfer-agent-")
    for seed, p in enumerate((first, second), 20):
        params = stage_and_hold(p, "r", [5], seed=seed)
        assert params["peer"] == p.name
        assert_read_intact(d, "r", params, [1], {5: seed})


def test_a_p_started_while_etcd_is_down_is_found_once_etcd_is_up():
    endpoint = f"http://127.0.0.1:{free_port()}"
    p, d, server = Peer("P", spec("P_early", etcd_endpoints=endpoint)), None, None
    try:
        p.port  # noqa: B018 - started, with etcd down
        server = EtcdServer(port=int(endpoint.rsplit(":", 1)[1]))
        up = time.monotonic()
        d = Peer("D", spec("D_late", etcd_endpoints=endpoint))
        params = stage_and_hold(p, "r", [2], seed=3)
        while True:  # each try waits up to D's handshake timeout
            try:
                connect(d, "P_early")
                break
            except PeerError:
                if time.monotonic() - up > FOUND_WITHIN_S:
                    raise
        print(f"found {time.monotonic() - up:.1f} s after etcd came up")
        assert_read_intact(d, "r", params, [1], {2: 3})
        assert "P_early's NIXL metadata is not in etcd" in p.stderr()
    finally:
        for peer in (d, p):
            if peer is not None:
                peer.kill()
        if server is not None:
            server.stop()


def test_a_record_etcd_lost_is_published_again(etcd, monkeypatch):
    monkeypatch.setattr(etcd_records, "_RECHECK_S", 0.05)
    config = TransportConfig("P_lost", etcd_endpoints=etcd)
    agent, _, reg = start_agent(config, [Staging(1, 4, (8,))])
    publication = etcd_records.Publication(agent, config)
    key = etcd_records.record_key("P_lost")
    try:
        assert wait_until(lambda: publication.tick() or publication.held, 5)
        body = json.dumps({"key": base64.b64encode(key).decode()}).encode()
        urllib.request.urlopen(f"{etcd}/v3/kv/deleterange", body, timeout=5).close()
        assert etcd_records.read_record(etcd, key) is None
        assert wait_until(lambda: publication.tick() or etcd_records.read_record(etcd, key), 5)
        assert etcd_records.read_record(etcd, key) == agent.get_agent_metadata()
    finally:
        publication.close()
        close_agent(agent, reg, "P_lost", etcd=True)
        release_name("P_lost")


@pytest.mark.parametrize("status, raised", [(404, etcd_records.Unreadable), (503, OSError)])
def test_an_etcd_without_gateway_is_unreadable_for_good_and_a_5xx_is_no_answer(status, raised):
    class Answer(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 - http.server's name
            self.send_error(status)

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(raised, match=f"answered HTTP {status}"):
            etcd_records.read_record(f"http://127.0.0.1:{server.server_port}", b"k")
    finally:
        server.shutdown()
        server.server_close()


def test_a_listener_d_refuses_params_of_a_p_without_listener(peers):
    p = peers("P", "P_for_listener")
    params = stage_and_hold(p, "r", [1], seed=9)
    d = Peer("D", spec("D_listener"))
    try:
        assert read(d, "r", params, [8]).get("failed") == [8]
        with pytest.raises(PeerError, match="has no listener .*give this D etcd_endpoints"):
            d.call("connect", peer="P_for_listener", host="127.0.0.1", port=0)
    finally:
        d.kill()


@pytest.mark.parametrize("endpoints", ["", "127.0.0.1:2379", "http://", "http://a:1,tcp://b:2",
                                       5, "http://a:1\n", "http://a:port", "http://a:99999",
                                       "http://:2379", "http://a:1,"])
def test_bad_etcd_endpoints_are_refused_by_name(endpoints):
    with pytest.raises(InvalidInputError, match="etcd_endpoints must be None or comma-separated"):
        TransportConfig("P", etcd_endpoints=endpoints)


def test_a_listen_port_with_etcd_is_refused_naming_it():
    with pytest.raises(InvalidInputError, match="listen_port 5610 is unused with etcd_endpoints"):
        TransportConfig("P", etcd_endpoints="http://127.0.0.1:2379", listen_port=5610)


_FETCH_WHILE_ETCD_DOWN = """
import sys, time
from kvxfer.bench.hosts import EtcdServer
from kvxfer.device.layout import check_block_compatible
from kvxfer.device.staging import Staging
from kvxfer.nixl.agent import TransportConfig
from kvxfer.nixl.decode import DecodeTransport
server = EtcdServer()
d = DecodeTransport(TransportConfig("d-etcd-down", etcd_endpoints=server.endpoint,
                                    handshake_timeout_s=1.0),
                    Staging(1, 4, (8,)), {}, check_block_compatible)
server.stop()
d.handshakes.begin("some-p", "127.0.0.1", 0)
deadline = time.monotonic() + 3
while time.monotonic() < deadline:
    d.poll()
    time.sleep(0.01)
d.close()
print("closed", flush=True)
"""


def test_an_agent_that_fetched_a_peer_while_etcd_was_down_exits_after_close():
    """NIXL's own fetch from etcd, issued while etcd was down, left a native thread the agent's
    destructor waited for: the process never exited after close()."""
    import subprocess

    try:
        out = subprocess.run([sys.executable, "-c", _FETCH_WHILE_ETCD_DOWN], capture_output=True,
                             text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the process hung after close()")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "closed" in out.stdout
