"""Name claims under attack (`kvxfer.nixl.claims`): a claims folder that is no folder, one
another user planted, a holder that forked, and an etcd that answers garbage end in a named
error or an unchecked start, never a raw OSError, a write through a planted link, or a name
held for good (issue 39: safe at every edge)."""

import hashlib
import http.server
import json
import os
import threading
import time

import pytest

from kvxfer.errors import SetupError
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
    answers = [{"result": [1]}, {"result": {"TTL": "x"}}]
    asked = []

    def post(endpoints, path, body):
        asked.append(path)
        return answers[len(asked) - 1] if len(asked) <= len(answers) else {"result": {"TTL": "5"}}
    monkeypatch.setattr(claims, "_KEEP_S", 0.01)
    monkeypatch.setattr(claims, "_post", post)
    claim = claims._EtcdClaim("P-keep", "http://127.0.0.1:1", "7")
    try:
        deadline = time.monotonic() + 5
        while len(asked) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert claim._thread.is_alive() and len(asked) >= 4  # it renews on, after a warning
        assert "no longer holds its name" in caplog.text
    finally:
        claim.release()
