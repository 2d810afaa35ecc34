"""The fleet key's gate: an agent's NIXL metadata goes only to peers that prove they hold a
fleet key, and a peer's metadata is loaded only after the same proof.

NIXL's metadata is what lets an agent READ another's registered memory: with it, any
agent can read every staging slot (every request's KV, and every tenant's pooled KV) one-sided,
without a message P ever sees. NIXL's own listener hands it to whoever asks. With a fleet key
(`TransportConfig.fleet_key_file`, or `KVXFER_FLEET_KEY`) no NIXL listener runs: `Gate` listens
on the agent's port instead, and `Exchanges` (D's handshakes) connects to it from threads of its
own, so no engine step waits.

One exchange, over one TCP connection, each frame a 4-byte big-endian length and JSON:

1. gate -> peer: `{"v": 2, "nonce": Ng}`, 16 fresh random bytes in hex.
2. peer -> gate: `{"name", "nonce": Np, "mac"}`: its agent name, its nonce and
   `HMAC-SHA256(key, "hello", Ng, Np, name)`. No metadata yet: a peer that dialled a
   stranger (params may name any address) gives it nothing it can use.
3. The gate checks the MAC under each of its keys (two while a key is rotated). Unless one
   verifies, it closes the connection having sent nothing more. Else it answers
   `{"name", "metadata", "mac"}`: its metadata encrypted under a key of this exchange
   alone (`HMAC-SHA256(key, "session", Ng, Np)`, used as a keystream in counter mode), and
   a MAC over "answer", Np, Ng, its name and the ciphertext.
4. The peer checks that MAC, decrypts and loads the gate's metadata, and sends its own
   the same way (`{"metadata", "mac"}`, the MAC over "metadata", Ng, Np, its name and the
   ciphertext); the gate checks, decrypts and loads it (in place of any it held under that
   name: only a key holder replaces it).

Both nonces are fresh, so a recorded exchange replays to nothing; the MACs bind each side's
name and metadata, so neither can be swapped in transit; and the metadata crosses the
wire encrypted, so neither a listener on the network nor a relay between two key holders
learns it. The key proves fleet membership, not identity: any holder can pose as any
agent name, so a key is given only to the fleet's own instances. Each exchange must end
within `timeout_s` of its connection, however slowly a peer sends.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any

from kvxfer.errors import InvalidInputError, TransferError

__all__ = ["ENV_KEY", "MAX_FRAME", "Exchanges", "Gate", "exchange", "read_keys"]

logger = logging.getLogger(__name__)

ENV_KEY = "KVXFER_FLEET_KEY"
"""The environment variable a fleet key may come from (comma-separated for two)."""
MAX_FRAME = 16 << 20
"""The largest frame either side reads: NIXL metadata of a large staging is a few MB at most."""
MAX_CONNECTIONS = 32
"""Exchanges a gate runs at once, and a side starts at once: connections beyond are closed
at once, exchanges beyond fail at once (a flood, or params naming made-up peers, is bounded)."""
_REMEMBERED = 4096  # exchanges whose outcome a side keeps (the oldest finished go first)
_MAX_HELLO = 4096  # the most a hello frame (name, nonce, MAC) may be, in bytes
_VERSION = 2


def read_keys(path: str | None) -> tuple[bytes, ...]:
    """The fleet keys: from the file at `path` (one per line, hex, 32 digits or more; `#`
    comments and blank lines skipped), else from `KVXFER_FLEET_KEY` (comma-separated), else
    none. Two while a key is rotated: an agent accepts either and proves with the first.
    `InvalidInputError` names a file that cannot be read or a key that is not one."""
    if path is not None:
        try:
            with open(path) as f:
                text = f.read()
        except OSError as e:
            raise InvalidInputError(f"fleet_key_file {path!r} cannot be read: "
                                    f"{e.strerror or e}") from None
        raw = [line.split("#", 1)[0].strip() for line in text.splitlines()]
        where = f"fleet_key_file {path!r}"
    elif os.environ.get(ENV_KEY):
        raw, where = [k.strip() for k in os.environ[ENV_KEY].split(",")], ENV_KEY
    else:
        return ()
    keys = []
    for k in filter(None, raw):
        try:
            key = bytes.fromhex(k)
        except ValueError:
            key = b""
        if len(key) < 16:
            raise InvalidInputError(f"{where} holds a key that is not 32 or more hex digits "
                                    f"(128 bits): {len(k)} characters; make one with "
                                    f"`python -c 'import secrets; print(secrets.token_hex(32))'`")
        keys.append(key)
    if not 1 <= len(keys) <= 2:
        raise InvalidInputError(f"{where} must hold one fleet key, or two while rotating, "
                                f"got {len(keys)}")
    return tuple(keys)


def _mac(key: bytes, label: str, *parts: bytes) -> str:
    h = hmac.new(key, label.encode(), hashlib.sha256)
    for part in parts:
        h.update(struct.pack(">I", len(part)) + part)
    return h.hexdigest()


def _crypt(session: bytes, label: bytes, data: bytes) -> bytes:
    """`data` XOR a keystream of HMAC-SHA256(session, label, counter) blocks: encryption and
    decryption alike (a PRF in counter mode; each session key and label is used once)."""
    stream = b"".join(hmac.new(session, label + struct.pack(">Q", i), hashlib.sha256).digest()
                      for i in range(-(-len(data) // 32)))
    return (int.from_bytes(data, "big") ^ int.from_bytes(stream[:len(data)], "big")
            ).to_bytes(len(data), "big") if data else b""


def _session(key: bytes, gate_nonce: str, peer_nonce: str) -> bytes:
    return hmac.new(key, b"session" + gate_nonce.encode() + b"\0" + peer_nonce.encode(),
                    hashlib.sha256).digest()


def _verifies(keys: Sequence[bytes], mac: object, label: str, *parts: bytes) -> bytes | None:
    """The key under which `mac` verifies, or None."""
    if not isinstance(mac, str):
        return None
    return next((k for k in keys if hmac.compare_digest(_mac(k, label, *parts), mac)), None)


def _send(sock: socket.socket, msg: dict[str, Any]) -> None:
    body = json.dumps(msg).encode()
    sock.sendall(struct.pack(">I", len(body)) + body)


def _recv_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    out = bytearray()
    while len(out) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TransferError("the exchange ran past its time")
        sock.settimeout(left)
        chunk = sock.recv(min(n - len(out), 1 << 20))
        if not chunk:
            raise TransferError("the peer closed the connection")
        out += chunk
    return bytes(out)


def _recv(sock: socket.socket, deadline: float, limit: int = MAX_FRAME) -> dict[str, Any]:
    (n,) = struct.unpack(">I", _recv_exact(sock, 4, deadline))
    if n > limit:
        raise TransferError(f"a frame of {n} bytes, over {limit}")
    try:
        msg = json.loads(_recv_exact(sock, n, deadline))
    except ValueError:
        raise TransferError("a frame that is not JSON") from None
    if not isinstance(msg, dict):
        raise TransferError("a frame that is not a JSON object")
    return msg


def _field(msg: dict[str, Any], key: str) -> str:
    value = msg.get(key)
    if not isinstance(value, str) or not value or len(value) > MAX_FRAME:
        raise TransferError(f"field {key!r} missing or not a string")
    return value


def _ciphertext(msg: dict[str, Any]) -> bytes:
    try:
        return base64.b64decode(_field(msg, "metadata"), validate=True)
    except ValueError:
        raise TransferError("field 'metadata' is not base64") from None


def _sealed(session: bytes, label: bytes, metadata: bytes) -> tuple[bytes, str]:
    """`metadata` encrypted for this exchange, and its base64 for a frame."""
    sealed = _crypt(session, label, metadata)
    return sealed, base64.b64encode(sealed).decode()


def _load(agent: Any, name: str, metadata: bytes) -> None:
    """Load `name`'s metadata into `agent`, in place of any held under the name (NIXL keeps
    the first it loads under a name and refuses another: a peer started again)."""
    if agent.check_remote_metadata(name):
        agent.remove_remote_agent(name)
    loaded = agent.add_remote_agent(metadata)
    loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
    if loaded != name:
        agent.remove_remote_agent(loaded)
        raise TransferError(f"the metadata is agent {loaded!r}'s, the peer said {name!r}")


class Gate:
    """Listens on `host:port` (0: a free port, `port` after) for peers of `agent` (named
    `name`), and runs the exchange with each on a thread of its own, at most
    `MAX_CONNECTIONS` at once, each within `timeout_s`. `close` stops it."""

    def __init__(self, agent: Any, name: str, keys: Sequence[bytes], host: str, port: int,
                 timeout_s: float):
        if not keys:
            raise InvalidInputError("a gate needs a fleet key")
        self.agent, self.name, self.keys, self.timeout_s = agent, name, tuple(keys), timeout_s
        self._sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._sock.bind((host, port))
        except OSError as e:
            self._sock.close()
            raise InvalidInputError(f"agent {name!r} cannot listen on {host}:{port}: "
                                    f"{e.strerror or e}") from None
        self._sock.listen(64)
        self.port = int(self._sock.getsockname()[1])
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._closed = threading.Event()
        self.refused = 0  # exchanges that did not prove a key (or failed otherwise)
        self._quiet_until = 0.0
        self._thread = threading.Thread(target=self._accept, name=f"kvxfer-gate-{name}",
                                        daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, addr = self._sock.accept()
            except OSError:
                if self._closed.is_set():
                    return
                time.sleep(0.01)  # out of descriptors, a connection aborted: the gate goes on
                continue
            if not self._slots.acquire(blocking=False):
                conn.close()
                self.refused += 1
                continue
            try:
                threading.Thread(target=self._serve, args=(conn, addr), daemon=True).start()
            except RuntimeError:  # no thread to be had: this peer is refused, the gate goes on
                conn.close()
                self._slots.release()

    def _serve(self, conn: socket.socket, addr: Any) -> None:
        deadline = time.monotonic() + self.timeout_s  # the whole exchange, however slow a peer
        try:
            with conn:
                ours = secrets.token_hex(16)
                conn.settimeout(self.timeout_s)
                _send(conn, {"v": _VERSION, "nonce": ours})
                msg = _recv(conn, deadline, _MAX_HELLO)
                name, theirs = _field(msg, "name"), _field(msg, "nonce")
                key = _verifies(self.keys, msg.get("mac"), "hello", ours.encode(),
                                theirs.encode(), name.encode())
                if key is None:
                    raise TransferError("it proved no fleet key")
                session = _session(key, ours, theirs)
                sealed, text = _sealed(session, b"gate", self.agent.get_agent_metadata())
                _send(conn, {"name": self.name, "metadata": text,
                             "mac": _mac(key, "answer", theirs.encode(), ours.encode(),
                                         self.name.encode(), sealed)})
                msg = _recv(conn, deadline)
                sealed = _ciphertext(msg)
                if _verifies((key,), msg.get("mac"), "metadata", ours.encode(), theirs.encode(),
                             name.encode(), sealed) is None:
                    raise TransferError("its metadata is not under the key it proved")
                _load(self.agent, name, _crypt(session, b"peer", sealed))
        except Exception as e:  # a stranger, a wrong key, a dropped connection: refused
            self.refused += 1
            now = time.monotonic()
            if now >= self._quiet_until:  # a flood of strangers logs once a minute
                self._quiet_until = now + 60.0
                logger.warning("agent %s refused a peer at %s (%d refused so far): %s",
                               self.name, addr, self.refused, e)
        finally:
            self._slots.release()

    def close(self) -> None:
        self._closed.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._thread.join(timeout=5)


def exchange(agent: Any, name: str, keys: Sequence[bytes], peer: str, host: str, port: int,
             timeout_s: float) -> None:
    """Run the exchange with the gate of agent `peer` at `host:port`, as agent `name`: on
    return `agent` holds `peer`'s metadata and `peer` holds ours. `TransferError` says why
    not (nothing listens, the gate refused or closed, its proof or its name is not the
    expected one, `timeout_s` passed)."""
    deadline = time.monotonic() + timeout_s
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            hello = _recv(sock, deadline, _MAX_HELLO)
            if hello.get("v") != _VERSION:
                raise TransferError(f"it speaks gate version {hello.get('v')!r:.20}, this "
                                    f"side {_VERSION}")
            theirs, ours = _field(hello, "nonce"), secrets.token_hex(16)
            _send(sock, {"name": name, "nonce": ours,
                         "mac": _mac(keys[0], "hello", theirs.encode(), ours.encode(),
                                     name.encode())})
            try:
                answer = _recv(sock, deadline)
            except TransferError:
                raise TransferError("its gate closed the connection: it holds none of this "
                                    "side's fleet keys (or is no kvxfer gate)") from None
            got, sealed = _field(answer, "name"), _ciphertext(answer)
            if _verifies((keys[0],), answer.get("mac"), "answer", ours.encode(),
                         theirs.encode(), got.encode(), sealed) is None:
                raise TransferError("its answer proves no fleet key this side holds")
            if got != peer:
                raise TransferError(f"the agent there is {got!r}")
            session = _session(keys[0], theirs, ours)
            _load(agent, peer, _crypt(session, b"gate", sealed))
            mine, text = _sealed(session, b"peer", agent.get_agent_metadata())
            _send(sock, {"metadata": text, "mac": _mac(keys[0], "metadata", theirs.encode(),
                                                       ours.encode(), name.encode(), mine)})
    except OSError as e:
        raise TransferError(f"no gate answers: {e.strerror or e}") from None


class Exchanges:
    """D's exchanges with P gates, each on a thread of its own: `start` one, `status` says
    how it went (None while under way or never started, True done, else the error)."""

    def __init__(self, agent: Any, name: str, keys: Sequence[bytes], timeout_s: float):
        self.agent, self.name, self.keys, self.timeout_s = agent, name, tuple(keys), timeout_s
        self._lock = threading.Lock()
        self._state: dict[str, Any] = {}  # peer -> None (running), True, or TransferError

    def start(self, peer: str, host: str, port: int) -> None:
        """Begin an exchange with `peer` unless one is under way."""
        with self._lock:
            if peer in self._state and self._state[peer] is None:
                return
            self._state.pop(peer, None)
            if sum(s is None for s in self._state.values()) >= MAX_CONNECTIONS:
                self._state[peer] = TransferError(f"{MAX_CONNECTIONS} exchanges are under way")
                return
            self._state[peer] = None  # newest last
            for old in [p for p, s in self._state.items() if s is not None]:
                if len(self._state) <= _REMEMBERED:
                    break
                del self._state[old]
        threading.Thread(target=self._run, args=(peer, host, port), daemon=True,
                         name=f"kvxfer-exchange-{peer}").start()

    def _run(self, peer: str, host: str, port: int) -> None:
        try:
            exchange(self.agent, self.name, self.keys, peer, host, port, self.timeout_s)
            result: Any = True
        except Exception as e:
            result = e if isinstance(e, TransferError) else TransferError(repr(e))
        with self._lock:
            self._state[peer] = result

    def status(self, peer: str) -> Any:
        with self._lock:
            return self._state.get(peer)
