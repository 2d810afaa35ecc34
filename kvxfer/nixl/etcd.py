"""etcd, through its v3 JSON gateway: kvxfer's one HTTP client for it, and an agent's NIXL
record there, read back and published again until it holds.

`gateway_post` is every call kvxfer makes to etcd (here and in `kvxfer.nixl.claims`). Each
call ends within one deadline, a monotonic one over connect, TLS, send and every read
(bounding each socket read alone let an etcd that answers one byte a second hold an agent's
start, its `close` and a record read without end), and reads at most `MAX_ANSWER_BYTES`. An
etcd that misses either is an `EtcdError` naming the endpoint and the limit, the same as an
unreachable one. How an HTTP error counts is each caller's choice (`for_good`).

NIXL publishes an agent's metadata to etcd (`send_local_metadata`) from a
thread of its own and only logs a failure, so a P started while etcd is
unreachable would start without error and never be found. `Publication`
reads the record back through etcd's JSON gateway (`POST /v3/kv/range`) on a
thread of its own, which makes no NIXL call, and from the transport's `poll`
publishes again, with backoff, until etcd holds this agent's metadata,
warning meanwhile. Once it holds, it is read back now and then, so a record
etcd lost (restarted without its data) or another agent overwrote (two live
agents under one name) is put back, with a warning.

`Fetcher` reads peers' records the same way and loads them into the agent
(`add_remote_agent`), instead of NIXL's own fetch from etcd: one NIXL fetch
issued while etcd was down left a native thread that the agent's destructor
then waited for, for good (the process hung at exit, after `close`).
"""

from __future__ import annotations

import base64
import functools
import http.client
import io
import json
import logging
import math
import os
import socket
import ssl
import time
import urllib.parse
from collections.abc import Collection
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from kvxfer.errors import InvalidInputError, TransferError

__all__ = ["CALL_DEADLINE_S", "MAX_ANSWER_BYTES", "MAX_FETCHING", "EtcdError", "Fetcher", "Publication",
           "Unreadable", "gateway_post", "read_record", "record_key"]

MAX_FETCHING = 64
"""The most peer records a `Fetcher` reads at once."""

logger = logging.getLogger(__name__)

_FIRST_CHECK_S = 0.25  # NIXL's own first publish lands within milliseconds when etcd is up
_MAX_RETRY_S = 5.0  # republishing backs off from _FIRST_CHECK_S up to this
_RECHECK_S = 30.0  # how often a record that held is read back
_READ_TIMEOUT_S = 2.0

CALL_DEADLINE_S = 2.0
"""Default deadline of one etcd call, all endpoints together (etcd answers in milliseconds)."""
MAX_ANSWER_BYTES = 8 << 20
"""The most an etcd answer may hold: etcd refuses requests over 1.5 MiB by default, so a
record, base64 in JSON, is under 2.1 MiB; 8 MiB leaves room for a raised
`--max-request-bytes` and still bounds what a hostile endpoint can make a process hold."""


class EtcdError(TransferError, OSError):
    """etcd gave no usable answer: unreachable, slower than the call's deadline, an HTTP
    error that asking again may change, an answer over `MAX_ANSWER_BYTES` or no JSON object.
    An `OSError` too: every caller treats it as an etcd that is down."""


class Unreadable(TransferError):
    """etcd answered, but will never give the record here (auth, no JSON gateway)."""


_FOR_GOOD = (400, 401, 403, 404, 405, 501)  # HTTP answers that asking again will not change


def gateway_post(endpoints: str, path: str, body: dict[str, Any], *,
                 deadline_s: float = CALL_DEADLINE_S,
                 for_good: Collection[int] = ()) -> dict[str, Any]:
    """etcd's JSON object for `POST path` with `body`, from the first of `endpoints`
    (comma-separated `http(s)://` URLs) that answers with one.

    The call ends within `deadline_s`: each endpoint in turn gets an even share of what is
    left, so a stalled first one leaves the others time. An HTTP status in `for_good` raises
    `Unreadable` at once; any other error is no answer from that endpoint, and when none
    answers the last one's `EtcdError` is raised. A host name's lookup is not bounded.
    """
    if isinstance(deadline_s, bool) or not isinstance(deadline_s, (int, float)) or not (
            0 < deadline_s < math.inf):
        raise InvalidInputError(f"etcd call deadline_s must be a positive number of seconds, "
                                f"got {deadline_s!r}")
    deadline = time.monotonic() + deadline_s
    urls = endpoints.split(",")
    data = json.dumps(body).encode()
    error = EtcdError(f"no etcd endpoint in {endpoints!r}")
    for i, endpoint in enumerate(urls):
        until = time.monotonic() + (deadline - time.monotonic()) / (len(urls) - i)
        try:
            return _post_once(endpoint.rstrip("/"), path, data, until, deadline_s, for_good)
        except EtcdError as e:
            logger.debug("etcd POST %s: %s", path, e)
            error = e
    raise error


def _post_once(endpoint: str, path: str, data: bytes, until: float, deadline_s: float,
               for_good: Collection[int]) -> dict[str, Any]:
    """One endpoint's answer, before monotonic `until`; see `gateway_post`."""
    url = urllib.parse.urlsplit(endpoint)
    sock = None
    try:
        sock = _connect(url, until)
        connection = http.client.HTTPConnection(url.hostname or "", url.port)
        connection.sock = _Deadline(sock, until)  # type: ignore[assignment]
        connection.request("POST", f"{url.path}{path}", data,
                           {"Content-Type": "application/json", "Connection": "close"})
        answer = connection.getresponse()
        if not 200 <= answer.status < 300:
            if answer.status in for_good:
                raise Unreadable(f"{endpoint} answered HTTP {answer.status} {answer.reason}")
            raise EtcdError(f"{endpoint} answered HTTP {answer.status} {answer.reason}")
        raw = _read_capped(answer, endpoint, path)
    except TimeoutError:
        raise EtcdError(f"etcd at {endpoint} did not answer POST {path} within the call's "
                        f"{deadline_s:g} s deadline") from None
    except (OSError, http.client.HTTPException) as e:
        if isinstance(e, EtcdError):
            raise
        raise EtcdError(f"etcd at {endpoint}, POST {path}: {e}") from None
    finally:
        if sock is not None:
            sock.close()
    try:
        value = json.loads(raw)
    except ValueError as e:
        raise EtcdError(f"etcd at {endpoint} answered POST {path} with no JSON: {e}") from None
    if not isinstance(value, dict):
        raise EtcdError(f"{endpoint}{path} answered {value!r:.80}, not a JSON object")
    logger.debug("etcd %s answered POST %s: %s bytes", endpoint, path, len(raw))
    return value


def _connect(url: urllib.parse.SplitResult, until: float) -> socket.socket:
    """A socket to `url`'s host, TLS for https, connected before monotonic `until`. Straight
    there: an `http_proxy` set for the outside world must not route calls to etcd."""
    secure = url.scheme == "https"
    sock = socket.create_connection((url.hostname, url.port or (443 if secure else 80)),
                                    timeout=_left(until))
    if not secure:
        return sock
    try:
        sock.settimeout(_left(until))
        return _tls().wrap_socket(sock, server_hostname=url.hostname)
    except BaseException:
        sock.close()
        raise


@functools.cache
def _tls() -> ssl.SSLContext:
    return ssl.create_default_context()


def _left(until: float) -> float:
    """Seconds left before monotonic `until`; `TimeoutError` when none."""
    left = until - time.monotonic()
    if left <= 0:
        raise TimeoutError("the call's deadline passed")
    return left


class _Deadline:
    """What `http.client` needs of a socket, each send and receive under one deadline: the
    socket's timeout is set to what is left before every operation. `close` leaves the socket
    to its opener (`http.client` closes its socket while the answer is still being read)."""

    def __init__(self, sock: socket.socket, until: float):
        self.sock, self.until = sock, until

    def sendall(self, data: bytes) -> None:
        self.sock.settimeout(_left(self.until))
        self.sock.sendall(data)

    def makefile(self, mode: str) -> io.BufferedReader:
        return io.BufferedReader(_Receiver(self))

    def close(self) -> None:
        pass


class _Receiver(io.RawIOBase):
    def __init__(self, owner: _Deadline):
        self.owner = owner

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        self.owner.sock.settimeout(_left(self.owner.until))
        return self.owner.sock.recv_into(buffer)


def _read_capped(answer: http.client.HTTPResponse, endpoint: str, path: str) -> bytes:
    """`answer`'s body, refused by size when over `MAX_ANSWER_BYTES`."""
    cap = MAX_ANSWER_BYTES
    body = bytearray()
    while answer.length is None or answer.length <= cap:
        piece = answer.read(cap + 1 - len(body))
        if not piece:
            return bytes(body)
        body += piece
        if len(body) > cap:
            break
    raise EtcdError(f"etcd at {endpoint} answered POST {path} with more than "
                    f"MAX_ANSWER_BYTES {cap} bytes ({cap / 2**20:g} MiB): refused")


def record_key(name: str) -> bytes:
    """NIXL's etcd key for agent `name`'s metadata: `{namespace}/{name}/metadata`, with NIXL's
    namespace (`NIXL_ETCD_NAMESPACE`, default `/nixl/agents/`)."""
    namespace = os.environ.get("NIXL_ETCD_NAMESPACE", "/nixl/agents/")
    return f"{namespace}/{name}/metadata".encode()


def read_record(endpoints: str, key: bytes, timeout: float = _READ_TIMEOUT_S) -> bytes | None:
    """The value under `key` in etcd at `endpoints` (comma-separated URLs), None if absent,
    read within `timeout` seconds in all.

    Raises `Unreadable` when one answers with an error asking again will not change (auth,
    no JSON gateway), else `EtcdError` (an `OSError`) when none answers with the record (a
    5xx counts as none).
    """
    answer = gateway_post(endpoints, "/v3/kv/range", {"key": base64.b64encode(key).decode()},
                          deadline_s=timeout, for_good=_FOR_GOOD)
    kvs = answer.get("kvs") or []
    return base64.b64decode(kvs[0].get("value", "")) if kvs else None


class Publication:
    """Keeps `agent`'s NIXL metadata in etcd under `config.name`; `tick` it from `poll`.

    `held`: whether the last read found this agent's record there. Without
    `config.etcd_endpoints` (a listener answers with the metadata) it does nothing. `config` is the
    agent's `TransportConfig`, not imported here: `agent` imports `claims`, which imports this.
    """

    def __init__(self, agent: Any, config: Any):
        self.agent, self.config = agent, config
        self.held = False
        self._reading: Future | None = None
        self._reader: ThreadPoolExecutor | None = None
        self._next, self._retry_s = math.inf, _FIRST_CHECK_S
        if config.uses_etcd:
            self._key = record_key(config.name)
            self._metadata = agent.get_agent_metadata()
            self._reader = ThreadPoolExecutor(1, thread_name_prefix=f"kvxfer-etcd-{config.name}")
            self._next = time.monotonic() + _FIRST_CHECK_S

    def tick(self, now: float | None = None) -> None:
        """Start a read of the record when one is due; act on one that finished. Never raises."""
        now = time.monotonic() if now is None else now
        if self._reading is None:
            if now >= self._next and self._reader is not None:
                self._reading = self._reader.submit(read_record, self.config.etcd_endpoints,
                                                    self._key)
            return
        if not self._reading.done():
            return
        reading, self._reading = self._reading, None
        try:
            record = reading.result()
        except Unreadable as e:
            logger.warning("%s cannot read its NIXL record back from etcd (%s); it is not "
                           "checked again", self.config.name, e)
            self._next = math.inf
            return
        except Exception as e:  # OSError: unreachable; anything else: the same to us
            why = f"etcd at {self.config.etcd_endpoints} is unreachable: {e}"
        else:
            if record == self._metadata:
                if not self.held:
                    logger.info("%s's NIXL metadata is in etcd", self.config.name)
                self.held, self._retry_s, self._next = True, _FIRST_CHECK_S, now + _RECHECK_S
                return
            why = ("no record under its name" if record is None else
                   "another agent's record under its name (a previous start's, or a live agent "
                   "of the same name)")
        self._republish(why, now)

    def _republish(self, why: str, now: float) -> None:
        self.held = False
        try:
            self.agent.send_local_metadata()
        except Exception as e:
            why = f"{why}; publishing failed: {e}"
        logger.warning("%s's NIXL metadata is not in etcd (%s): published again, next check in "
                       "%.2g s", self.config.name, why, self._retry_s)
        self._next = now + self._retry_s
        self._retry_s = min(2 * self._retry_s, _MAX_RETRY_S)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.shutdown(wait=False, cancel_futures=True)


class Fetcher:
    """Loads peers' NIXL metadata from etcd into `agent`; `tick` it from `poll`.

    `fetch(peer)` starts a read of `peer`'s record on a thread of its own (none if one is
    under way); `tick` loads each record read into the agent, on the caller's thread (the
    one that makes every other NIXL call). A peer with no record yet, or an etcd that is
    down, loads nothing: the caller fetches again, as it would after NIXL's own fetch.
    `config`: the agent's `TransportConfig`.
    """

    def __init__(self, agent: Any, config: Any):
        self.agent, self.config = agent, config
        self._reading: dict[str, Future] = {}
        self._reader = ThreadPoolExecutor(1, thread_name_prefix=f"kvxfer-fetch-{config.name}")

    def fetch(self, peer: str) -> None:
        """Read `peer`'s record in the background (`tick` loads it); at most `MAX_FETCHING`
        at once: more are dropped (a peer asks again), so made-up names queue nothing."""
        if peer not in self._reading and len(self._reading) < MAX_FETCHING:
            self._reading[peer] = self._reader.submit(read_record, self.config.etcd_endpoints,
                                                      record_key(peer))

    def tick(self) -> None:
        """Load the records read since the last call. Never raises."""
        for peer in [p for p, f in self._reading.items() if f.done()]:
            try:
                record = self._reading.pop(peer).result()
                if record:
                    self._load(peer, record)
            except Exception as e:  # unreachable, unreadable, or NIXL refused it: fetch again
                logger.debug("%s fetching %s's NIXL metadata from etcd: %s", self.config.name,
                             peer, e)

    def _load(self, peer: str, record: bytes) -> None:
        """Load `record`; NIXL refuses other metadata under a name it holds (a peer restarted
        under its name), so that is dropped first. The same metadata again loads as it is."""
        try:
            self.agent.add_remote_agent(record)
        except Exception:
            self.agent.remove_remote_agent(peer)
            self.agent.add_remote_agent(record)

    def close(self) -> None:
        self._reader.shutdown(wait=False, cancel_futures=True)
