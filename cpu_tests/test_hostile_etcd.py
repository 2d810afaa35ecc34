"""etcd that answers slowly or too much (`kvxfer.nixl.etcd.gateway_post`, the one client of
etcd's JSON gateway): each call ends within its deadline and reads a bounded answer, so such
an etcd holds neither an agent's start, nor its `close`, nor a record read (issue 50).

The etcd here is a fake HTTP server on loopback; what a real etcd answers is tested in
`test_nixl_etcd.py` and `test_hostile_claims.py`.
"""

import http.server
import re
import socket
import threading
import time

import pytest

from kvxfer.errors import KvxferError
from kvxfer.nixl import claims
from kvxfer.nixl import etcd as etcd_records

_ANSWER = b'{"kvs": [{"key": "aw==", "value": "cmVjb3Jk"}]}'  # "record" under "k"


class _Etcd(http.server.BaseHTTPRequestHandler):
    """Answers each POST as `server.mode` says: `dribble` one byte every 0.2 s (for up to a
    minute), `big` a body over the answer cap (`server.length` names its length or not),
    `ok` a record at once."""

    def do_POST(self):  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers["Content-Length"]))
        try:
            getattr(self, f"_{self.server.mode}")()
        except OSError:  # the client hung up, as it should
            pass

    def _dribble(self):
        answer = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n" + b"X-Pad: x\r\n" * 30
        for byte in answer[:300]:
            if self.server.done.wait(0.2):
                return
            self.wfile.write(bytes([byte]))
            self.wfile.flush()

    def _big(self):
        body = b'{"kvs": [], "pad": "' + b"x" * etcd_records.MAX_ANSWER_BYTES + b'"}'
        self.send_response(200)
        if self.server.length:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()  # without a length (HTTP/1.0) the body ends when the socket closes
        self.wfile.write(body)

    def _slow(self):  # answers after `server.delay` s
        if not self.server.done.wait(self.server.delay):
            self._ok()

    def _ok(self):
        self.send_response(200)
        self.send_header("Content-Length", str(len(_ANSWER)))
        self.end_headers()
        self.wfile.write(_ANSWER)

    def log_message(self, *args):
        pass


@pytest.fixture
def fake():
    """Starts fake etcds: `fake(mode, length=True)` -> its endpoint."""
    servers = []

    def start(mode, length=True, delay=0.0):
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Etcd)
        server.daemon_threads = True
        server.mode, server.length, server.done = mode, length, threading.Event()
        server.delay = delay
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_port}"
    yield start
    for server in servers:
        server.done.set()
        server.shutdown()
        server.server_close()


def test_an_etcd_that_dribbles_fails_a_record_read_within_its_deadline(fake):
    endpoint = fake("dribble")
    start = time.monotonic()
    with pytest.raises(etcd_records.EtcdError, match=rf"etcd at {re.escape(endpoint)} did not "
                                                     rf"answer POST /v3/kv/range within the "
                                                     rf"call's 1 s deadline") as e:
        etcd_records.read_record(endpoint, b"k", timeout=1.0)
    assert time.monotonic() - start < 5.0
    assert isinstance(e.value, KvxferError) and isinstance(e.value, OSError)


def test_a_dribbling_first_endpoint_leaves_the_next_one_time_to_answer(fake):
    endpoints = f"{fake('dribble')},{fake('ok')}"
    start = time.monotonic()
    assert etcd_records.read_record(endpoints, b"k", timeout=2.0) == b"record"
    assert time.monotonic() - start < 5.0


def test_a_start_and_a_close_against_an_etcd_that_dribbles_are_not_held(fake, caplog,
                                                                         monkeypatch):
    """The engine's start claims the agent's name in etcd, and its close lets it go."""
    monkeypatch.setattr(claims, "_TIMEOUT_S", 0.5)
    endpoint = fake("dribble")
    start = time.monotonic()
    claims.take("P-dribble", endpoint, "127.0.0.1")  # unchecked, with a warning: no hang
    claims.give_back("P-dribble")
    assert time.monotonic() - start < 5 * claims._TIMEOUT_S
    assert "is not refused" in caplog.text and "deadline" in caplog.text
    claim = claims._EtcdClaim("P-dribble", endpoint, "7", b"{}")
    time.sleep(claims._KEEP_S + 0.1)  # renewing, from a dribbling etcd
    start = time.monotonic()
    claim.release()
    assert time.monotonic() - start < 5 * claims._TIMEOUT_S


@pytest.mark.parametrize("length", [True, False], ids=["with-length", "until-close"])
def test_an_oversized_answer_is_refused_by_name(fake, length):
    endpoint = fake("big", length)
    cap = etcd_records.MAX_ANSWER_BYTES
    with pytest.raises(etcd_records.EtcdError, match=rf"etcd at {re.escape(endpoint)} answered "
                                                     rf"POST /v3/kv/range with more than "
                                                     rf"MAX_ANSWER_BYTES {cap} bytes"):
        etcd_records.read_record(endpoint, b"k")


@pytest.mark.parametrize("deadline", [0, -1.0, float("nan"), float("inf"), True, "2", None])
def test_a_deadline_that_is_no_positive_number_is_refused_by_name(deadline):
    with pytest.raises(etcd_records.InvalidInputError, match=rf"deadline_s .* got "
                                                             rf"{re.escape(repr(deadline))}"):
        etcd_records.gateway_post("http://127.0.0.1:1", "/v3/kv/range", {}, deadline_s=deadline)


def test_a_dead_first_endpoint_leaves_a_slow_second_what_is_left_not_half(fake):
    """A refused connection costs the call nothing: the next endpoint gets the time left when
    it is asked (an even share of what is left), not a share fixed at the start."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    endpoints = f"{dead},{fake('slow', delay=1.2)}"  # over half the 2 s deadline
    assert etcd_records.read_record(endpoints, b"k", timeout=2.0) == b"record"


def test_hellos_under_many_made_up_names_queue_a_bounded_number_of_record_reads():
    """P fetches a D's record from etcd when it says hello; made-up names must not queue
    one read each behind the real D's (one fetch thread, each read up to its deadline)."""
    from kvxfer.nixl.agent import TransportConfig
    from kvxfer.nixl.etcd import MAX_FETCHING, Fetcher

    fetcher = Fetcher(None, TransportConfig("p-fetch", etcd_endpoints="http://127.0.0.1:1"))
    try:
        for i in range(20 * MAX_FETCHING):
            fetcher.fetch(f"made-up-{i}")
        assert len(fetcher._reading) == MAX_FETCHING
    finally:
        fetcher.close()
