"""Name claims under attack (`kvxfer.nixl.claims`): a claims folder that is no folder, one
another user planted, a holder that forked, and an etcd that answers garbage end in a named
error or an unchecked start, never a raw OSError, a write through a planted link, or a name
held for good (issue 39: safe at every edge). A holder whose etcd lease lapsed behind its
back (it stalled past the lease) says so once and takes its name again only if it is free
(issue 50)."""

import base64
import hashlib
import http.server
import json
import logging
import os
import re
import threading
import time
import urllib.request

import pytest

from kvxfer.bench.hosts import EtcdServer
from kvxfer.errors import InvalidInputError, SetupError
from kvxfer.nixl import claims


@pytest.fixture
def folder(tmp_path, monkeypatch):
    monkeypatch.setenv("KVXFER_AGENT_DIR", str(tmp_path / "claims"))
    return tmp_path / "claims"


def test_a_claims_folder_that_is_a_file_is_a_setup_error_naming_it(folder):
    folder.write_text("not a folder")
    with pytest.raises(SetupError, match=rf"KVXFER_AGENT_DIR {str(folder)!r}"):
        claims.take("P-file", None, "127.0.0.1")
    claims.give_back("P-file")


def test_a_claims_folder_that_cannot_be_made_is_a_setup_error_naming_it(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("KVXFER_AGENT_DIR", str(tmp_path / "file" / "claims"))
    with pytest.raises(SetupError, match=r"KVXFER_AGENT_DIR '.*/file/claims'.*cannot be made"):
        claims.take("P-unmade", None, "127.0.0.1")


def test_a_link_planted_under_a_names_lock_file_is_not_written_through(folder, tmp_path):
    folder.mkdir()
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    name = "P-planted"
    lock = folder / hashlib.blake2b(name.encode(), digest_size=16).hexdigest()
    lock.symlink_to(victim)
    with pytest.raises(SetupError, match="not a plain file"):
        claims.take(name, None, "127.0.0.1")
    assert victim.read_text() == "keep me"


def test_a_claims_folder_others_may_write_to_is_refused(folder):
    folder.mkdir()
    folder.chmod(0o777)  # e.g. planted in /tmp by another user before this one's first start
    with pytest.raises(SetupError, match="others may write"):
        claims.take("P-shared", None, "127.0.0.1")


def test_a_child_forked_by_the_holder_does_not_keep_its_name(folder):
    claims.take("P-forked", None, "127.0.0.1")
    read, write = os.pipe()
    up_read, up_write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child lives on (an engine's helper) after its parent let the name go
        os.close(write)
        os.write(up_write, b"u")  # running: what happens at fork is done
        os.read(read, 1)
        os._exit(0)
    os.close(read)
    os.close(up_write)
    try:
        assert os.read(up_read, 1) == b"u"
        claims.give_back("P-forked")
        claims.take("P-forked", None, "127.0.0.1")  # a restart under the name, child alive
        claims.give_back("P-forked")
    finally:
        os.close(write)
        os.close(up_read)
        os.waitpid(pid, 0)


class _Garbage(http.server.BaseHTTPRequestHandler):
    """An etcd gateway that answers every request with a JSON value that is no object."""

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        body = json.dumps(self.server.answer).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("answer", [[1, 2], "text", None, 7])
def test_an_etcd_answering_json_that_is_no_object_leaves_the_name_unchecked(answer, caplog):
    server = http.server.HTTPServer(("127.0.0.1", 0), _Garbage)
    server.answer = answer
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        claims.take("P-garbage", f"http://127.0.0.1:{server.server_port}", "127.0.0.1")
        assert "not checked" in caplog.text or "is not refused" in caplog.text
    finally:
        claims.give_back("P-garbage")
        server.shutdown()
        server.server_close()


def test_an_etcd_txn_answer_without_header_is_no_refusal(caplog, monkeypatch):
    """A proxy's `{}` for the claim's transaction says nothing of the name: not held."""
    monkeypatch.setattr(claims, "_post", lambda e, path, body: (
        {"ID": "7"} if path.endswith("grant") else {}))
    claims.take("P-empty", "http://127.0.0.1:1", "127.0.0.1")  # no InvalidInputError
    assert "not checked" in caplog.text
    claims.give_back("P-empty")


def test_a_lease_id_that_is_no_int_leaves_the_name_unchecked(caplog, monkeypatch):
    monkeypatch.setattr(claims, "_post", lambda e, path, body: {"ID": {"x": 1}})
    claims.take("P-id", "http://127.0.0.1:1", "127.0.0.1")
    assert "is not refused" in caplog.text
    claims.give_back("P-id")



def test_the_lease_keeper_outlives_a_garbage_keepalive_answer(monkeypatch, caplog):
    # JSON may say 1e999 (inf) and NaN, which Python's json reads: int() of inf overflows.
    answers = [{"result": [1]}, {"result": {"TTL": "x"}}, {"result": {"TTL": float("inf")}},
               {"result": {"TTL": float("nan")}}, {"result": {"TTL": "9" * 5000}}]
    asked = []

    def post(endpoints, path, body):
        asked.append(path)
        return answers[len(asked) - 1] if len(asked) <= len(answers) else {"result": {"TTL": "5"}}
    monkeypatch.setattr(claims, "_KEEP_S", 0.01)
    monkeypatch.setattr(claims, "_post", post)
    claim = claims._EtcdClaim("P-keep", "http://127.0.0.1:1", "7", b"{}")
    try:
        deadline = time.monotonic() + 5
        while len(asked) < len(answers) + 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert claim._thread.is_alive() and len(asked) >= len(answers) + 2  # it renews on, after a warning
        assert "cannot renew its name's etcd lease" in caplog.text
        assert "/v3/lease/grant" not in asked  # garbage is no lapse: the name is not retaken
    finally:
        claim.release()


@pytest.fixture(scope="module")
def etcd():
    server = EtcdServer()
    yield server.endpoint
    server.stop()


def _gateway(etcd, path, body):
    with urllib.request.urlopen(f"{etcd}{path}", json.dumps(body).encode(), timeout=5) as r:
        return json.loads(r.read())


def _record(etcd, name):
    """`(holder's record, lease)` under `name`'s claim key, or None."""
    key = base64.b64encode(f"/kvxfer/names/{name}".encode()).decode()
    kvs = _gateway(etcd, "/v3/kv/range", {"key": key}).get("kvs")
    return (json.loads(base64.b64decode(kvs[0]["value"])), kvs[0].get("lease")) if kvs else None


def _errors(caplog):
    return [r.getMessage() for r in caplog.records
            if r.name == "kvxfer.nixl.claims" and r.levelno >= logging.ERROR]


def _wait(condition, within_s):
    deadline = time.monotonic() + within_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def test_a_holder_whose_lease_lapsed_says_so_once_and_takes_its_name_again(etcd, caplog,
                                                                          monkeypatch):
    monkeypatch.setattr(claims, "_KEEP_S", 0.2)
    claims.take("P-lapsed", etcd, "127.0.0.1")
    try:
        claim = claims._held["P-lapsed"]
        old = claim.lease
        _gateway(etcd, "/v3/lease/revoke", {"ID": old})  # as if it stalled past the lease
        assert _wait(lambda: claim.lease != old, 5), "it never took its name again"
        time.sleep(1.0)  # several renewals more: the error is said once
        errors = _errors(caplog)
        assert len(errors) == 1, errors
        assert "P-lapsed's claim on its name in etcd" in errors[0]
        assert "lapsed" in errors[0] and "holds its name again" in errors[0]
        record, lease = _record(etcd, "P-lapsed")
        assert record["pid"] == os.getpid() and lease == claim.lease
        assert claims.lost("P-lapsed") is None
    finally:
        claims.give_back("P-lapsed")
    assert _record(etcd, "P-lapsed") is None  # the new lease was let go too


def test_a_holder_whose_name_another_took_meanwhile_says_it_lost_and_leaves_it(etcd, caplog,
                                                                              monkeypatch):
    monkeypatch.setattr(claims, "_KEEP_S", 0.2)
    claims.take("P-taken", etcd, "127.0.0.1")
    other = _gateway(etcd, "/v3/lease/grant", {"TTL": 60})["ID"]
    try:
        old = claims._held["P-taken"].lease
        # A duplicate that started while the holder stalled: the key is now its, under its
        # lease (one put, then the revoke, so the holder cannot renew in between).
        theirs = {"host": "elsewhere", "pid": 4242, "address": "10.0.0.9"}
        key = base64.b64encode(b"/kvxfer/names/P-taken").decode()
        value = base64.b64encode(json.dumps(theirs).encode()).decode()
        _gateway(etcd, "/v3/kv/put", {"key": key, "value": value, "lease": other})
        _gateway(etcd, "/v3/lease/revoke", {"ID": old})
        holder = "process 4242 on host elsewhere (10.0.0.9)"
        assert _wait(lambda: claims.lost("P-taken") == holder, 5), claims.lost("P-taken")
        time.sleep(1.0)  # several renewals' time: nothing more is said
        errors = _errors(caplog)
        assert len(errors) == 1, errors
        assert f"{holder} holds it now" in errors[0]
        assert _record(etcd, "P-taken") == (theirs, other)  # not stolen back
        refused = f"'P-taken' is already in use by {re.escape(holder)}"
        with pytest.raises(InvalidInputError, match=refused):
            claims.take("P-taken", etcd, "127.0.0.1")  # a third start is still refused
        claims.give_back("P-taken")
        assert _record(etcd, "P-taken") == (theirs, other)  # letting go leaves it to its holder
    finally:
        claims.give_back("P-taken")
        _gateway(etcd, "/v3/lease/revoke", {"ID": other})
