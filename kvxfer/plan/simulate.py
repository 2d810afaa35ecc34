"""A simulated prefill engine: what `kvxfer plan` runs, and what tests drive.

It allocates blocks the way vLLM's scheduler does (including lookahead
blocks and prefix-cache hits), writes token-stamped KV into a simulated
device cache, copies planned blocks into a simulated host-memory buffer, and
reports every token that reaches D stale. Stamps are `(req_id, position,
version)`; each write gets a fresh version, so a copy of an earlier write is
told apart from the newest one.
"""


from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvxfer.errors import InvalidInputError
from kvxfer.plan.blocks import cdiv
from kvxfer.plan.save_plan import GroupSpec, ScheduledRequest

__all__ = ["Key", "SimEngine", "SimRequest", "Stamp"]

Stamp = tuple[str, int, int]  # (req_id, position or state length, version)
Key = tuple[int, int]  # (group, block id)


@dataclass
class SimRequest:
    req_id: str
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    num_computed_tokens: int = 0
    tables: list[list[int]] = field(default_factory=list)
    resumed: bool = True  # the next schedule sends the full table
    latest: dict[Key, int] = field(default_factory=dict)  # (group, pos) -> newest version

    @property
    def remaining(self) -> int:
        return self.num_prompt_tokens - self.num_computed_tokens


class SimEngine:
    """Device cache, host buffer and block allocator for a set of KV cache groups.

    Arguments:
        groups: the KV cache groups.
        num_blocks: blocks per group's pool; id 0 is the null block.
        lookahead: extra tokens allocated past each step's end (speculative decoding).
    """

    def __init__(self, groups: Sequence[GroupSpec], num_blocks: int = 4096, lookahead: int = 0):
        self.groups = tuple(groups)
        self.lookahead = lookahead
        self.free = [deque(range(1, num_blocks)) for _ in self.groups]
        self.device: dict[Key, list[Stamp | None]] = {}
        self.host: dict[Key, list[Stamp | None]] = {}
        self.written: set[Key] = set()  # written since allocated to its current owner
        self.dirty: set[Key] = set()  # written since last copied
        self.requests: dict[str, SimRequest] = {}
        self.violations: list[str] = []
        self._version = 0

    # -- request lifecycle -------------------------------------------------

    def add(self, req_id: str, num_prompt_tokens: int, num_cached_tokens: int = 0) -> None:
        if not 0 <= num_cached_tokens < num_prompt_tokens:
            raise InvalidInputError(
                f"cached tokens {num_cached_tokens} must be in [0, prompt {num_prompt_tokens})"
            )
        for spec in self.groups:
            if num_cached_tokens % spec.tokens_per_block:
                raise InvalidInputError(
                    f"cached tokens {num_cached_tokens} is not a whole number of "
                    f"{spec.tokens_per_block}-token blocks"
                )
        self.requests[req_id] = SimRequest(req_id, num_prompt_tokens, num_cached_tokens)

    def preempt(self, req_id: str) -> None:
        """Free the request's blocks; it restarts from its prefix hit with a new table."""
        req = self.requests[req_id]
        self._free(req)
        req.num_computed_tokens = 0
        req.resumed = True

    def drop(self, req_id: str) -> None:
        """Free and forget a request (aborted, or its prefill checked)."""
        self._free(self.requests.pop(req_id))

    def _free(self, req: SimRequest) -> None:
        for g, table in enumerate(req.tables):
            self.free[g].extend(b for b in table if b)
        req.tables = [[] for _ in self.groups]

    # -- one step ----------------------------------------------------------

    def schedule(self, budget: int, order: Iterable[str] | None = None) -> list[ScheduledRequest]:
        """Give each unfinished request up to `budget` tokens in total and allocate its blocks."""
        out = []
        for req_id in order if order is not None else list(self.requests):
            req = self.requests[req_id]
            if budget <= 0 or req.remaining <= 0:
                continue
            new_table = req.resumed
            if new_table:
                req.tables = [[] for _ in self.groups]
                req.num_computed_tokens = req.num_cached_tokens
            n = min(budget, req.remaining)
            budget -= n
            added = self._allocate(req, req.num_computed_tokens + n + self.lookahead)
            if new_table:
                self._write(req, 0, req.num_cached_tokens)  # the prefix cache's blocks
            ids = tuple(list(t) for t in req.tables) if new_table else added
            out.append(ScheduledRequest(
                req_id, req.num_computed_tokens, n,
                ids if any(ids) or new_table else None, full_table=new_table,
            ))
            req.resumed = False
        return out

    def _allocate(self, req: SimRequest, tokens: int) -> tuple[list[int], ...]:
        added: list[list[int]] = []
        for g, spec in enumerate(self.groups):
            need = cdiv(tokens, spec.tokens_per_block) - len(req.tables[g])
            new = [self.free[g].popleft() for _ in range(max(need, 0))]
            for b in new:
                self.written.discard((g, b))
                self.dirty.discard((g, b))
            req.tables[g].extend(new)
            added.append(new)
        return tuple(added)

    def forward(self, scheduled: Sequence[ScheduledRequest]) -> None:
        """Write the scheduled tokens' KV (and each SSM group's state) to the device."""
        for step in scheduled:
            req = self.requests[step.req_id]
            start = step.num_computed_tokens
            self._write(req, start, start + step.num_scheduled_tokens)
            req.num_computed_tokens = start + step.num_scheduled_tokens

    def _write(self, req: SimRequest, start: int, end: int) -> None:
        if end <= start:
            return
        self._version += 1
        for g, spec in enumerate(self.groups):
            tpb = spec.tokens_per_block
            if spec.kind == "mamba":
                key = (g, req.tables[g][(end - 1) // tpb])
                self._cell(key, 1)[0] = (req.req_id, end, self._version)
                req.latest[(g, -1)] = self._version
                self._touch(key)
                continue
            for pos in range(start, end):
                key = (g, req.tables[g][pos // tpb])
                self._cell(key, tpb)[pos % tpb] = (req.req_id, pos, self._version)
                req.latest[(g, pos)] = self._version
                self._touch(key)

    def _cell(self, key: Key, size: int) -> list[Stamp | None]:
        return self.device.setdefault(key, [None] * size)

    def _touch(self, key: Key) -> None:
        self.written.add(key)
        self.dirty.add(key)

    def copy(self, plan: Mapping[str, Sequence[Sequence[int]]], host: dict | None = None) -> None:
        """Copy planned blocks device -> host.

        Copies into the engine's own host buffer are checked: a block copied
        before anything was written to it, or copied again unchanged, is
        recorded in `violations`. A separate `host` (another rule's) is not.
        """
        checked = host is None
        host = self.host if host is None else host
        for req_id, groups in plan.items():
            for g, ids in enumerate(groups):
                for b in ids:
                    key = (g, b)
                    if checked:
                        if key not in self.written:
                            self.violations.append(
                                f"{req_id}: group {g} block {b} copied before written")
                        elif key not in self.dirty:
                            self.violations.append(
                                f"{req_id}: group {g} block {b} copied twice unchanged")
                        self.dirty.discard(key)
                    host[key] = list(self.device.get(key, []))

    # -- what D would see ----------------------------------------------------

    def stale_tokens(self, req_id: str, host: dict | None = None) -> dict[int, list[int]]:
        """Prompt positions (per group) whose KV on the host is not the newest on the device.

        For SSM groups, position -1 stands for the final state. Sliding-window
        groups are checked only on the blocks D needs.
        """
        host = self.host if host is None else host
        req = self.requests[req_id]
        n = req.num_prompt_tokens
        stale: dict[int, list[int]] = {}
        for g, spec in enumerate(self.groups):
            tpb, table, bad = spec.tokens_per_block, req.tables[g], []
            if spec.kind == "mamba":
                got = host.get((g, table[(n - 1) // tpb]), [None])[0]
                if got != (req_id, n, req.latest.get((g, -1))):
                    bad.append(-1)
            else:
                first = 0
                if spec.kind == "sliding_window":
                    first = max(0, cdiv(n, tpb) - cdiv(spec.sliding_window, tpb) - 1) * tpb
                for pos in range(first, n):
                    cell = host.get((g, table[pos // tpb]))
                    got = cell[pos % tpb] if cell else None
                    if got != (req_id, pos, req.latest[(g, pos)]):
                        bad.append(pos)
            if bad:
                stale[g] = bad
        return stale
