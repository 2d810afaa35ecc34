"""`Keeper`: P's key and the secrets derived from it, and finished requests whose full blocks
enter the host pool (part of P's scheduler side, `kvxfer.connector.scheduler`). No JAX, no NIXL."""

from __future__ import annotations

import itertools
import logging
import secrets
from collections.abc import Hashable, Iterable, Mapping, Sequence
from typing import Any

from kvxfer.errors import InvalidInputError, StagingFullError
from kvxfer.nixl.wire import entry_secret, hash_hex, new_secret
from kvxfer.plan.blocks import kernel_placement, table_entries
from kvxfer.plan.pool import Pools
from kvxfer.plan.slots import SlotMap

__all__ = ["Keeper", "Tags", "check_events", "split_tags"]

logger = logging.getLogger(__name__)

Tags = tuple[dict[int, tuple[str, str]], ...]
"""Per group, kernel position -> (entry secret, block hash) (`Keeper.tags`)."""


def split_tags(tags: Tags) -> tuple[tuple[dict[int, str], ...], tuple[dict[int, str], ...]]:
    """`tags` as `SaveMeta.entries` and `SaveMeta.hashes` hold them."""
    return (tuple({pos: s for pos, (s, _) in t.items()} for t in tags),
            tuple({pos: h for pos, (_, h) in t.items()} for t in tags))



class Keeper:
    """Finished requests whose full blocks enter the host pool (`PrefillScheduler.keep_finished`):
    a D's (or any instance's) own blocks, prompt and generated tokens alike, which no peer
    reads. The pooled run of a request's blocks is named, not copied (`Pools.lend`); the rest
    go into the next `SaveMeta` (`keeps`), whose worker frees them once gathered; `release`
    then makes them pool entries, tagged from their entry secrets as P's are.

    It holds P's key, from which every secret of this P derives: its requests' (`secret`)
    and its pool entries' (`tags`).

    **Arguments:** each group's `SlotMap`, the `Pools` over them, the kernel ratio, and the
    key (64 hex digits; the same for every process of a P across hosts; None draws one).
    """

    def __init__(self, slot_maps: Sequence[SlotMap], pools: Pools, kernel_ratio: int,
                 key: str | None) -> None:
        if key is not None and not (isinstance(key, str) and len(key) == 64
                                    and all(c in "0123456789abcdef" for c in key)):
            raise InvalidInputError("secret_key must be None or 64 lowercase hex digits")
        self.slot_maps, self.pools, self.kernel_ratio = slot_maps, pools, kernel_ratio
        self._key = key or secrets.token_hex(32)
        self.held: set[str] = set()  # kept, not yet freed by the worker
        self._keeps: dict[str, dict[str, Any]] = {}  # for the next meta: one request's blocks each
        self._count = itertools.count()

    def secret(self, req_id: str) -> str:
        """A fresh secret for `req_id` (`new_secret`: every process of a P derives the same)."""
        return new_secret(self._key, req_id, next(self._count))

    def keep(self, req_id: str, tables: Sequence[Sequence[int]],
             block_hashes: Sequence[Sequence[Hashable]],
             token_ids: Sequence[int] | None = None,
             labels: Mapping[str, Any] | None = None) -> bool:
        """`tables[g]`: group `g`'s block table (logical ids in token order);
        `block_hashes[g]`: the hashes of the group's full blocks whose KV is computed, in
        order (no more); `token_ids`, their tokens, and `labels`, for KV events
        (`Pools.remember`). Returns whether the engine
        must keep the request's device blocks until the next save gathered them (vLLM:
        `delay_free_blocks`): False where nothing is left to copy, where there is no pool,
        or where the staging has no room (the request is then not pooled)."""
        if not self.pools.pools or req_id in self.held or not any(block_hashes):
            return False
        hashes = self.pools.check(block_hashes)
        check_events(req_id, None, None, labels)
        if (isinstance(tables, (str, bytes)) or not isinstance(tables, Sequence)
                or len(tables) != len(hashes)):
            raise InvalidInputError(f"request {req_id!r}: tables must hold one block table per "
                                    f"KV cache group ({len(hashes)}), got {tables!r:.80}")
        self.pools.remember(req_id, hashes, token_ids, labels)
        lent, r = self.pools.lend(req_id), self.kernel_ratio
        try:
            placed = tuple(kernel_placement(table_entries(range(n, len(h)), table), r)
                           for n, h, table in zip(lent, hashes, tables))
            slots = tuple(m.assign(req_id, [pos for pos, _ in p])
                          for m, p in zip(self.slot_maps, placed))
        except (InvalidInputError, StagingFullError) as e:
            logger.warning("request %s is not pooled: %s", req_id, e)
            self._free(req_id)
            return False
        self.held.add(req_id)
        if not any(placed):  # all of it pooled already: a hit that refreshes its entries
            self.release([req_id])
            return False
        entries, tags = split_tags(self.tags(hashes, [[pos for pos, _ in p] for p in placed]))
        self._keeps[req_id] = {"blocks": placed, "slots": slots, "entries": entries,
                               "hashes": tags, "secrets": self.secret(f"keep\0{req_id}")}
        return True

    def tags(self, hashes: Sequence[Sequence[Hashable]], positions: Sequence[Iterable[int]]
             ) -> Tags:
        """Per group, each kernel position of `positions` (whole hashed blocks) -> its pool
        entry's secret (`entry_secret`) and its block hash (`hash_hex`): what its tags are
        bound to (`kvxfer.nixl.wire.bound_secret`)."""
        r = self.kernel_ratio
        return tuple({pos: (entry_secret(self._key, g, h[pos // r]), hash_hex(h[pos // r]))
                      for pos in ps} for g, (h, ps) in enumerate(zip(hashes, positions)))

    def add_to(self, meta: Any) -> None:
        """Put the requests kept since the last call into this step's `meta` (a
        `kvxfer.connector.scheduler.SaveMeta`)."""
        for req_id, kept in self._keeps.items():
            for name, value in kept.items():
                getattr(meta, name)[req_id] = value
            meta.keeps.append(req_id)
        self._keeps = {}

    def release(self, freed: Iterable[str]) -> list[str]:
        """The worker freed these requests: those kept enter the pool and free their slots;
        returns the others."""
        others = []
        for req_id in freed:
            if req_id not in self.held:
                others.append(req_id)
                continue
            self.held.discard(req_id)
            self.pools.keep(req_id)
            self._free(req_id)
        return others

    def _free(self, req_id: str) -> None:
        self._keeps.pop(req_id, None)
        self.pools.unlend(req_id)
        self.pools.forget(req_id)
        for m in self.slot_maps:
            if req_id in m:
                m.free(req_id)


def check_events(req_id: str, num_prompt_tokens: int | None,
                  event_token_ids: Sequence[int] | None, labels: Mapping[str, Any] | None) -> None:
    """`InvalidInputError` unless `event_token_ids` (None, or the prompt's `num_prompt_tokens`
    token ids) and `labels` (None or a mapping) can label the request's pool events."""
    if event_token_ids is not None and (isinstance(event_token_ids, (str, bytes)) or not (
            isinstance(event_token_ids, Sequence) and len(event_token_ids) == num_prompt_tokens)):
        raise InvalidInputError(f"request {req_id!r}: event_token_ids must be the prompt's "
                                f"{num_prompt_tokens!r} token ids, got {event_token_ids!r:.80}")
    if labels is not None and not isinstance(labels, Mapping):
        raise InvalidInputError(f"request {req_id!r}: labels must be None or a mapping, "
                                f"got {labels!r:.80}")
