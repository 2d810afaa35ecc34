"""A NIXL agent's life cycle: the one NIXL import, `TransportConfig`, creation and close.

One agent per process, UCX backend, registering every group's staging
regions once. Names are unique among a process's live agents (NIXL tells
peers apart by them). Agents run in NIXL's thread-safe mode (D posts READs
from a thread of its own), and their progress thread waits for events
instead of spinning (`TransportConfig.progress_wake_us`).
"""


from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import os
import secrets
import socket
import sys
import threading
import urllib.parse
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvxfer.errors import InvalidInputError, TransferError
from kvxfer.nixl import claims
from kvxfer.nixl.gate import Gate, read_keys
from kvxfer.nixl.wire import encode_message
from kvxfer.plan.blocks import is_int

if TYPE_CHECKING:
    from kvxfer.device.staging import Staging

__all__ = ["CUDA_TLS", "HOST_TLS", "MAX_WAIT_S", "MIN_LEASE_S", "MIN_TIMEOUT_S", "TransportConfig",
           "choose_ucx_tls", "claim_name", "close_agent", "close_transport", "default_name", "forget_me",
           "free_port", "gated", "release_name", "send", "start_agent", "ucx_sees_cuda"]

logger = logging.getLogger(__name__)


_MAX_BIND_TRIES = 8


MIN_LEASE_S = 1.0
MIN_TIMEOUT_S = 0.1
"""The least `handshake_timeout_s` and `transfer_timeout_s`: below it no handshake or read
completes even on one machine (a READ's post and ack alone take milliseconds)."""
MAX_WAIT_S = 24 * 3600.0
"""The most any timeout, lease or heartbeat interval may be: a lease longer than a day holds
a dead D's staging for good, and a timeout as long never fires."""
"""The shortest `TransportConfig.lease_s` (see there)."""


@dataclass(frozen=True)
class TransportConfig:
    """Everything the transport reads, in one place.

    - `name`: this agent's name; P's name is what D connects to (params name
      it). None (the default) draws `default_name()`: host name, process id
      and random hex, so agents left at the default never share a name, in
      etcd neither. A name a live agent holds is refused at start-up, naming
      the name and its holder: in this process; with a listener, on this
      host; with etcd, anywhere that etcd reaches (`kvxfer.nixl.claims`). A
      killed agent's name is free again at once on a host, and within
      `claims.TTL_S` in etcd (a start waits that long before refusing).
    - `host`: the address this agent is reached at (advertised by P in params).
    - `listen_port`: NIXL metadata listener port; 0 picks a free one.
    - `handshake_timeout_s`: deadline of `connect`.
    - `transfer_timeout_s`: deadline of one read, from `start_read` to P's ack.
    - `lease_s`: how long P holds a request's blocks without news from D; at
      least 1 s (`MIN_LEASE_S`) and twice `heartbeat_interval_s`. A lease must
      outlast a gap between two of D's polls (an engine step, a GC pause) plus
      a heartbeat's trip to P; below a second an ordinary step lets it lapse
      while D still reads. Two heartbeats per lease let one arrive late.
    - `heartbeat_interval_s`: how often D extends leases of requests it still wants.
    - `stream_wait_s`: the longest D follows a P that says a stream is still coming
      (`wait`) without naming a chunk of it: from subscribing, or from the last chunk.
      Past it D fails the request by name and tells P to drop it. The default, 600 s,
      is `kvxfer proxy`'s `--prefill-timeout`: a request queued on P that long is given
      up by the proxy too.
    - `ucx_tls`: `UCX_TLS` for this agent's UCX context (set only while the agent
      is created). `"auto"` (the default) picks `cma,tcp,self`, which reads host
      memory faster between processes on one machine than UCX's own choice,
      plus `cuda_copy` where UCX sees CUDA (it will not start without it there),
      and falls back to UCX's own choice if UCX cannot make that; one log line
      says what was chosen (`choose_ucx_tls`). None keeps UCX's own choice; any
      other value is used as given.
    - `num_threads`: UCX backend worker threads (0: NIXL's default).
    - `progress_wake_us`: the timeout, in microseconds, of the `poll()` in which
      NIXL's UCX progress thread waits for events (it wakes at once when one
      arrives; the timeout only bounds a missed wake-up; NIXL rounds it up to
      whole milliseconds). NIXL's Python API passes 0, and then the thread
      spins, holding a whole core while idle. 0 keeps NIXL's spinning thread.
    - `fleet_key_file`: a file holding the fleet key (hex, 32 digits or more; two lines
      while a key is rotated); None reads `KVXFER_FLEET_KEY` instead, and where neither is
      set there is no key. With a key, no NIXL listener runs: the agent's metadata goes only
      to peers that prove they hold the key, and theirs is loaded only after the same proof
      (`kvxfer.nixl.gate`). Without one, NIXL's listener hands the metadata, and with it a
      READ of every staging slot, to any agent that asks (one warning at start says so).
    - `etcd_endpoints`: NIXL's central metadata service (`NIXL_ETCD_ENDPOINTS`,
      for example `http://10.0.0.2:2379`). Every agent publishes its metadata
      there under its name and fetches its peers' by name, so many P and D
      agents need no pairwise listener handshake; no listener is started
      (`listen_port` is unused, params still carry `host`). None: D fetches
      from P's listener at `host:listen_port`, as between two processes.
      A deployment starts P, D and etcd in any order, so an etcd unreachable
      at start-up is no error: the agent starts, warns, and publishes again
      from `poll` until etcd holds its record (`kvxfer.nixl.etcd`); an
      endpoint that is not an `http(s)://host[:port]` URL is refused here.
    """

    name: str | None = None
    host: str = "127.0.0.1"
    listen_port: int = 0
    handshake_timeout_s: float = 10.0
    transfer_timeout_s: float = 10.0
    lease_s: float = 30.0
    heartbeat_interval_s: float = 5.0
    stream_wait_s: float = 600.0
    ucx_tls: str | None = "auto"
    num_threads: int = 0
    progress_wake_us: int = 1000
    etcd_endpoints: str | None = None
    fleet_key_file: str | None = None
    fleet_keys: tuple[bytes, ...] = field(init=False, repr=False, compare=False, default=())

    def __post_init__(self) -> None:
        if self.name is None:
            object.__setattr__(self, "name", default_name())
        if not isinstance(self.name, str) or not self.name or not self.name.isprintable():
            raise InvalidInputError(f"TransportConfig name must be a non-empty printable str, "
                                    f"got {self.name!r}")
        if not isinstance(self.host, str) or not self.host:
            raise InvalidInputError(f"TransportConfig host must be a non-empty str, got {self.host!r}")
        if not is_int(self.listen_port) or not 0 <= self.listen_port <= 65535:
            raise InvalidInputError(
                f"TransportConfig listen_port must be an int in [0, 65535], got {self.listen_port!r}")
        for name in ("handshake_timeout_s", "transfer_timeout_s", "lease_s", "heartbeat_interval_s",
                     "stream_wait_s"):
            value = getattr(self, name)
            if (not isinstance(value, (int, float)) or isinstance(value, bool)
                    or not math.isfinite(value) or value <= 0):
                raise InvalidInputError(
                    f"TransportConfig {name} must be a positive finite number of seconds, "
                    f"got {value!r}")
        for name in ("handshake_timeout_s", "transfer_timeout_s", "lease_s", "heartbeat_interval_s",
                     "stream_wait_s"):
            if getattr(self, name) > MAX_WAIT_S:
                raise InvalidInputError(
                    f"TransportConfig {name} {getattr(self, name)!r} is over {MAX_WAIT_S:.0f} s "
                    f"(a day): nothing would ever time out or lapse; give at most {MAX_WAIT_S:.0f}")
        for name in ("handshake_timeout_s", "transfer_timeout_s", "stream_wait_s"):
            if getattr(self, name) < MIN_TIMEOUT_S:
                raise InvalidInputError(
                    f"TransportConfig {name} {getattr(self, name)!r} is below {MIN_TIMEOUT_S} s: "
                    f"every handshake or read would fail; give {name} >= {MIN_TIMEOUT_S}")
        workable = max(MIN_LEASE_S, 2 * self.heartbeat_interval_s)
        if self.lease_s < MIN_LEASE_S:
            raise InvalidInputError(
                f"TransportConfig lease_s {self.lease_s!r} is below {MIN_LEASE_S} s: every lease "
                f"would lapse between two of D's polls; give lease_s >= {workable} s")
        if 2 * self.heartbeat_interval_s > self.lease_s:
            raise InvalidInputError(
                f"TransportConfig heartbeat_interval_s {self.heartbeat_interval_s} must be at most "
                f"half of lease_s {self.lease_s}, or one late heartbeat lets a lease lapse; give "
                f"heartbeat_interval_s <= {self.lease_s / 2} or lease_s >= {workable}")
        if self.ucx_tls is not None and (not isinstance(self.ucx_tls, str) or not self.ucx_tls):
            raise InvalidInputError(
                f"TransportConfig ucx_tls must be None or a non-empty str, got {self.ucx_tls!r}")
        if not is_int(self.num_threads) or self.num_threads < 0:
            raise InvalidInputError(
                f"TransportConfig num_threads must be a non-negative int, got {self.num_threads!r}")
        if not is_int(self.progress_wake_us) or not 0 <= self.progress_wake_us <= 10**7:
            raise InvalidInputError(f"TransportConfig progress_wake_us must be an int in "
                                    f"[0, 10_000_000], got {self.progress_wake_us!r}")
        if self.etcd_endpoints is not None and not (
                isinstance(self.etcd_endpoints, str) and self.etcd_endpoints.isprintable()
                and all(_is_url(e) for e in self.etcd_endpoints.split(","))):
            raise InvalidInputError(
                f"TransportConfig etcd_endpoints must be None or comma-separated http(s):// "
                f"URLs, got {self.etcd_endpoints!r}")
        if self.fleet_key_file is not None and (not isinstance(self.fleet_key_file, str)
                                                or not self.fleet_key_file):
            raise InvalidInputError(f"TransportConfig fleet_key_file must be None or a path, "
                                    f"got {self.fleet_key_file!r:.80}")
        object.__setattr__(self, "fleet_keys", read_keys(self.fleet_key_file))
        if self.etcd_endpoints is not None and self.listen_port != 0:
            raise InvalidInputError(
                f"TransportConfig listen_port {self.listen_port} is unused with etcd_endpoints "
                f"(no listener runs); leave it 0")

    @property
    def uses_etcd(self) -> bool:
        return self.etcd_endpoints is not None


def default_name(role: str = "agent") -> str:
    """A NIXL agent name no other agent draws: `kvxfer-{role}-{host name}-{pid}-{6 hex}`."""
    host = "".join(c if c.isalnum() or c in "-." else "_" for c in socket.gethostname())
    return f"kvxfer-{role}-{host or 'host'}-{os.getpid()}-{secrets.token_hex(3)}"


def _is_url(endpoint: str) -> bool:
    """Whether `endpoint` is an `http(s)://host[:port]` URL (a port, if any, a number)."""
    try:
        url = urllib.parse.urlsplit(endpoint)
        url.port  # noqa: B018 - raises ValueError unless a number in range
    except ValueError:
        return False
    return url.scheme in ("http", "https") and bool(url.hostname)


def _nixl() -> tuple[Any, Any]:
    """`(nixl_agent, nixl_agent_config)`: the one place NIXL is imported."""
    try:
        from nixl_cu12._api import nixl_agent, nixl_agent_config
    except ImportError:
        from nixl._api import nixl_agent, nixl_agent_config
    # NIXL's Python logger prints INFO to stdout, which would corrupt `--json`
    # output: keep its records on stderr and, unless NIXL_LOG_LEVEL says
    # otherwise, at WARNING.
    nixl_logger = logging.getLogger("nixl")
    for handler in nixl_logger.handlers:
        if isinstance(handler, logging.StreamHandler) and handler.stream is sys.stdout:
            handler.setStream(sys.stderr)
    if not os.environ.get("NIXL_LOG_LEVEL"):
        nixl_logger.setLevel(logging.WARNING)
    return nixl_agent, nixl_agent_config


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now (racy: callers retry if it is taken meanwhile)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


_live_names: set[str] = set()


_live_lock = threading.Lock()


def claim_name(name: str) -> None:
    """Two live agents of one process may not share a name (NIXL tells peers apart by it)."""
    with _live_lock:
        if name in _live_names:
            raise InvalidInputError(
                f"a NIXL agent named {name!r} is already live in this process; "
                f"close it first or pick another name")
        _live_names.add(name)


def release_name(name: str) -> None:
    with _live_lock:
        _live_names.discard(name)
    claims.give_back(name)


HOST_TLS = "cma,tcp,self"
"""UCX transports for host memory between processes: `cma` copies between them on one
machine, `tcp` reaches other machines, `self` is the process itself."""
CUDA_TLS = "cuda_copy"
"""What UCX needs besides where it sees CUDA: without it, it makes no context."""


def ucx_sees_cuda() -> bool:
    """Whether UCX will load its CUDA transports here: CUDA's driver library loads."""
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


def choose_ucx_tls(ucx_tls: str | None, sees_cuda: bool | None = None) -> list[str | None]:
    """The `UCX_TLS` values to try, in order, for `TransportConfig.ucx_tls`: for
    `"auto"`, the host transports (with `cuda_copy` where UCX sees CUDA), then UCX's
    own choice (None); any other value alone."""
    if ucx_tls != "auto":
        return [ucx_tls]
    if sees_cuda is None:
        sees_cuda = ucx_sees_cuda()
    return [f"{HOST_TLS},{CUDA_TLS}" if sees_cuda else HOST_TLS, None]


def _create_agent(config: TransportConfig) -> tuple[Any, int]:
    """`(agent, listen port)`; the port is 0 with etcd (no listener)."""
    choices = choose_ucx_tls(config.ucx_tls)
    for i, tls in enumerate(choices):
        try:
            made = _create_agent_with(config, tls)
        except _NoTransports as e:
            if i + 1 < len(choices):
                logger.warning("NIXL agent %s: UCX cannot use transports %s (%r); trying %s",
                               config.name, tls, e.error, choices[i + 1] or "UCX's own choice")
                continue
            tried = ", ".join(repr(c) for c in choices)
            other = "None (UCX's own choice)" if tls is not None else repr(HOST_TLS)
            raise InvalidInputError(
                f"cannot create NIXL agent {config.name!r}: UCX has no transports "
                f"ucx_tls={tls!r} names on this machine ({e.error!r}); tried {tried}; "
                f"try ucx_tls={other}") from e.error
        logger.info("NIXL agent %s: UCX transports %s%s", config.name, tls or "UCX's own choice",
                    " (ucx_tls auto)" if config.ucx_tls == "auto" else "")
        return made
    raise AssertionError("unreachable")


class _NoTransports(Exception):
    """UCX could not make a context with the transports asked for."""

    def __init__(self, error: Exception):
        super().__init__(repr(error))
        self.error = error


def _create_agent_with(config: TransportConfig, ucx_tls: str | None) -> tuple[Any, int]:
    """`_create_agent` with `UCX_TLS` set to `ucx_tls` (None: as inherited)."""
    nixl_agent, nixl_agent_config = _nixl()
    api = sys.modules.get(nixl_agent.__module__)  # what the two helpers below reach into
    listens = not config.uses_etcd and not config.fleet_keys  # NIXL's own listener
    tries = _MAX_BIND_TRIES if config.listen_port == 0 and listens else 1
    # Both are read when the agent is created, and only then.
    env = {"UCX_TLS": ucx_tls, "NIXL_ETCD_ENDPOINTS": config.etcd_endpoints}
    old = {key: os.environ.get(key) for key in env}
    try:
        for key, value in env.items():
            if value is not None:
                os.environ[key] = value
            elif key == "NIXL_ETCD_ENDPOINTS":
                os.environ.pop(key, None)  # listener mode: never an inherited etcd
        for attempt in range(tries):
            port = config.listen_port or free_port() if listens else 0
            nixl_config = nixl_agent_config(
                enable_listen_thread=listens, listen_port=port,
                num_threads=config.num_threads, sync_mode=_strict_sync(api),
            )
            try:
                with _progress_wake(api, config.progress_wake_us):
                    return nixl_agent(config.name, nixl_config), port
            except RuntimeError as e:
                if "bind" in str(e).lower() and config.listen_port:
                    raise InvalidInputError(
                        f"NIXL agent {config.name!r} cannot listen on listen_port {port}: it is "
                        f"in use ({e}); give a free port, or 0 for one picked here") from e
                if "bind" not in str(e).lower() or attempt == tries - 1:
                    raise TransferError(
                        f"cannot create NIXL agent {config.name!r} on port {port}: {e}"
                    ) from e
            except Exception as e:  # NIXL's own types: nixlBackendError for a UCX it cannot make
                if ucx_tls is not None:
                    raise _NoTransports(e) from e
                raise TransferError(f"cannot create NIXL agent {config.name!r}: {e!r}") from e
        raise AssertionError("unreachable")
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _strict_sync(api: Any) -> Any:
    """NIXL's thread-safe agent mode (D posts READs from a thread of its own). NIXL picks
    it itself only with a listener; None where `api` (NIXL's Python API module) does not
    name it (then NIXL's default applies)."""
    return getattr(getattr(api, "nixl_thread_sync_t", None), "NIXL_THREAD_SYNC_STRICT", None)


@contextlib.contextmanager
def _progress_wake(api: Any, wake_us: int) -> Iterator[None]:
    """While an agent is created: its progress thread's poll timeout is `wake_us`.

    `nixl_agent.__init__` builds its C++ config from the bindings' `nixlAgentConfig`
    and sets `pthrDelay = 0` (a spinning thread), with no argument to change it.
    For the constructor's duration only, the bindings hand it a subclass whose
    `pthrDelay` is at least `wake_us`. Where the API has another shape, the agent
    is created as NIXL makes it, with a warning.
    """
    bindings = getattr(api, "nixlBind", None)
    with _patch_lock:  # agents created on two threads at once would patch over each other
        base = getattr(bindings, "nixlAgentConfig", None)
        if wake_us == 0 or base is None or not isinstance(getattr(base, "pthrDelay", None),
                                                         property):
            if wake_us:
                logger.warning("cannot set NIXL's progress-thread wake-up; its thread may spin")
            yield
            return
        delay = base.pthrDelay

        class _Config(base):  # type: ignore[misc, valid-type]
            pthrDelay = property(delay.fget, lambda self, us: delay.fset(self, max(us, wake_us)))

        bindings.nixlAgentConfig = _Config
        try:
            yield
        finally:
            bindings.nixlAgentConfig = base


_patch_lock = threading.Lock()


def _new_patch_lock() -> None:
    global _patch_lock
    _patch_lock = threading.Lock()  # a forked child may inherit it held


os.register_at_fork(after_in_child=_new_patch_lock)


def start_agent(config: TransportConfig, stagings: Sequence[Staging]) -> tuple[Any, int, Any]:
    """`(agent, listen port, registration)`: a new agent under a name no live agent has."""
    if not isinstance(config, TransportConfig):
        raise InvalidInputError(f"config must be a TransportConfig, got {config!r:.80}")
    claim_name(config.name)
    try:
        # No live agent elsewhere has the name (`kvxfer.nixl.claims`).
        claims.take(config.name, config.etcd_endpoints, config.host)
        agent, port = _create_agent(config)
        regs = [(addr, n, 0, "") for s in stagings
                for addr, n in [*s.region_addresses(), s.prints_address(), s.tags_address()]]
        reg = agent.register_memory(regs, "DRAM")
        if config.fleet_keys and not config.uses_etcd:  # the gate instead of NIXL's listener
            try:
                gate = Gate(agent, config.name, config.fleet_keys,
                            "::" if ":" in config.host else "", config.listen_port,
                            config.handshake_timeout_s)
            except BaseException:
                close_agent(agent, reg, config.name)
                raise
            _gates[config.name], port = gate, gate.port
        else:
            _warn_unkeyed(config)
        if config.uses_etcd:
            try:  # under our name, with the registered regions: peers fetch it by name
                agent.send_local_metadata()
            except Exception as e:
                close_agent(agent, reg, config.name, etcd=False)
                raise TransferError(f"NIXL agent {config.name!r} cannot publish its metadata "
                                    f"to etcd at {config.etcd_endpoints}: {e}") from e
        return agent, port, reg
    except BaseException:
        release_name(config.name)
        raise


_gates: dict[str, Gate] = {}  # agent name -> its gate, with a fleet key
_warned: list[bool] = []


def _warn_unkeyed(config: TransportConfig) -> None:
    """Once per process: what an agent without a fleet key exposes."""
    if _warned:
        return
    _warned.append(True)
    if config.fleet_keys:  # with etcd
        logger.warning("NIXL agent %s publishes its metadata in etcd at %s, which the fleet key "
                       "does not guard: whoever reads that etcd can READ every staging slot. "
                       "Guard etcd itself (client certificates, or a network only the fleet "
                       "reaches)", config.name, config.etcd_endpoints)
        return
    logger.warning(
        "NIXL agent %s has no fleet key (fleet_key_file, or %s): %s hands its metadata to any "
        "agent that asks, and with it any agent that reaches this host can READ every staging "
        "slot (every request's KV, every tenant's pooled KV) and send it messages. Give every "
        "instance of the fleet the same key (docs/connector.md#the-fleet-key)", config.name,
        "KVXFER_FLEET_KEY", "etcd" if config.uses_etcd else "NIXL's listener")


def gated(config: TransportConfig) -> bool:
    """Whether this agent's metadata goes only through the fleet key's gate."""
    return bool(config.fleet_keys) and not config.uses_etcd


def close_agent(agent: Any, reg: Any, who: str, etcd: bool = False) -> None:
    if etcd:
        try:  # peers that fetch it now find nothing, not a dead agent
            agent.invalidate_local_metadata()
        except Exception as e:  # closing must not raise: the process may be going down
            logger.warning("%s metadata invalidation failed: %s", who, e)
    try:
        agent.deregister_memory(reg)
    except Exception as e:
        logger.warning("%s deregister failed: %s", who, e)


def forget_me(agent: Any, listeners: Iterable[tuple[str, int]], who: str) -> None:
    """Ask each P listener at `listeners` to drop this agent's metadata, so a later start
    under the same name is not refused there (NIXL keeps the first metadata of a name)."""
    for host, port in sorted(listeners):
        try:
            agent.invalidate_local_metadata(host, port)
        except Exception as e:  # closing must not raise: the peer may be gone
            logger.debug("%s metadata invalidation at %s:%s failed: %s", who, host, port, e)


def close_transport(agent: Any, reg: Any, publication: Any, fetcher: Any, who: str,
                    config: TransportConfig) -> None:
    """Close what a transport opened around its agent: its etcd publication, its fetcher of
    peers' records (or None), the agent's metadata and memory, and its name's claim."""
    publication.close()
    if fetcher is not None:
        fetcher.close()
    gate = _gates.pop(config.name, None)
    if gate is not None:
        gate.close()
    close_agent(agent, reg, who, config.uses_etcd)
    release_name(config.name)


def send(nixl: Any, peer: str, kind: str, /, **fields: Any) -> None:
    try:
        nixl.send_notif(peer, encode_message(kind, **fields))
    except Exception as e:  # NIXL raises its own exception types for a gone peer
        raise TransferError(f"cannot send {kind!r} to peer {peer!r}: {e}") from e
