"""An agent's NIXL record in etcd: reading it back, and publishing it again until it holds.

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
import json
import logging
import math
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvxfer.nixl.agent import TransportConfig

__all__ = ["Fetcher", "Publication", "read_record", "record_key"]

logger = logging.getLogger(__name__)

_FIRST_CHECK_S = 0.25  # NIXL's own first publish lands within milliseconds when etcd is up
_MAX_RETRY_S = 5.0  # republishing backs off from _FIRST_CHECK_S up to this
_RECHECK_S = 30.0  # how often a record that held is read back
_READ_TIMEOUT_S = 2.0


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
"""Straight to etcd: an `http_proxy` set for the outside world must not route these reads."""


class Unreadable(Exception):
    """etcd answered, but will never give the record here (auth, no JSON gateway)."""


_FOR_GOOD = (400, 401, 403, 404, 405, 501)  # HTTP answers that asking again will not change


def record_key(name: str) -> bytes:
    """NIXL's etcd key for agent `name`'s metadata: `{namespace}/{name}/metadata`, with NIXL's
    namespace (`NIXL_ETCD_NAMESPACE`, default `/nixl/agents/`)."""
    namespace = os.environ.get("NIXL_ETCD_NAMESPACE", "/nixl/agents/")
    return f"{namespace}/{name}/metadata".encode()


def read_record(endpoints: str, key: bytes, timeout: float = _READ_TIMEOUT_S) -> bytes | None:
    """The value under `key` in etcd at `endpoints` (comma-separated URLs), None if absent.

    Raises `Unreadable` when one answers with an error asking again will not change (auth,
    no JSON gateway), else `OSError` when none answers with the record (a 5xx counts as none).
    """
    body = json.dumps({"key": base64.b64encode(key).decode()}).encode()
    error: OSError = OSError(f"no etcd endpoint in {endpoints!r}")
    for endpoint in endpoints.split(","):
        request = urllib.request.Request(f"{endpoint.rstrip('/')}/v3/kv/range", body,
                                         {"Content-Type": "application/json"})
        try:
            with _DIRECT.open(request, timeout=timeout) as answer:
                kvs = json.loads(answer.read()).get("kvs") or []
        except urllib.error.HTTPError as e:
            if e.code in _FOR_GOOD:
                raise Unreadable(f"{endpoint} answered HTTP {e.code} {e.reason}") from None
            error = OSError(f"{endpoint} answered HTTP {e.code} {e.reason}")  # 5xx: starting up
            continue
        except (OSError, ValueError) as e:  # URLError is an OSError; ValueError: not JSON
            error = e if isinstance(e, OSError) else OSError(f"{endpoint}: {e}")
            continue
        return base64.b64decode(kvs[0].get("value", "")) if kvs else None
    raise error


class Publication:
    """Keeps `agent`'s NIXL metadata in etcd under `config.name`; `tick` it from `poll`.

    `held`: whether the last read found this agent's record there. Without
    `config.etcd_endpoints` (a listener serves the metadata) it does nothing.
    """

    def __init__(self, agent: Any, config: TransportConfig):
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
    """

    def __init__(self, agent: Any, config: TransportConfig):
        self.agent, self.config = agent, config
        self._reading: dict[str, Future] = {}
        self._reader = ThreadPoolExecutor(1, thread_name_prefix=f"kvxfer-fetch-{config.name}")

    def fetch(self, peer: str) -> None:
        if peer not in self._reading:
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
