"""The fleet key (`kvxfer.nixl.gate`): with it, an agent's NIXL metadata, and with it a READ of
its staging, goes only to peers that prove they hold the key; a stranger gets no metadata and
no byte, whatever it sends; a key is rotated by listing two."""

import os
import secrets
import socket
import struct
import sys
import time

import pytest

from kvxfer.errors import InvalidInputError
from kvxfer.nixl.agent import TransportConfig, _nixl, free_port
from kvxfer.nixl.gate import ENV_KEY, MAX_FRAME, read_keys
from kvxfer.plan.save_plan import ScheduledRequest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from procs.pair import as_bits  # noqa: E402


@pytest.fixture
def key_file(tmp_path):
    """`make(*keys) -> path`: a fleet key file holding `keys` (hex), one per line."""
    def make(*keys):
        path = tmp_path / f"fleet-{secrets.token_hex(4)}.key"
        path.write_text("# the fleet's key\n" + "\n".join(keys) + "\n")
        return str(path)
    return make


def _prefilled(pr, req_id="r"):
    pr.p.add_request(req_id, 40)
    pr.save(ScheduledRequest(req_id, 0, 40, ([5, 9, 12],), full_table=True))
    pr.serve()
    return pr.p.request_finished(req_id)


def test_peers_holding_the_fleet_key_transfer_as_without_one(pair, key_file):
    path = key_file(secrets.token_hex(32))
    pr = pair(keys=(path, path))
    params = _prefilled(pr)
    assert params["port"] == pr.p.worker.transport.port  # the gate listens where params say
    assert pr.load("r", params, [20, 21, 22]) == (["r"], [])
    for p_cache, d_cache in zip(pr.p_caches[0], pr.d_caches[0]):
        assert (as_bits(d_cache)[[20, 21, 22]] == as_bits(p_cache)[[5, 9, 12]]).all()


def test_a_d_with_another_key_gets_nothing_and_fails_by_name(pair, key_file, caplog):
    pr = pair(keys=(key_file(secrets.token_hex(32)), key_file(secrets.token_hex(32))),
              handshake=2.0)
    params = _prefilled(pr)
    before = [as_bits(c)[[20, 21, 22]].copy() for c in pr.d_caches[0]]
    assert pr.load("r", params, [20, 21, 22]) == ([], ["r"])
    assert any("holds none of this side's fleet keys" in r.getMessage() for r in caplog.records)
    for cache, bits in zip(pr.d_caches[0], before):
        assert (as_bits(cache)[[20, 21, 22]] == bits).all()
    assert not pr.d.transport.agent.check_remote_metadata(params["peer"])
    assert not pr.p.worker.transport.agent.check_remote_metadata(pr.d.transport.config.name)


@pytest.mark.parametrize("p_keys, d_keys, works", [
    (("new", "old"), ("old",), True),  # P accepts the next key already
    (("new", "old"), ("old", "new"), True),  # D proves with the old one, accepts either
    (("new",), ("new", "old"), True),  # the old one gone from P once every D proves the new
    (("new",), ("old", "new"), False),  # a D still proving the old one is refused
])
def test_a_key_is_rotated_by_listing_two(pair, key_file, p_keys, d_keys, works):
    hexes = {"new": secrets.token_hex(32), "old": secrets.token_hex(32)}
    pr = pair(keys=(key_file(*(hexes[k] for k in p_keys)), key_file(*(hexes[k] for k in d_keys))),
              handshake=2.0)
    params = _prefilled(pr)
    assert pr.load("r", params, [20, 21, 22]) == ((["r"], []) if works else ([], ["r"]))


def _frame(sock):
    n = struct.unpack(">I", sock.recv(4))[0]
    return sock.recv(n)


@pytest.mark.parametrize("sends", [b"GET / HTTP/1.0\r\n\r\n", b"\xff\xff\xff\xff",
                                   b"forged-hello", b""])
def test_a_stranger_at_the_gate_gets_no_metadata_whatever_it_sends(pair, key_file, sends):
    pr = pair(keys=(key_file(secrets.token_hex(32)), None))
    port = pr.p.worker.transport.port
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        assert b"nonce" in _frame(sock)  # all a stranger ever reads: a fresh nonce
        if sends == b"forged-hello":  # well formed, under a made-up key
            body = (b'{"name": "stranger", "nonce": "00", "metadata": "AAAA", "mac": "'
                    + b"0" * 64 + b'"}')
            sends = struct.pack(">I", len(body)) + body
        rest = b""
        try:
            sock.sendall(sends)
            sock.shutdown(socket.SHUT_WR)
            while chunk := sock.recv(1 << 16):
                rest += chunk
        except OSError:  # closed by the gate already, what the stranger sent unread
            pass
        assert rest == b""  # closed, nothing more sent
    assert MAX_FRAME < 0xFFFFFFFF  # a frame that long is refused before any read


def test_a_stranger_asking_as_nixl_does_gets_no_metadata(pair, key_file):
    """A NIXL agent without the key asks the gate's port for P's metadata, as NIXL's own
    listener would answer; it never gets it, so it can neither read P's staging nor send
    P a message (a forged `hello` under a live D's name needs P's metadata to be sent)."""
    pr = pair(keys=(key_file(secrets.token_hex(32)), None))
    params = _prefilled(pr)
    nixl_agent, nixl_agent_config = _nixl()
    stranger = nixl_agent("stranger", nixl_agent_config(enable_listen_thread=True,
                                                         listen_port=free_port()))
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        try:
            stranger.fetch_remote_metadata(params["peer"], "127.0.0.1", params["port"])
        except Exception:
            pass
        assert not stranger.check_remote_metadata(params["peer"])
        time.sleep(0.1)
    assert not pr.p.worker.transport.agent.check_remote_metadata("stranger")


def test_an_unkeyed_d_cannot_reach_a_keyed_p(pair, key_file):
    pr = pair(keys=(key_file(secrets.token_hex(32)), None), handshake=1.0)
    assert pr.load("r", _prefilled(pr), [20, 21, 22]) == ([], ["r"])


def test_bad_keys_are_refused_by_name(key_file, tmp_path, monkeypatch):
    for keys, match in ((("abc",), "not 32 or more hex digits"),
                        (("zz" * 16,), "not 32 or more hex digits"),
                        ((), "one fleet key, or two"),
                        (("ab" * 16,) * 3, "one fleet key, or two")):
        with pytest.raises(InvalidInputError, match=match):
            TransportConfig("x", fleet_key_file=key_file(*keys))
    with pytest.raises(InvalidInputError, match="cannot be read"):
        TransportConfig("x", fleet_key_file=str(tmp_path / "missing.key"))
    with pytest.raises(InvalidInputError, match="fleet_key_file must be None or a path"):
        TransportConfig("x", fleet_key_file=3)
    monkeypatch.setenv(ENV_KEY, "ab" * 16 + ", " + "cd" * 16)
    assert read_keys(None) == (b"\xab" * 16, b"\xcd" * 16)
    assert TransportConfig("x").fleet_keys == (b"\xab" * 16, b"\xcd" * 16)
    assert "ab" * 16 not in repr(TransportConfig("x"))  # never in a log line
    monkeypatch.delenv(ENV_KEY)
    assert TransportConfig("x").fleet_keys == ()


def test_signed_params_fail_by_name_when_any_signed_field_is_edited_stripped_or_expired():
    from kvxfer.nixl.wire import SIGNED, params_forged, sign_params

    key, other = b"k" * 32, b"o" * 32
    params = {"peer": "P", "instance": "i", "host": "h", "port": 1, "req_id": "r",
              "generation": 1, "secret": "0" * 32, "groups": [{"keys": [0], "slots": [5]}],
              "prompt": "1" * 32, "num_prompt_tokens": 20, "chain": ["ab"],
              "do_remote_prefill": True}
    signed = sign_params(params, key, ttl_s=30.0, now=1000.0)
    assert params_forged(signed, (key,), now=1010.0) is None
    assert params_forged(signed, (other, key), now=1010.0) is None  # either key of a rotation
    assert params_forged(signed, (), now=10**9) is None  # a reader without a key checks nothing
    assert params_forged({**signed, "do_remote_prefill": False}, (key,), now=1010.0) is None
    for field in SIGNED:
        edited = {**signed, field: "edited"}
        assert "does not verify" in params_forged(edited, (key,), now=1010.0), field
    assert "carry no MAC" in params_forged(params, (key,), now=1010.0)
    assert "does not verify" in params_forged(signed, (other,), now=1010.0)
    assert "expired" in params_forged(signed, (key,), now=1031.0)
    assert "does not verify" in params_forged({**signed, "port": float("nan")}, (key,))


def test_a_d_that_dials_a_stranger_gives_it_nothing_it_can_use(pair, key_file):
    """Params may name any address: a D that dials a stranger's fake gate sends it only its
    name, a nonce and a proof bound to the stranger's nonce, never its metadata; the
    stranger cannot answer with a proof of its own, and D fails by name."""
    import threading

    from kvxfer.errors import TransferError
    from kvxfer.nixl.gate import exchange

    path = key_file(secrets.token_hex(32))
    pr = pair(keys=(path, path))
    agent = pr.d.transport.agent
    got = []
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()

        def fake_gate():
            conn, _ = listener.accept()
            with conn:
                body = b'{"v": 2, "nonce": "' + b"ab" * 16 + b'"}'
                conn.sendall(struct.pack(">I", len(body)) + body)
                got.append(_frame(conn))
                body = b'{"name": "P", "metadata": "AAAA", "mac": "' + b"0" * 64 + b'"}'
                conn.sendall(struct.pack(">I", len(body)) + body)

        thread = threading.Thread(target=fake_gate)
        thread.start()
        with pytest.raises(TransferError, match="proves no fleet key"):
            exchange(agent, "D", pr.d.transport.config.fleet_keys, "P", "127.0.0.1",
                     listener.getsockname()[1], 5.0)
        thread.join(5)
    [hello] = got
    assert set(__import__("json").loads(hello)) == {"name", "nonce", "mac"}
    assert agent.get_agent_metadata()[:64] not in hello


def test_a_stranger_trickling_bytes_holds_a_gate_slot_no_longer_than_the_timeout(pair, key_file):
    """Each exchange must end within the handshake timeout of its connection, however slowly
    the peer sends: a connection sending a byte a while is closed on time."""
    pr = pair(keys=(key_file(secrets.token_hex(32)), None), handshake=1.0)
    with socket.create_connection(("127.0.0.1", pr.p.worker.transport.port), timeout=5) as sock:
        _frame(sock)
        closed = False
        try:  # 40 bytes over 4 s or more: four times the gate's timeout
            for _ in range(40):
                sock.sendall(b"\x00")
                time.sleep(0.1)
        except OSError:
            closed = True
        if not closed:  # the gate may have closed after the last send: a read says so
            sock.settimeout(0.5)
            try:
                closed = sock.recv(1) == b""
            except TimeoutError:  # still open
                closed = False
            except OSError:
                closed = True
        assert closed
