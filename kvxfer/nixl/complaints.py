"""Warnings about what peers send, counted and rate-limited: `Complaints`.

A peer decides how many malformed or unexpected messages it sends; one WARNING line each
let one peer write this side's log as fast as it can send. `Complaints` counts them per
peer and reason, and logs at most one line per `interval_s` per peer and reason: the first
at once, then the next one due with how many came since the last line.

A peer's name comes off the wire (an agent names itself), so it bounds what it keeps: at
most `max_peers` names are told apart, later ones share one key (`OTHERS`) until a sweep
(at most once an interval) drops the peers quiet for a whole interval; and a line cuts
names to `NAME_CHARS` characters and the text to `TEXT_CHARS`. Names are told apart by
their first `KEY_CHARS` characters: 256 peers naming themselves with 10 MB each would
otherwise hold 2.5 GB here.

Plain Python; not thread-safe on its own (P notes under its transport's lock).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvxfer.errors import InvalidInputError
from kvxfer.stats import Recorder

__all__ = ["INTERVAL_S", "KEY_CHARS", "MAX_PEERS", "OTHERS", "Complaints"]

INTERVAL_S = 60.0
"""At most one line per peer and reason in this many seconds."""
MAX_PEERS = 256
"""Peer names told apart; beyond, they count under `OTHERS`."""
OTHERS = "(other peers)"
NAME_CHARS = 64
KEY_CHARS = 1024  # over any host name (253) in an agent's name
TEXT_CHARS = 240


@dataclass
class _Tally:
    total: int = 0  # since the first
    unlogged: int = 0  # since the last line
    next_line: float = float("-inf")  # when the next line may be logged


class Complaints:
    """Counts what peers send that this side drops, and logs it at most once an interval
    per peer and reason.

    **Arguments:**

    - `who`: this side, as its lines name it ("P p-agent").
    - `log`: the logger the lines go to (the caller's module's, at WARNING).
    - `recorder`, `counter`: each complaint also counts `counter` there (`Stats`).
    - `interval_s`, `max_peers`: see the module's docs; `clock`: monotonic seconds (tests).
    """

    def __init__(self, who: str, log: logging.Logger, recorder: Recorder | None = None,
                 counter: str = "", interval_s: float = INTERVAL_S, max_peers: int = MAX_PEERS,
                 clock: Callable[[], float] = time.monotonic):
        if isinstance(interval_s, bool) or not isinstance(interval_s, (int, float)) or not (
                interval_s >= 0):
            raise InvalidInputError(f"Complaints interval_s must be seconds >= 0, got "
                                    f"{interval_s!r}")
        if isinstance(max_peers, bool) or not isinstance(max_peers, int) or max_peers < 1:
            raise InvalidInputError(f"Complaints max_peers must be an int >= 1, got "
                                    f"{max_peers!r}")
        self.who, self.log, self.recorder, self.counter = who, log, recorder, counter
        self.interval_s, self.max_peers, self.clock = float(interval_s), max_peers, clock
        self.total = 0
        self._tallies: dict[tuple[str, str], _Tally] = {}
        self._peers: dict[str, int] = {}  # peer told apart -> its tallies (reasons)
        self._next_sweep = float("-inf")

    def note(self, peer: str, reason: str, text: object) -> bool:
        """Count one message from `peer` dropped for `reason` (a word of the caller's,
        never the peer's), `text` saying what was wrong; log it if its line is due.
        Returns whether a line was logged."""
        now = self.clock()
        peer = peer[:KEY_CHARS]
        self.total += 1
        if self.recorder is not None and self.counter:
            self.recorder.count(self.counter)
        key = (self._key(peer, now), reason)
        tally = self._tallies.get(key)
        if tally is None:
            tally = self._tallies[key] = _Tally()
            self._peers[key[0]] = self._peers.get(key[0], 0) + 1
        tally.total += 1
        tally.unlogged += 1
        if now < tally.next_line:
            return False
        since, tally.unlogged, tally.next_line = tally.unlogged, 0, now + self.interval_s
        shown = peer[:NAME_CHARS] + ("..." if len(peer) > NAME_CHARS else "")
        self.log.warning("%s drops a message from %r%s (%s: %d since this peer's last such "
                         "line; at most one line a %g s per peer and reason): %.*s", self.who,
                         shown, f" (counted as {OTHERS})" if key[0] == OTHERS else "", reason,
                         since, self.interval_s, TEXT_CHARS, text)
        return True

    def counts(self) -> dict[tuple[str, str], int]:
        """Messages dropped per `(peer, reason)` kept (peers beyond the cap under
        `OTHERS`; a peer swept starts again from 0)."""
        return {key: tally.total for key, tally in self._tallies.items()}

    def _key(self, peer: str, now: float) -> str:
        """`peer`, or `OTHERS` while `max_peers` others are told apart (after a sweep of
        the quiet ones, at most once an interval)."""
        if peer in self._peers:
            return peer
        if len(self._peers) >= self.max_peers and now >= self._next_sweep:
            self._next_sweep = now + self.interval_s
            for key in [k for k, t in self._tallies.items()
                        if t.unlogged == 0 and t.next_line <= now]:
                del self._tallies[key]
                self._peers[key[0]] -= 1
                if not self._peers[key[0]]:
                    del self._peers[key[0]]
        return peer if len(self._peers) < self.max_peers else OTHERS
