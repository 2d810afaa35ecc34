"""The host KV pool's index: full blocks kept in staging after their request, by block hash.

Plain bookkeeping beside `SlotMap` (no memory, no JAX), so that an engine's
scheduler process keeps it. A request's full blocks enter the pool when the
request lets go of them (`keep`): their slots pass from the request to an
entry keyed by the block's hash (vLLM's `request.block_hashes`, which fold
in the parent hash, `cache_salt`, LoRA and multimodal keys: a run of held
hashes from the first is a prefix match, never a text one). An entry is one
hashed block: `slots_per_block` kernel slots, in kernel order.

    pool = Pool(slot_map, max_slots=4096, slots_per_block=1)
    pool.keep("r", [(h0, [0]), (h1, [1])])   # r's slots of keys 0 and 1 now pool entries
    n = pool.lookup([h0, h1, h2])            # 2: the leading hashes held
    slots = pool.acquire("lease-7", [h0, h1])  # held: never evicted while referenced
    pool.release("lease-7")

Entries live within `max_slots` (the byte budget over the slot size); beyond
it, and whenever the slot map runs short of free slots for a request
(`SlotMap.reclaim`), unreferenced entries are evicted, least recently used
first. A reference (a lease, an in-flight read) keeps an entry; a full pool
never refuses a request: what it cannot evict stays until released.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvxfer.errors import InvalidInputError, UnknownRequestError
from kvxfer.plan.blocks import is_int, kernel_placement, table_entries
from kvxfer.plan.slots import SlotMap

__all__ = ["Pool"]


@dataclass
class _Entry:
    slots: tuple[int, ...]
    refs: int = 0
    gone: bool = False  # out of the index (cleared) while referenced: freed at the last release


class Pool:
    """Full blocks of one KV cache group kept in its staging, by block hash.

    **Arguments:**

    - `slot_map`: the group's `SlotMap`; the pool takes slots from its requests and gives
      them back to its free runs when it evicts (it becomes the map's `reclaim`).
    - `max_slots`: the most slots entries hold (the byte budget over the slot size).
    - `slots_per_block`: kernel slots per hashed block (the kernel ratio, times the hash
      blocks per group block).
    """

    def __init__(self, slot_map: SlotMap, max_slots: int, slots_per_block: int = 1) -> None:
        if not isinstance(slot_map, SlotMap) or slot_map.placement != "runs":
            raise InvalidInputError(f"a pool keeps the slots of a SlotMap with 'runs' placement, "
                                    f"got {slot_map!r:.80}")
        for name, value in (("max_slots", max_slots), ("slots_per_block", slots_per_block)):
            if not is_int(value) or value < (name == "slots_per_block"):
                raise InvalidInputError(f"Pool {name} must be a "
                                        f"{'positive' if name == 'slots_per_block' else 'non-negative'}"
                                        f" int, got {value!r}")
        self.slot_map, self.max_slots, self.slots_per_block = slot_map, max_slots, slots_per_block
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()  # least recently used first
        self._held: dict[Hashable, list[tuple[Hashable, _Entry]]] = {}  # owner -> what it holds
        self._evicted: list[Hashable] = []  # since the last `take_evicted`
        self.evictions = 0  # entries evicted since start
        slot_map.reclaim = self.make_room

    def __contains__(self, block_hash: object) -> bool:
        return block_hash in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def pooled_slots(self) -> int:
        return len(self._entries) * self.slots_per_block

    def lookup(self, hashes: Sequence[Hashable]) -> int:
        """How many of `hashes`, from the first, the pool holds (a hash-chain match)."""
        n = 0
        for h in hashes:
            if h not in self._entries:
                break
            n += 1
        return n

    def keep(self, req_id: Hashable, blocks: Sequence[tuple[Hashable, Sequence[int]]]
             ) -> list[Hashable]:
        """Take `req_id`'s staged blocks into the pool: per `(hash, keys)` (the request's
        staging keys of one hashed block, `slots_per_block` of them), its slots become the
        entry of `hash`. A hash already held stays as it is (the request's copy goes with
        the request). Returns the hashes that entered the pool; then evicts down to
        `max_slots`. Keys the request did not stage raise `UnknownRequestError` before any
        change."""
        new: list[tuple[Hashable, Sequence[int]]] = []
        for h, keys in blocks:
            if len(keys) != self.slots_per_block:
                raise InvalidInputError(f"request {req_id!r}: hash {h!r:.40} names {len(keys)} "
                                        f"keys, a pooled block is {self.slots_per_block} slots")
            if h not in self._entries and all(h != n for n, _ in new):
                new.append((h, keys))
        taken = [k for _, keys in new for k in keys]
        if len(set(taken)) != len(taken):
            raise InvalidInputError(f"request {req_id!r}: blocks to pool name a key twice, "
                                    f"{taken[:8]}")
        self.slot_map.slots(req_id, taken)  # every key staged: checked before any change
        for h, keys in new:
            self._entries[h] = _Entry(tuple(self.slot_map.detach(req_id, keys)))
        for h, _ in reversed(blocks):  # a chain's head last: the most recently used
            self._entries.move_to_end(h)
        self._evict(self.pooled_slots - self.max_slots)
        return [h for h, _ in new]

    def acquire(self, owner: Hashable, hashes: Sequence[Hashable]) -> list[tuple[int, ...]]:
        """Reference the entries of `hashes` for `owner` (a lease, a read): they are not
        evicted until `release(owner)`. Returns each entry's slots. A hash not held raises
        `UnknownRequestError` before any change."""
        missing = [h for h in hashes if h not in self._entries]
        if missing:
            raise UnknownRequestError(f"the pool holds no block of hash {missing[0]!r:.40}")
        for h in reversed(hashes):  # a chain's head last: evicted after its tail
            self._entries[h].refs += 1
            self._entries.move_to_end(h)
        self._held.setdefault(owner, []).extend((h, self._entries[h]) for h in hashes)
        return [self._entries[h].slots for h in hashes]

    def release(self, owner: Hashable) -> None:
        """Drop every reference `owner` holds (none: nothing happens)."""
        for _, entry in self._held.pop(owner, ()):
            entry.refs -= 1
            if entry.gone and entry.refs == 0:  # cleared under its readers: free at last
                self.slot_map.release_slots(entry.slots)
        self._evict(self.pooled_slots - self.max_slots)  # a budget lowered under readers

    def drop(self, owner: Hashable) -> None:
        """Release `owner` and take the entries it held out of the pool: what a failed load
        read (else the next match would load them again). Others reading them keep their
        slots until they let go."""
        held = self._held.get(owner, ())
        for h, entry in held:
            self._forget(h, entry)
        self.release(owner)

    def clear(self) -> list[Hashable]:
        """Take every entry out of the pool (vLLM's cache reset: after new weights, none may
        be loaded again): free the unreferenced ones now, the others once released. Returns
        their hashes (`take_evicted` names them too; `evictions` does not count them)."""
        cleared = list(self._entries)
        for h, entry in list(self._entries.items()):
            self._forget(h, entry, evicted=False)
        return cleared

    def _forget(self, h: Hashable, entry: _Entry, evicted: bool = True) -> None:
        if self._entries.get(h) is not entry:
            return  # gone already
        del self._entries[h]
        self._evicted.append(h)
        self.evictions += evicted
        if entry.refs == 0:
            self.slot_map.release_slots(entry.slots)
        else:
            entry.gone = True

    def make_room(self, slots: int) -> None:
        """Evict unreferenced entries, least recently used first, until the slot map has
        `slots` more free slots; none where that cannot free enough (the request is refused,
        and the pool keeps what it holds)."""
        unreferenced = sum(e.refs == 0 for e in self._entries.values()) * self.slots_per_block
        if unreferenced >= slots:
            self._evict(slots)

    def resize(self, max_slots: int) -> None:
        """Hold at most `max_slots` from now on (evicting down to it where entries are free)."""
        if not is_int(max_slots) or max_slots < 0:
            raise InvalidInputError(f"Pool max_slots must be a non-negative int, got {max_slots!r}")
        self.max_slots = max_slots
        self._evict(self.pooled_slots - max_slots)

    def take_evicted(self) -> list[Hashable]:
        """The hashes evicted since the last call, oldest first (for events and metrics)."""
        evicted, self._evicted = self._evicted, []
        return evicted

    def _evict(self, slots: int) -> None:
        if slots <= 0:  # keep and release ask after every change: mostly nothing to do
            return
        for h in [h for h, e in self._entries.items() if e.refs == 0]:
            if slots <= 0:
                return
            self.slot_map.release_slots(self._entries.pop(h).slots)
            self._evicted.append(h)
            self.evictions += 1
            slots -= self.slots_per_block


class Pools:
    """An instance's pools, one per full-attention group over its slot map, with each request's block
    hashes: what `PrefillScheduler` keeps when a request it held for D is released, and the
    runs a later prompt finds there (`match`, `acquire`).

    **Arguments:**

    - `groups`: the engine's `GroupSpec`s; `slot_maps`: each group's `SlotMap`.
    - `kernel_ratio`: kernel blocks per logical block (a pooled block's slots).
    - `max_slots`: each group's pool budget, in slots.

    A model with a sliding-window or SSM group pools nothing: a prompt found in the pool
    would still lack that group's state. Nor does a budget of 0: then nothing is kept
    and every call is a no-op.
    """

    def __init__(self, groups: Sequence, slot_maps: Sequence[SlotMap], kernel_ratio: int,
                 max_slots: int) -> None:
        self.groups, self.kernel_ratio = list(groups), kernel_ratio
        self.pools = ([Pool(m, max_slots, kernel_ratio) for m in slot_maps]
                      if max_slots and all(g.kind == "attention" for g in groups) else [])
        self._hashes: dict[Hashable, list[list[Hashable]]] = {}
        self._tokens: dict[Hashable, list[int]] = {}  # request -> its prompt (for events)
        self._labels: dict[Hashable, dict[str, Any]] = {}  # request -> its events' labels
        self._lent: dict[Hashable, list[int]] = {}  # request -> blocks lent, per group
        self._loading: dict[Hashable, int] = {}  # request -> tokens it loads
        self._events: list[dict] = []  # since the last `take_events`, while `events` is on
        self.events = False  # keep events for `take_events` (vLLM's scheduler takes them)
        self.hit_tokens = 0  # prompt tokens loaded (and checked) since start

    def check(self, block_hashes: object, num_prompt_tokens: int | None = None
              ) -> list[list[Hashable]]:
        """`block_hashes` as one list of hashes per group, refused by name unless it is one
        (of hashable values, and with `num_prompt_tokens`, no more than the prompt's full
        blocks: a hash for a partial block would pool it as whole)."""
        if (isinstance(block_hashes, (str, bytes)) or not isinstance(block_hashes, Sequence)
                or len(block_hashes) != len(self.groups)
                or not all(isinstance(h, Sequence) and not isinstance(h, (str, bytes))
                           and all(isinstance(x, Hashable) for x in h) for h in block_hashes)):
            raise InvalidInputError(f"block_hashes must hold one list of hashable values per KV "
                                    f"cache group ({len(self.groups)}), got {block_hashes!r:.80}")
        for spec, hashes in zip(self.groups, block_hashes):
            if is_int(num_prompt_tokens) and len(hashes) > num_prompt_tokens // spec.tokens_per_block:
                raise InvalidInputError(
                    f"block_hashes name {len(hashes)} blocks of {spec.tokens_per_block} tokens; a "
                    f"{num_prompt_tokens}-token prompt has {num_prompt_tokens // spec.tokens_per_block} "
                    f"full ones")
        return [list(h) for h in block_hashes]

    def remember(self, req_id: Hashable, block_hashes: list[list[Hashable]],
                 prompt_token_ids: Sequence[int] | None = None,
                 labels: Mapping[str, Any] | None = None) -> None:
        """`block_hashes[g]` (checked: `check`): the hashes of group `g`'s full prompt blocks,
        in order; with the prompt's tokens, its `take_events` name them, and with `labels`
        (`lora_id`, `lora_name`, and `extra_keys[g]`: one value per block of group `g`,
        opaque here) label them."""
        if self.pools:
            self._hashes[req_id] = block_hashes
            if prompt_token_ids is not None and self.events:
                self._tokens[req_id] = list(prompt_token_ids)
            if labels is not None and self.events:
                self._labels[req_id] = dict(labels)

    def forget(self, req_id: Hashable) -> None:
        self._hashes.pop(req_id, None)
        self._tokens.pop(req_id, None)
        self._labels.pop(req_id, None)

    def lend(self, req_id: Hashable) -> list[int]:
        """Name the leading run of `req_id`'s prompt blocks each group's pool holds as the
        request's own staged blocks, without copying them (`SlotMap.borrow`): they stay
        referenced until `unlend`. Returns the blocks lent, per group (what its saves skip)."""
        self.unlend(req_id)
        hashes = self._hashes.get(req_id)
        if hashes is None:
            return [0] * len(self.groups)
        r, lent = self.kernel_ratio, []
        for pool, group_hashes in zip(self.pools, hashes):
            run = pool.lookup(group_hashes)
            slots = pool.acquire(("lease", req_id), group_hashes[:run])
            pool.slot_map.borrow(req_id, list(range(run * r)), [s for e in slots for s in e])
            lent.append(run)
        self._lent[req_id] = lent
        return lent

    def lent(self, req_id: Hashable) -> list[int] | None:
        """Blocks `lend` lent `req_id`, per group (None: none)."""
        return self._lent.get(req_id)

    def unlend(self, req_id: Hashable) -> None:
        """Let go of what `lend` lent `req_id` (its slot map entries go with the request)."""
        if self._lent.pop(req_id, None) is not None:
            self.release(("lease", req_id))

    def keep(self, req_id: Hashable) -> list[list[int]]:
        """Before a released request's slots are freed: its full prompt blocks staged in
        every group enter the pools (the rest is freed with the request). Returns, per
        group, the indices (in the prompt) of the blocks that entered."""
        hashes, tokens = self._hashes.pop(req_id, None), self._tokens.pop(req_id, None)
        labels = self._labels.pop(req_id, None)
        if hashes is None:
            return []
        self._take_evicted()  # before what enters: events in order
        r, entered = self.kernel_ratio, []
        for pool, group_hashes in zip(self.pools, hashes):
            if req_id not in pool.slot_map:
                entered.append([])
                continue
            # lent blocks are entries already (held until unlent below): only its own enter
            own = set(pool.slot_map.blocks(req_id)) - pool.slot_map.borrowed(req_id)
            blocks = [(h, [i * r + j for j in range(r)]) for i, h in enumerate(group_hashes)]
            new = set(pool.keep(req_id, [(h, keys) for h, keys in blocks
                                         if own.issuperset(keys)]))
            entered.append([i for i, h in enumerate(group_hashes) if h in new])
        self.unlend(req_id)
        for g, indices in enumerate(entered if self.events else ()):
            self._events.extend(_stored(g, self.groups[g].tokens_per_block, hashes[g], indices,
                                        tokens, labels))
        return entered

    def match(self, block_hashes: Sequence[Sequence[Hashable]], num_computed_tokens: int) -> int:
        """Tokens past `num_computed_tokens` (a whole number of blocks) every group's pool
        holds, block for block from there: 0 where a group pools nothing."""
        block_hashes = self.check(block_hashes)
        _check_tokens(num_computed_tokens=num_computed_tokens)
        if not self.pools:
            return 0
        runs = []
        for spec, pool, hashes in zip(self.groups, self.pools, block_hashes):
            tpb = spec.tokens_per_block
            if num_computed_tokens % tpb:
                return 0
            runs.append(pool.lookup(hashes[num_computed_tokens // tpb:]) * tpb)
        whole = math.lcm(*(g.tokens_per_block for g in self.groups))  # whole blocks of each
        return min(runs) // whole * whole

    def acquire(self, owner: Hashable, block_hashes: Sequence[Sequence[Hashable]],
                num_computed_tokens: int, num_tokens: int) -> list[list[int]]:
        """Reference the blocks of tokens `[num_computed_tokens, +num_tokens)` for `owner`;
        per group their slots, in kernel order. `release(owner)` lets go. Token counts that
        are not whole blocks of every group are refused by name (a block loaded in part would
        leave the rest of its tokens stale)."""
        block_hashes = self.check(block_hashes)
        _check_tokens(num_computed_tokens=num_computed_tokens, num_tokens=num_tokens)
        bad = [spec.tokens_per_block for spec in self.groups
               if num_computed_tokens % spec.tokens_per_block or num_tokens % spec.tokens_per_block]
        if bad or not self.pools:
            raise InvalidInputError(f"a pooled load is whole blocks of a pool: tokens "
                                    f"[{num_computed_tokens}, +{num_tokens}) at "
                                    f"{[g.tokens_per_block for g in self.groups]} tokens per block"
                                    f"{'' if self.pools else ', and this P pools nothing'}")
        out = []
        for spec, pool, hashes in zip(self.groups, self.pools, block_hashes):
            first = num_computed_tokens // spec.tokens_per_block
            wanted = hashes[first : first + num_tokens // spec.tokens_per_block]
            out.append([s for slots in pool.acquire(owner, wanted) for s in slots])
        return out

    def release(self, owner: Hashable) -> None:
        for pool in self.pools:
            pool.release(owner)

    def load(self, req_id: Hashable, block_hashes: Sequence[Sequence[Hashable]],
             num_computed_tokens: int, num_tokens: int, tables: Sequence[Sequence[int]]
             ) -> list[tuple[list[int], list[int]]]:
        """Hold the pooled blocks of tokens `[num_computed_tokens, +num_tokens)` for loading
        into `req_id`'s device blocks (`tables[g]`: group `g`'s block table, logical ids in
        token order): per group `(kernel ids, slots)`, what P's worker `load`s. `loaded`
        lets go of them."""
        if (isinstance(tables, (str, bytes)) or not isinstance(tables, Sequence)
                or len(tables) != len(self.groups)):
            raise InvalidInputError(f"load of {req_id!r}: tables must hold one block table per "
                                    f"KV cache group ({len(self.groups)}), got {tables!r:.80}")
        slots = self.acquire(("load", req_id), block_hashes, num_computed_tokens, num_tokens)
        try:
            loads = []
            for spec, table, group_slots in zip(self.groups, tables, slots):
                first = num_computed_tokens // spec.tokens_per_block
                entries = table_entries(range(first, first + num_tokens // spec.tokens_per_block),
                                        table)
                loads.append(([k for _, k in kernel_placement(entries, self.kernel_ratio)],
                              group_slots))
        except BaseException:
            self.release(("load", req_id))
            raise
        self._loading[req_id] = num_tokens
        return loads

    def loaded(self, req_id: Hashable, failed: bool = False, hit: bool = True) -> None:
        """The worker loaded `req_id`'s pooled blocks: let go of them; where they did not
        check out (`failed`), out of the pool with them. Counted as a hit unless `hit` is
        False (the request failed for another reason, and is computed whole)."""
        tokens = self._loading.pop(req_id, 0)
        if failed:
            self.drop(("load", req_id))
        else:
            self.hit_tokens += tokens if hit else 0  # loaded, checked: a hit
            self.release(("load", req_id))

    def counters(self) -> dict[str, int]:
        """Since start, with a pool: `p_pool_hit_tokens` (prompt tokens loaded from it instead
        of prefilled) and `p_pool_evicted_blocks`."""
        if not self.pools:
            return {}
        return {"p_pool_hit_tokens": self.hit_tokens, "p_pool_evicted_blocks": self.evictions()}

    def take_events(self) -> list[dict]:
        """What entered and left the pools since the last call, in order, once `events` is on
        (for vLLM's KV events; off, none are kept): `{"group", "stored", "parent",
        "token_ids", "block_size"}` for a run of blocks of one prompt that entered
        (`stored` their hashes, `parent` the hash before them or None, `token_ids` their
        tokens when the request was remembered with them, else None), `{"group",
        "removed"}` for hashes evicted, dropped or cleared."""
        self._take_evicted()
        events, self._events = self._events, []
        return events

    def _take_evicted(self) -> None:
        removed = [{"group": g, "removed": r} for g, pool in enumerate(self.pools)
                   if (r := pool.take_evicted())]
        if self.events:  # else dropped: nobody takes them
            self._events.extend(removed)

    def drop(self, owner: Hashable) -> None:
        """See `Pool.drop`."""
        for pool in self.pools:
            pool.drop(owner)

    def clear(self) -> None:
        """See `Pool.clear` (the hashes go to `take_events`). Requests remembered now (staged
        or being gathered, their KV computed before the reset) are forgotten too: their blocks
        never enter the pool."""
        for pool in self.pools:
            pool.clear()
        self._hashes.clear()
        self._tokens.clear()

    def resize(self, max_slots: int) -> None:
        """Each group's budget from now on, in slots (a scheduler that learns it from its
        workers: `kvxfer.vllm`)."""
        for pool in self.pools:
            pool.resize(max_slots)

    def entries(self) -> int:
        return sum(len(p) for p in self.pools)

    def gauges(self, slot_bytes: Sequence[int] = ()) -> dict[str, float]:
        """`p_pool_blocks` (entries, every group's), `p_pool_slots` (their staging slots) and
        `p_pool_capacity_tokens` (the tokens of a prompt the pools can hold at most); with
        each group's bytes of a slot, `p_pool_bytes`."""
        out = {"p_pool_blocks": self.entries(),
               "p_pool_slots": sum(p.pooled_slots for p in self.pools),
               "p_pool_capacity_tokens": min((p.max_slots // p.slots_per_block * g.tokens_per_block
                                              for p, g in zip(self.pools, self.groups)),
                                             default=0)}
        if len(slot_bytes) == len(self.pools):
            out["p_pool_bytes"] = sum(p.pooled_slots * b for p, b in zip(self.pools, slot_bytes))
        return out

    def evictions(self) -> int:
        """Entries evicted since start, every group's."""
        return sum(p.evictions for p in self.pools)


def _stored(group: int, block_size: int, hashes: list[Hashable], indices: list[int],
            tokens: list[int] | None, labels: Mapping[str, Any] | None = None) -> list[dict]:
    """`take_events`' entries for blocks `indices` of a prompt that entered a pool: one per
    run of consecutive blocks, with the request's `labels` (`remember`)."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    labels = labels or {}
    keys = labels["extra_keys"][group] if labels.get("extra_keys") else None
    return [{"group": group, "stored": [hashes[i] for i in run],
             "parent": hashes[run[0] - 1] if run[0] else None, "block_size": block_size,
             "token_ids": None if tokens is None
             else tokens[run[0] * block_size:(run[-1] + 1) * block_size],
             "lora_id": labels.get("lora_id"), "lora_name": labels.get("lora_name"),
             "extra_keys": None if keys is None else [keys[i] for i in run]} for run in runs]


def _check_tokens(**counts: object) -> None:
    for name, value in counts.items():
        if not is_int(value) or value < 0:
            raise InvalidInputError(f"{name} must be a non-negative int, got {value!r:.40}")
