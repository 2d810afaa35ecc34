"""D's fallbacks: requests whose prompt D computes itself instead of loading P's KV.

Counted on every instance that reads (`kv_consumer`, and `kv_both`, where a P's failed read
of a peer's prefix, `kv_source`, counts as `load_failed` naming that peer).

A router in front of P and D may send D a request without P's `kv_transfer_params` (P
returned none, or the router sent the client's request to D alone); D then computes the
prompt, and the client gets an answer as good as P's, only later. Nothing in the answer
says so. `Fallbacks` counts each such request on D's scheduler side, once, by reason and by
the P engine that prefilled it, and logs a warning at most once per reason per minute:

- `no_params`: the request came with no `kv_transfer_params` asking D to load (P engine
  `none`);
- `below_threshold`: fewer tokens to load than `kv_recompute_threshold`;
- `other_prompt`: params made for another prompt (P's prompt length or digest differ);
- `load_failed`: the load failed and vLLM recomputes the prompt
  (`kv_load_failure_policy="recompute"`);
- `pool_failed`: the same, where D loaded part of the prompt from its own host pool and
  read the rest from P, and only the pool's part failed its check: not P's doing (P engine
  `none`).

A request whose params say `local_prefill` (`kvxfer proxy` sent it to D alone on purpose:
D holds all but a short suffix of its prompt) is no fallback: it is counted as
`d_local_prefills` (`vllm:kvxfer_num_local_prefills_total`), without a warning.

The counts go out as `Stats` counters named `d_fallback_<reason>|<P engine>`
(`counter_name`), which `kvxfer.vllm.metrics` turns into `vllm:kvxfer_num_fallbacks_total
{reason, p_engine}`. The P engine is P's agent name as its params name it (`peer`): one
per P instance. A label's values must stay few, and params come from clients, who may
name anything: a name is a label only once D's workers completed a handshake with that
P agent (`verified`, from `WorkerReport.verified`; for a P across hosts, with its process
0's agent, `<name>-0`), and at most `MAX_ENGINES` names are; a name not verified counts
as `unverified`, one verified beyond the cap as `other`. The workers' report of a step
arrives with its failed loads and is learned first, so a load that failed after its
handshake completed names its P; a fallback decided before any load (`other_prompt`,
`below_threshold`) names it only if D has loaded from that P before.

Plain Python: vLLM's scheduler process imports it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

__all__ = ["MAX_ENGINES", "MAX_VERIFIED", "REASONS", "Fallbacks", "counter_name", "parse_counter",
           "p_engine"]

logger = logging.getLogger(__name__)

REASONS = ("no_params", "below_threshold", "other_prompt", "forged", "load_failed", "pool_failed")
PREFIX = "d_fallback_"
NO_ENGINE = "none"  # no params: no P named
UNNAMED = "unknown"  # params that name no P
OTHER = "other"  # verified, beyond MAX_ENGINES names
UNVERIFIED = "unverified"  # no handshake with an agent of that name completed
MAX_ENGINES = 64
MAX_VERIFIED = 16 * MAX_ENGINES  # P agent names kept (a P across hosts has one per process)
NAME_CHARS = 128
WARN_INTERVAL_S = 60.0
LOCAL = "d_local_prefills"
"""The counter of requests sent to D alone on purpose (`local_prefill` in their params)."""


def counter_name(reason: str, engine: str) -> str:
    """The `Stats` counter of one reason and one P engine."""
    return f"{PREFIX}{reason}|{engine}"


def parse_counter(name: str) -> tuple[str, str] | None:
    """`(reason, P engine)` of a fallback counter's name; None for any other counter."""
    if not name.startswith(PREFIX):
        return None
    reason, sep, engine = name[len(PREFIX):].partition("|")
    return (reason, engine) if sep and reason in REASONS else None


def p_engine(params: Mapping[str, Any] | None) -> str:
    """The P engine a request's params name: P's agent name (`peer`), or `unknown`."""
    peer = params.get("peer") if isinstance(params, Mapping) else None
    return peer[:NAME_CHARS] if isinstance(peer, str) and peer else UNNAMED


class Fallbacks:
    """D's fallback counts (`counters`) and their warnings, on D's scheduler side.

    `recompute`: vLLM recomputes a failed load (D's `kv_load_failure_policy`); under `fail`
    a failed load fails its request, which is no fallback. `clock` is for tests.
    """

    def __init__(self, recompute: bool = True, warn_interval_s: float = WARN_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic):
        self.recompute = recompute
        self.warn_interval_s = warn_interval_s
        self.counters: dict[str, int] = {}
        self._clock = clock
        self._engines: set[str] = set()  # the labels given so far
        self._verified: set[str] = set()  # P agents the workers completed a handshake with
        self._seen: set[str] = set()  # requests D has looked at, until they finish
        self._loading: dict[str, str] = {}  # request -> P engine, while its load is under way
        self._unwarned: dict[str, int] = {}  # reason -> counted since its last warning
        self._next_warning: dict[str, float] = {}

    def arrived(self, req_id: str, params: Mapping[str, Any] | None) -> None:
        """D's scheduler looks at a request (each time it tries to schedule it): the first
        time, a request whose params do not ask D to load is counted (`no_params`); one that
        reads a prefix from a peer (`kv_source`) and computes the rest is a local prefill;
        one prefilled for a peer to read (`do_remote_decode`: a `kv_both` instance's work as
        P, a lookup among them) is neither."""
        if req_id in self._seen:
            return
        self._seen.add(req_id)
        if isinstance(params, Mapping) and params.get("do_remote_decode") is True:
            return
        if isinstance(params, Mapping) and not params.get("do_remote_prefill") and (
                params.get("local_prefill") is True or params.get("kv_source") is not None):
            self.counters[LOCAL] = self.counters.get(LOCAL, 0) + 1
        elif not (isinstance(params, Mapping) and params.get("do_remote_prefill") is True):
            self.count("no_params", NO_ENGINE, req_id, "no kv_transfer_params from P")

    def loading(self, req_id: str, params: Mapping[str, Any]) -> None:
        """D starts loading a request's KV from the P its params name."""
        self._loading[req_id] = p_engine(params)

    def loaded(self, finished: Iterable[str], failed: Iterable[str],
               pool_only: Iterable[str] = ()) -> None:
        """The worker reported these loads over (`finished_recving`), these among them failed
        (`pool_only`: in the part D loaded from its own pool alone; P's read went well)."""
        failed, pool_only = set(failed), set(pool_only)
        for req_id in finished:
            engine = self._loading.pop(req_id, None)
            if engine is None or req_id not in failed or not self.recompute:
                continue
            if req_id in pool_only:
                self.count("pool_failed", NO_ENGINE, req_id, "its load from D's own host "
                           "pool failed its check (the read from P went well)")
            else:
                self.count("load_failed", engine, req_id, "its KV load failed")

    def verified(self, names: Iterable[str]) -> None:
        """The workers completed a handshake with these P agents (`WorkerReport.verified`):
        fallbacks naming them carry their names from now on. At most `MAX_VERIFIED` kept."""
        for name in names:
            if len(self._verified) >= MAX_VERIFIED:
                return
            if isinstance(name, str) and name:
                self._verified.add(name[:NAME_CHARS])

    def finished(self, req_id: str) -> None:
        """The request left D's scheduler (finished or aborted)."""
        self._seen.discard(req_id)
        self._loading.pop(req_id, None)

    def count(self, reason: str, engine: str, req_id: str, why: str) -> None:
        """Count one fallback; warn if this reason has not warned within the interval."""
        claimed, engine = engine, self._label(engine)
        name = counter_name(reason, engine)
        self.counters[name] = self.counters.get(name, 0) + 1
        unwarned = self._unwarned.get(reason, 0) + 1
        now = self._clock()
        if now < self._next_warning.get(reason, float("-inf")):
            self._unwarned[reason] = unwarned
            return
        self._unwarned[reason] = 0
        self._next_warning[reason] = now + self.warn_interval_s
        logger.warning("D request %s: %s (P engine %s); D computes its prompt itself. "
                       "Fallbacks '%s' since this reason's last warning: %d (at most one "
                       "warning per %g s; every one is counted in "
                       "vllm:kvxfer_num_fallbacks_total)", req_id, why,
                       engine if engine != UNVERIFIED else f"{claimed[:64]!r}, unverified",
                       reason, unwarned, self.warn_interval_s)

    def _label(self, engine: str) -> str:
        """The `p_engine` label of P engine `engine` (as params name it): its name once
        verified (for a P across hosts, its process 0's agent `<name>-0`), while fewer than
        `MAX_ENGINES` names are labels; else `unverified` or `other`."""
        if engine in self._engines or engine in (NO_ENGINE, UNNAMED):
            return engine
        if engine not in self._verified and f"{engine}-0"[:NAME_CHARS] not in self._verified:
            return UNVERIFIED
        if len(self._engines) >= MAX_ENGINES:
            return OTHER
        self._engines.add(engine)
        return engine
