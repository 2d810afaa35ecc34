"""Claims on an agent's name, so that no two live agents start under one name.

NIXL tells agents apart by name alone. A second agent under a live agent's name (one
`kv_connector_extra_config` template copied to two instances) starts without error, but
its peers keep the first one's metadata (NIXL refuses other metadata under a name it
holds) and answer the first: the second never reads anything, and nothing names why. So
`take` refuses it at start, naming the name and who holds it:

- With a listener, on this host: a lock file per name (`flock`) under
  `KVXFER_AGENT_DIR` (default `<temp dir>/kvxfer-agents-<uid>`). The kernel lets go
  of it when its holder exits, killed or not, so a restart is never refused (a child
  the holder forked holds none of it). Two hosts are not compared: without etcd there
  is nowhere both could look. The folder must be this user's alone, and a lock file
  a plain file: anything else is a `SetupError` naming it (in a shared temp dir
  another user could make the folder first and plant links under the names' files).
- With etcd, across hosts: a key under `/kvxfer/names/`, put only if absent, under an
  etcd lease its holder keeps alive from a thread of its own. A killed holder's key
  lapses within `TTL_S`; a start that finds the name held waits that long for it to
  lapse (a P restarted under its name) before it refuses. An etcd unreachable at
  start is no error (the agent starts, as for its record in `kvxfer.nixl.etcd`): the
  name is then not checked, with a warning; so is one whose answers are not etcd's.

What etcd guarantees: at any time it answers, at most one live holder per name. A holder
that stalls longer than `TTL_S` (a paused VM, a swap storm, a long native call holding the
GIL) loses its lease, and a duplicate started meanwhile is not refused. The holder finds out
at its next renewal, says so in one error line, and takes its name again (a new lease, put
only if absent) if nobody holds it; if another agent does, it leaves it there, says nothing
more, and `lost(name)` names who holds it now. etcd is asked through
`kvxfer.nixl.etcd.gateway_post`: each call ends within `_TIMEOUT_S`, whatever etcd does.
"""

from __future__ import annotations

import base64
import errno
import fcntl
import hashlib
import json
import logging
import os
import socket
import stat
import tempfile
import threading
import time
from typing import Any

from kvxfer.errors import InvalidInputError, SetupError
from kvxfer.nixl.etcd import EtcdError, gateway_post

__all__ = ["TTL_S", "give_back", "lost", "take"]

logger = logging.getLogger(__name__)

TTL_S = 5
"""How long a killed holder's etcd claim outlives it (and a start waits for that)."""
_KEEP_S = 1.0  # how often the holder renews its etcd lease
_TIMEOUT_S = 2.0  # each etcd call's deadline, connect and every read included

_held: dict[str, Any] = {}  # name -> this process's claim (a lock file's fd, or `_EtcdClaim`)
_lock = threading.Lock()


def _refusal(name: str, holder: str, where: str) -> InvalidInputError:
    return InvalidInputError(
        f"NIXL agent name {name!r} is already in use by {holder} ({where}): peers answer "
        f"one agent per name, so a second one could never read or be read; give each "
        f"agent its own name (TransportConfig name, 'name' in kv_connector_extra_config)")


def _holder() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid()}


def take(name: str, etcd_endpoints: str | None, host: str) -> None:
    """Claim `name` for this process's agent, reached at `host`, on this host or (with
    `etcd_endpoints`) in etcd; `InvalidInputError` naming the name and its holder if a
    live agent elsewhere has it."""
    claim = _etcd_claim(name, etcd_endpoints, host) if etcd_endpoints else _lock_file(name)
    with _lock:
        _held[name] = claim


def give_back(name: str) -> None:
    """Let go of `name` (the agent closed, or failed to start). Never raises."""
    with _lock:
        claim = _held.pop(name, None)
    if isinstance(claim, int):
        os.close(claim)  # the lock goes with the descriptor; the file stays, unlocked
    elif claim is not None:
        claim.release()


def lost(name: str) -> str | None:
    """Who holds `name` now, when this process's etcd claim on it lapsed and another agent
    took it meanwhile (it is not taken back: peers answer that one); else None."""
    with _lock:
        claim = _held.get(name)
    return claim.lost if isinstance(claim, _EtcdClaim) else None


def _forget_in_child() -> None:
    """A forked child holds no name: its copies of the lock files' descriptors would keep
    them locked after the parent let go, and the parent's etcd lease is the parent's."""
    global _lock
    _lock = threading.Lock()  # another thread may have held it at the fork
    for claim in _held.values():
        if isinstance(claim, int):
            os.close(claim)  # the parent's descriptor keeps the lock while the parent holds it
    _held.clear()


os.register_at_fork(after_in_child=_forget_in_child)


def _lock_file(name: str) -> int:
    folder = _folder()
    path = os.path.join(folder, hashlib.blake2b(name.encode(), digest_size=16).hexdigest())
    try:  # never through a link: a file of this user's elsewhere would be overwritten
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except OSError as e:
        why = "not a plain file (a link)" if e.errno == errno.ELOOP else e.strerror
        raise SetupError(f"cannot claim NIXL agent name {name!r}: lock {path} in "
                         f"KVXFER_AGENT_DIR {folder!r}: {why}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SetupError(f"cannot claim NIXL agent name {name!r}: lock {path} in "
                             f"KVXFER_AGENT_DIR {folder!r} is not a plain file")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            held = os.pread(fd, 4096, 0).decode(errors="replace")
            try:
                holder = f"process {json.loads(held)['pid']}"
            except (ValueError, KeyError, TypeError):
                holder = "another process"
            raise _refusal(name, holder, f"on this host, lock {path}") from None
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps({**_holder(), "name": name}).encode(), 0)
        except OSError as e:
            raise SetupError(f"cannot claim NIXL agent name {name!r}: writing lock {path}: "
                             f"{e.strerror}") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def _folder() -> str:
    """`KVXFER_AGENT_DIR`, made if missing: a folder of this user's that nobody else may
    write to (the default is under the shared temp dir, where another user could make it
    first and plant links under the names' lock files)."""
    folder = os.environ.get("KVXFER_AGENT_DIR") or os.path.join(
        tempfile.gettempdir(), f"kvxfer-agents-{os.getuid()}")
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
        info = os.stat(folder)
    except OSError as e:
        raise SetupError(f"KVXFER_AGENT_DIR {folder!r}, where agents claim their names, "
                         f"cannot be made or read: {e.strerror}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise SetupError(f"KVXFER_AGENT_DIR {folder!r}, where agents claim their names, is "
                         f"not a folder")
    if info.st_uid != os.geteuid() or info.st_mode & 0o022:
        raise SetupError(f"KVXFER_AGENT_DIR {folder!r}, where agents claim their names, is "
                         f"not this user's alone (owner uid {info.st_uid}, mode "
                         f"{stat.S_IMODE(info.st_mode):o}): others may write to it; remove "
                         f"it or point KVXFER_AGENT_DIR at a folder of this user's")
    return folder


def _post(endpoints: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """etcd's JSON object from the first of `endpoints` that answers, within `_TIMEOUT_S`;
    `OSError` (an `EtcdError`) if none. Every HTTP error counts as no answer from that
    endpoint: a name that cannot be claimed, for whatever reason, is left unchecked with a
    warning, and the agent starts."""
    return gateway_post(endpoints, path, body, deadline_s=_TIMEOUT_S)


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


def _key(name: str) -> bytes:
    return f"/kvxfer/names/{name}".encode()


def _grant(endpoints: str) -> str:
    """A new lease of `TTL_S`; `EtcdError` (an `OSError`) if etcd grants none."""
    lease = _post(endpoints, "/v3/lease/grant", {"TTL": TTL_S}).get("ID")
    if not (isinstance(lease, str) and lease.isdecimal() or type(lease) is int):
        raise EtcdError(f"etcd at {endpoints} granted lease {lease!r:.80}, not an int64")
    return lease


def _put_if_absent(endpoints: str, key: bytes, value: bytes, lease: str) -> dict[str, Any]:
    """etcd's answer to putting `value` under `key` and `lease` unless `key` exists; its
    holder's record is in the answer when it does."""
    txn = {"compare": [{"key": _b64(key), "target": "CREATE", "create_revision": "0"}],
           "success": [{"request_put": {"key": _b64(key), "value": _b64(value),
                                        "lease": lease}}],
           "failure": [{"request_range": {"key": _b64(key)}}]}
    return _post(endpoints, "/v3/kv/txn", txn)


def _holder_in(answer: dict[str, Any]) -> str:
    """Who holds the name, from a put-if-absent's answer that found it held."""
    try:
        kvs = answer["responses"][0]["response_range"]["kvs"]
        held = json.loads(base64.b64decode(kvs[0]["value"]))
        return f"process {held['pid']} on host {held['host']} ({held['address']})"
    except (LookupError, ValueError, TypeError):
        return "another agent"


def _etcd_claim(name: str, endpoints: str, host: str) -> _EtcdClaim | None:
    mine = json.dumps({**_holder(), "address": host}).encode()
    try:
        lease = _grant(endpoints)
    except OSError as e:
        logger.warning("%s cannot claim its name in etcd at %s (%s): a second agent under "
                       "it is not refused", name, endpoints, e)
        return None
    give_up = time.monotonic() + TTL_S + 1.0  # a killed holder's claim lapses by then
    while True:
        try:
            answer = _put_if_absent(endpoints, _key(name), mine, lease)
        except OSError as e:
            logger.warning("%s cannot claim its name in etcd (%s): not checked", name, e)
            return None
        if answer.get("succeeded") is True:
            return _EtcdClaim(name, endpoints, lease, mine)
        if not isinstance(answer.get("header"), dict):  # etcd's own answers all have one
            logger.warning("%s cannot claim its name in etcd: it answered %r: not checked",
                           name, f"{answer!r:.80}")
            _revoke(endpoints, lease)
            return None
        if time.monotonic() > give_up:
            break
        time.sleep(0.25)
    _revoke(endpoints, lease)
    raise _refusal(name, _holder_in(answer), f"claimed in etcd at {endpoints}")


def _revoke(endpoints: str, lease: str) -> None:
    try:
        _post(endpoints, "/v3/lease/revoke", {"ID": lease})
    except OSError as e:
        logger.debug("revoking etcd lease %s: %s", lease, e)


def _renewed(result: Any) -> bool:
    """Whether a keepalive's `result` renewed the lease; False when etcd says it is gone
    (its own answer, header and all, with TTL 0 or none); `ValueError` or `TypeError` when
    it is no answer of etcd's."""
    if not isinstance(result, dict):
        raise TypeError(f"etcd answered a keepalive with {result!r:.80}")
    try:
        if int(result.get("TTL", 0)) > 0:
            return True
    except OverflowError:  # JSON's 1e999 is a float inf: no TTL of etcd's
        raise ValueError(f"etcd answered a keepalive with {result!r:.80}") from None
    if not isinstance(result.get("header"), dict):
        raise ValueError(f"etcd answered a keepalive with {result!r:.80}")
    return False


class _EtcdClaim:
    """A name held in etcd: its lease renewed every `_KEEP_S` until `release`, and taken
    again if it lapsed while nobody else took the name (`lost` says who did)."""

    def __init__(self, name: str, endpoints: str, lease: str, mine: bytes):
        self.name, self.endpoints, self.lease, self.mine = name, endpoints, lease, mine
        self.lost: str | None = None  # who holds the name now, once another agent took it
        self._lapsed = False  # the lease is gone and the name not yet taken again
        self._released = False
        self._mutex = threading.Lock()  # `lease` and `_released`, between keeper and release
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._keep, daemon=True,
                                        name=f"kvxfer-claim-{name}")
        self._thread.start()

    def _keep(self) -> None:
        warned = False
        while self.lost is None and not self._stop.wait(_KEEP_S):
            if self._lapsed:  # etcd did not answer the last try to take the name again
                self._take_again(quiet=True)
                continue
            try:
                kept = _renewed(_post(self.endpoints, "/v3/lease/keepalive", {"ID": self.lease}
                                      ).get("result"))
            except (OSError, ValueError, TypeError) as e:
                if not warned:
                    logger.warning("%s cannot renew its name's etcd lease (%s): if this lasts "
                                   "%s s the name lapses, and another agent may start under "
                                   "it", self.name, e, TTL_S)
                warned = True
                continue
            warned = False
            if not kept:
                self._take_again(quiet=False)

    def _take_again(self, quiet: bool) -> None:
        """The lease is gone (this process stalled past `TTL_S`, or etcd lost it): take the
        name under a new one if nobody holds it, else record who does. The first try says
        which in one error line; a later one (etcd did not answer the first) a warning."""
        lease = None
        try:
            lease = _grant(self.endpoints)
            answer = _put_if_absent(self.endpoints, _key(self.name), self.mine, lease)
        except OSError as e:
            answer, why = {}, f"etcd did not answer ({e})"
        else:
            why = f"etcd answered {answer!r:.80}"
        if answer.get("succeeded") is True:
            with self._mutex:
                mine, self._lapsed = not self._released, False
                if mine:
                    self.lease = lease
            if not mine:  # released meanwhile: the new lease is nobody's
                _revoke(self.endpoints, lease)
            outcome = f"it holds its name again, under lease {lease}"
        else:
            if lease is not None:
                _revoke(self.endpoints, lease)
            if isinstance(answer.get("header"), dict):  # etcd's own: someone else holds it
                self.lost, self._lapsed = _holder_in(answer), False
                outcome = (f"{self.lost} holds it now: this agent no longer holds its name "
                           f"(peers answer that one) and does not take it back")
            else:
                self._lapsed = True
                outcome = f"it could not take its name again yet ({why}): trying again"
        if not quiet:
            logger.error("%s's claim on its name in etcd at %s lapsed (the lease was gone at "
                         "renewal: this process stalled over %s s, or etcd lost it); %s",
                         self.name, self.endpoints, TTL_S, outcome)
        elif not self._lapsed:
            logger.warning("%s, whose name's etcd lease lapsed: %s", self.name, outcome)

    def release(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2 * _TIMEOUT_S)
        with self._mutex:
            self._released, lease = True, self.lease
        if self.lost is None:  # a lost name's key is the other holder's, under its lease
            _revoke(self.endpoints, lease)
