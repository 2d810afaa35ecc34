"""Save plans: which KV blocks P copies to host memory after each prefill step.

Blocks are selected **by token position**, per KV cache group
(docs/save-plans.md). For each request being prefilled, `SaveTracker` keeps its block
table per group and a watermark `saved` per group: the prompt tokens already
copied. After a step that writes tokens up to `end`, a token-indexed group
with `T` tokens per block id copies `table[saved // T : cdiv(end, T)]`, and
`saved` becomes `end`. So:

- a block straddling a chunk boundary is copied again once complete;
- lookahead blocks past `end` are never copied before they are written;
- the first chunk after a prefix-cache hit copies the cached blocks too;
- the last chunk is copied even when it allocated no new block;
- a request is dropped when its prefill completes, finishes or aborts.

SSM (mamba) groups hold a running state, not token positions: the block
holding the state after the last prompt token is copied on the completing
step. Sliding-window groups skip blocks wholly outside the window as it
stands at the end of the prompt. Block id 0 is the engine's null block and
is never copied.

Block ids here are the engine's (logical) ids; mapping them to kernel ids is
the copy path's business (`kvxfer.plan.blocks.to_kernel_ids`).
"""


from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from kvxfer.errors import InvalidInputError
from kvxfer.plan.blocks import NULL_BLOCK, cdiv, is_int

__all__ = ["BlockIds", "GroupKind", "GroupSpec", "PlacedIds", "SaveTracker", "ScheduledRequest",
           "final_blocks"]

GroupKind = Literal["attention", "sliding_window", "mamba"]
_KINDS = ("attention", "sliding_window", "mamba")

BlockIds = tuple[list[int], ...]
"""One list of block ids per KV cache group, in group order."""

PlacedIds = tuple[list[tuple[int, int]], ...]
"""Per KV cache group, `(table index, block id)` pairs: which entry of the
request's block table (which token range) each copied block holds."""


@dataclass(frozen=True)
class GroupSpec:
    """One KV cache group, as the engine configures it.

    `kind` is "attention" (full attention, MLA too), "sliding_window" (needs
    `sliding_window`, in tokens) or "mamba" (SSM state). `dcp_size` is the
    decode-context-parallel world size, which scales the tokens per block id
    of attention kinds only.
    """

    block_size: int
    kind: GroupKind = "attention"
    dcp_size: int = 1
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if not is_int(self.block_size) or self.block_size <= 0:
            raise InvalidInputError(f"GroupSpec block_size must be a positive int, got {self.block_size!r}")
        if self.kind not in _KINDS:
            raise InvalidInputError(f"GroupSpec kind must be one of {_KINDS}, got {self.kind!r}")
        if not is_int(self.dcp_size) or self.dcp_size <= 0:
            raise InvalidInputError(f"GroupSpec dcp_size must be a positive int, got {self.dcp_size!r}")
        if self.kind == "sliding_window":
            if not is_int(self.sliding_window) or self.sliding_window <= 0:
                raise InvalidInputError(
                    "GroupSpec of kind 'sliding_window' needs a positive int sliding_window, "
                    f"got {self.sliding_window!r}"
                )
        elif self.sliding_window is not None:
            raise InvalidInputError(
                f"GroupSpec sliding_window={self.sliding_window!r} is only valid for kind "
                f"'sliding_window', not {self.kind!r}"
            )

    @property
    def tokens_per_block(self) -> int:
        """Tokens covered by one block id: `block_size * dcp_size`, or `block_size` for mamba."""
        if self.kind == "mamba":
            return self.block_size
        return self.block_size * self.dcp_size


def final_blocks(spec: GroupSpec, num_prompt_tokens: int) -> range:
    """The table indices of the blocks of a `num_prompt_tokens`-token prompt that P stages
    for D in group `spec` once its prefill completes: every block holding a prompt token;
    for a sliding window, those the window reaches from the last prompt token; for mamba,
    the block holding the state after it. D's load of the prompt must cover them all."""
    if not is_int(num_prompt_tokens) or num_prompt_tokens <= 0:
        raise InvalidInputError(f"num_prompt_tokens must be a positive int, got "
                                f"{num_prompt_tokens!r:.40}")
    tpb = spec.tokens_per_block
    if spec.kind == "mamba":
        last = (num_prompt_tokens - 1) // tpb
        return range(last, last + 1)
    end = cdiv(num_prompt_tokens, tpb)
    if spec.kind == "sliding_window":
        return range(max(0, end - cdiv(spec.sliding_window, tpb) - 1), end)
    return range(end)


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's part of a scheduler step, in the engine's terms.

    `block_ids` holds one list per group: the whole table when `full_table`
    (a new or resumed request), else this step's additions; `None` when no
    group got a new block this step.
    """

    req_id: str
    num_computed_tokens: int
    num_scheduled_tokens: int
    block_ids: BlockIds | Sequence[Sequence[int]] | None = None
    full_table: bool = False


@dataclass
class _Request:
    num_prompt_tokens: int
    tables: list[list[int]] = field(default_factory=list)
    saved: list[int] = field(default_factory=list)


def _prompt_end(step: ScheduledRequest, req: _Request) -> int:
    """Prompt tokens written once `step` has run: decode tokens past the prompt don't count."""
    return min(step.num_computed_tokens + step.num_scheduled_tokens, req.num_prompt_tokens)


class SaveTracker:
    """Per-request save watermarks on P; turns scheduler steps into save plans.

    Arguments:
        groups: the engine's KV cache groups, in the order of `block_ids`.
    """

    def __init__(self, groups: Sequence[GroupSpec]) -> None:
        groups = tuple(groups)
        if not groups:
            raise InvalidInputError("SaveTracker needs at least one GroupSpec, got none")
        for g in groups:
            if not isinstance(g, GroupSpec):
                raise InvalidInputError(f"SaveTracker groups must be GroupSpec, got {g!r}")
        self.groups = groups
        self._requests: dict[str, _Request] = {}

    def __contains__(self, req_id: object) -> bool:
        return req_id in self._requests

    def __len__(self) -> int:
        return len(self._requests)

    def add(self, req_id: str, num_prompt_tokens: int) -> None:
        """Track a request whose prompt KV (`num_prompt_tokens` tokens) must reach D."""
        if req_id in self._requests:
            raise InvalidInputError(f"request {req_id!r} is already tracked")
        if not is_int(num_prompt_tokens) or num_prompt_tokens <= 0:
            raise InvalidInputError(
                f"num_prompt_tokens of request {req_id!r} must be a positive int, "
                f"got {num_prompt_tokens!r}"
            )
        self._requests[req_id] = _Request(
            num_prompt_tokens,
            tables=[[] for _ in self.groups],
            saved=[0 for _ in self.groups],
        )

    def finish(self, req_id: str) -> None:
        """Drop a request's state (finished before its prefill completed). Unknown ids: no-op."""
        self._requests.pop(req_id, None)

    def abort(self, req_id: str) -> None:
        """Drop an aborted request's state. Unknown ids: no-op."""
        self.finish(req_id)

    def plan(self, scheduled: Iterable[ScheduledRequest]) -> dict[str, BlockIds]:
        """The blocks to copy after this step's forward pass.

        Arguments:
            scheduled: this step's requests; untracked ones are ignored.

        Returns:
            `{req_id: ([ids of group 0], [ids of group 1], ...)}` for every
            tracked request in the step (lists may be empty). A request whose
            prefill completes in this step is planned, then dropped.

        The whole step is checked before any state changes: on error, the
        tracker is as it was.
        """
        return {req_id: tuple([b for _, b in placed] for placed in groups)
                for req_id, groups in self.plan_placed(scheduled).items()}

    def plan_placed(self, scheduled: Iterable[ScheduledRequest]) -> dict[str, PlacedIds]:
        """`plan`, with each block's table index: `{req_id: ([(index, id), ...], ...)}`.

        The index says which token range a block holds (entry `i` of a group
        with `T` tokens per block id holds tokens `[i*T, (i+1)*T)`), so D can
        place it at the same entry of its own table whatever P skipped
        (null blocks, blocks outside a sliding window).
        """
        steps = [s for s in scheduled if s.req_id in self._requests]
        seen: set[str] = set()
        for step in steps:
            if step.req_id in seen:
                raise InvalidInputError(f"request {step.req_id!r} appears twice in one step")
            seen.add(step.req_id)
            self._check(step)

        plans: dict[str, PlacedIds] = {}
        for step in steps:
            req = self._requests[step.req_id]
            self._update_table(req, step)
            end = _prompt_end(step, req)
            done = end >= req.num_prompt_tokens
            plans[step.req_id] = tuple(
                self._group_plan(spec, req, g, end, done) for g, spec in enumerate(self.groups)
            )
            if done:
                del self._requests[step.req_id]
        return plans

    def _check(self, step: ScheduledRequest) -> None:
        req = self._requests[step.req_id]
        for name in ("num_computed_tokens", "num_scheduled_tokens"):
            value = getattr(step, name)
            if not is_int(value) or value < 0:
                raise InvalidInputError(
                    f"{name} of request {step.req_id!r} must be a non-negative int, got {value!r}"
                )
        ids = step.block_ids
        if ids is not None:
            if len(ids) != len(self.groups):
                raise InvalidInputError(
                    f"request {step.req_id!r} has block ids for {len(ids)} groups, "
                    f"expected {len(self.groups)}"
                )
            for g, group_ids in enumerate(ids):
                for block_id in group_ids:
                    if not is_int(block_id) or block_id < 0:
                        raise InvalidInputError(
                            f"request {step.req_id!r} group {g} has invalid block id {block_id!r}"
                        )
        end = _prompt_end(step, req)
        for g, spec in enumerate(self.groups):
            added = len(ids[g]) if ids is not None else 0
            length = added if step.full_table else len(req.tables[g]) + added
            needed = cdiv(end, spec.tokens_per_block)
            if length < needed:
                raise InvalidInputError(
                    f"request {step.req_id!r} group {g} table has {length} blocks, too short for "
                    f"tokens [0, {end}) at {spec.tokens_per_block} tokens per block (needs {needed})"
                )

    def _update_table(self, req: _Request, step: ScheduledRequest) -> None:
        ids = step.block_ids
        if step.full_table:
            # New or resumed: the whole table, and everything is copied again from token 0.
            req.tables = [list(ids[g]) if ids is not None else [] for g in range(len(self.groups))]
            req.saved = [0 for _ in self.groups]
        elif ids is not None:
            for table, added in zip(req.tables, ids):
                table.extend(added)

    def _group_plan(self, spec: GroupSpec, req: _Request, g: int, end: int,
                    done: bool) -> list[tuple[int, int]]:
        table, saved, tpb = req.tables[g], req.saved[g], spec.tokens_per_block
        if spec.kind == "mamba":
            req.saved[g] = max(saved, end)
            if not done:
                return []
            index = (end - 1) // tpb
            return [(index, table[index])] if table[index] != NULL_BLOCK else []
        if end <= saved:
            return []
        lo, hi = saved // tpb, cdiv(end, tpb)
        if spec.kind == "sliding_window":  # D needs only the blocks the window reaches
            lo = max(lo, final_blocks(spec, req.num_prompt_tokens).start)
        req.saved[g] = end
        return [(i, table[i]) for i in range(lo, hi) if table[i] != NULL_BLOCK]
