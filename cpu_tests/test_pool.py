"""The host pool's index (`kvxfer.plan.pool.Pool`) over a `SlotMap`, checked against a model
over random schedules: every slot has one owner (free, a request, or a pool entry), referenced
entries are never evicted, eviction takes the least recently used unreferenced entry first and
keeps the pool within its budget, a lookup is the run of held hashes from the first, and a
request is refused slots only when nothing unreferenced is left to evict."""

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvxfer.connector.scheduler import PeerAddress, PrefillScheduler
from kvxfer.errors import InvalidInputError, StagingFullError, UnknownRequestError
from kvxfer.plan.pool import Pool
from kvxfer.plan.save_plan import GroupSpec, ScheduledRequest
from kvxfer.plan.slots import SlotMap

SLOTS = 24


def _free(slot_map):
    return {s for start, n in zip(slot_map._free._starts, slot_map._free._lengths)
            for s in range(start, start + n)}


class PoolMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.map = SlotMap(SLOTS)
        self.per_block = 2
        self.pool = Pool(self.map, max_slots=10, slots_per_block=self.per_block)
        self.staged: dict[str, list[int]] = {}  # request -> keys staged
        self.lru: list[str] = []  # the model: hashes, least recently used first
        self.refs: dict[str, int] = {}
        self.owners: dict[str, list[tuple[str, int]]] = {}  # owner -> (hash, epoch) it holds
        self.epoch: dict[str, int] = {}  # a hash's entries cleared so far
        self.ghosts: dict[tuple[str, int], int] = {}  # cleared entries' references left
        self.evictions = 0  # entries evicted or dropped; a cache reset's are neither
        self.next = 0

    @rule(blocks=st.integers(1, 6))
    def stage(self, blocks):
        req = f"r{self.next}"
        self.next += 1
        keys = list(range(blocks * self.per_block))
        unreferenced = sum(self.per_block for h in self.lru if self.refs.get(h, 0) == 0)
        can = len(_free(self.map)) + unreferenced >= len(keys)
        try:
            self.map.assign(req, keys)
        except StagingFullError:
            assert not can, "refused while unreferenced entries could be evicted"
            self._sync_evicted()
            return
        assert can
        self._sync_evicted()
        self.staged[req] = keys

    @precondition(lambda self: self.staged)
    @rule(data=st.data(), hashes=st.lists(st.sampled_from("abcdefgh"), min_size=1, max_size=4,
                                          unique=True))
    def finish(self, data, hashes):
        """A request ends: its first blocks enter the pool under `hashes`, the rest is freed."""
        req = data.draw(st.sampled_from(sorted(self.staged)))
        keys = self.staged.pop(req)
        n = min(len(hashes), len(keys) // self.per_block)
        blocks = [(h, keys[i * self.per_block:(i + 1) * self.per_block])
                  for i, h in enumerate(hashes[:n])]
        new = self.pool.keep(req, blocks)
        assert new == [h for h, _ in blocks if h not in self.lru]
        for h, _ in reversed(blocks):  # a chain's head is the most recently used
            if h in self.lru:
                self.lru.remove(h)
            self.lru.append(h)
        self.map.free(req)
        self._sync_evicted()

    @precondition(lambda self: self.lru)
    @rule(data=st.data())
    def acquire(self, data):
        owner = f"o{self.next}"
        self.next += 1
        hashes = data.draw(st.lists(st.sampled_from(self.lru), min_size=1, max_size=3, unique=True))
        slots = self.pool.acquire(owner, hashes)
        assert all(len(s) == self.per_block for s in slots)
        for h in reversed(hashes):
            self.refs[h] = self.refs.get(h, 0) + 1
            self.lru.remove(h)
            self.lru.append(h)
        self.owners[owner] = [(h, self.epoch.get(h, 0)) for h in hashes]

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def release(self, data):
        owner = data.draw(st.sampled_from(sorted(self.owners)))
        self.pool.release(owner)
        for h, epoch in self.owners.pop(owner):
            if epoch == self.epoch.get(h, 0):
                self.refs[h] -= 1
            else:
                self.ghosts[h, epoch] -= 1
        self._sync_evicted()

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def drop(self, data):
        """A load that failed its check: its entries leave the pool (others reading them keep
        their slots until they let go)."""
        owner = data.draw(st.sampled_from(sorted(self.owners)))
        held = self.owners.pop(owner)
        self.pool.drop(owner)
        dropped = list(dict.fromkeys(h for h, e in held if e == self.epoch.get(h, 0)
                                     and h in self.lru))
        evicted = self.pool.take_evicted()
        assert evicted[:len(dropped)] == dropped
        self.evictions += len(evicted)
        for h, epoch in held:
            if epoch != self.epoch.get(h, 0):
                self.ghosts[h, epoch] -= 1
            else:
                self.refs[h] -= 1
        for h in dropped:
            self.lru.remove(h)
            if self.refs.get(h, 0):
                self.ghosts[h, self.epoch.get(h, 0)] = self.refs[h]
            self.refs[h] = 0
            self.epoch[h] = self.epoch.get(h, 0) + 1
        for h in evicted[len(dropped):]:  # then down to the budget, least recently used first
            unreferenced = [x for x in self.lru if self.refs.get(x, 0) == 0]
            assert unreferenced and h == unreferenced[0]
            self.lru.remove(h)

    @rule()
    def clear(self):
        """vLLM resets the cache: every entry leaves the index; referenced ones keep their
        slots until released, and a hash kept again is a new entry."""
        assert self.pool.clear() == self.lru
        assert self.pool.take_evicted() == self.lru
        for h in self.lru:
            if self.refs.get(h, 0):
                self.ghosts[h, self.epoch.get(h, 0)] = self.refs[h]
            self.refs[h] = 0
            self.epoch[h] = self.epoch.get(h, 0) + 1
        self.lru = []
        assert len(self.pool) == 0 and self.pool.lookup(list("abcdefgh")) == 0

    @rule(hashes=st.lists(st.sampled_from("abcdefghij"), max_size=5))
    def lookup(self, hashes):
        expected = 0
        for h in hashes:
            if h not in self.lru:
                break
            expected += 1
        assert self.pool.lookup(hashes) == expected

    def _sync_evicted(self):
        """What the pool evicted must be the model's least recently used unreferenced."""
        for h in self.pool.take_evicted():
            unreferenced = [x for x in self.lru if self.refs.get(x, 0) == 0]
            assert unreferenced and h == unreferenced[0], (h, self.lru, self.refs)
            self.lru.remove(h)
            self.evictions += 1

    @invariant()
    def one_owner_per_slot(self):
        free = _free(self.map)
        requests = [s for r in self.map._requests.values() for s in [*r.slots.values(), *r.spare]]
        gone = {id(e): e for held in self.pool._held.values() for _, e in held if e.gone}
        assert len(gone) == sum(n > 0 for n in self.ghosts.values())
        pooled = [s for e in [*self.pool._entries.values(), *gone.values()] for s in e.slots]
        assert len(free) + len(requests) + len(pooled) == SLOTS
        assert free | set(requests) | set(pooled) == set(range(SLOTS))

    @invariant()
    def evictions_count_what_was_evicted_or_dropped_never_a_reset(self):
        assert self.pool.evictions == self.evictions

    @invariant()
    def referenced_entries_stay_and_unreferenced_fit_the_budget(self):
        assert list(self.pool._entries) == self.lru
        assert all(h in self.pool for h, n in self.refs.items() if n > 0)
        if self.pool.pooled_slots > self.pool.max_slots:
            assert all(self.refs.get(h, 0) > 0 for h in self.lru)


TestPoolSchedules = PoolMachine.TestCase
TestPoolSchedules.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_the_pool_refuses_bad_arguments_by_name_before_any_change():
    slot_map = SlotMap(8)
    with pytest.raises(InvalidInputError, match="max_slots must be a non-negative int, got -1"):
        Pool(slot_map, -1)
    with pytest.raises(InvalidInputError, match="slots_per_block must be a positive int, got 0"):
        Pool(slot_map, 4, 0)
    with pytest.raises(InvalidInputError, match="'runs' placement"):
        Pool(SlotMap(8, "mirror"), 4)
    pool = Pool(slot_map, 4, 2)
    slot_map.assign("r", [0, 1, 2, 3])
    with pytest.raises(InvalidInputError, match="names 1 keys, a pooled block is 2 slots"):
        pool.keep("r", [("h", [0])])
    with pytest.raises(InvalidInputError, match="name a key twice"):
        pool.keep("r", [("h", [0, 1]), ("g", [1, 2])])
    with pytest.raises(UnknownRequestError, match="no staged kernel blocks"):
        pool.keep("r", [("h", [0, 1]), ("g", [4, 5])])
    assert len(pool) == 0 and slot_map.slots("r", [0, 1, 2, 3]) == [0, 1, 2, 3]
    with pytest.raises(UnknownRequestError, match="holds no block"):
        pool.acquire("o", ["h"])


def test_a_full_pool_evicts_for_a_new_request_and_never_refuses_it():
    slot_map = SlotMap(4)
    pool = Pool(slot_map, max_slots=4)
    slot_map.assign("r", [0, 1, 2, 3])
    assert pool.keep("r", [("a", [0]), ("b", [1]), ("c", [2]), ("d", [3])]) == ["a", "b", "c", "d"]
    slot_map.free("r")
    pool.acquire("lease", ["a"])
    # d and c gave way: a chain's tail is its least recently used part (its head, which a
    # prefix match reaches first, stays longest)
    assert slot_map.assign("s", [0, 1]) == [2, 3]
    assert pool.take_evicted() == ["d", "c"] and pool.lookup(["a", "b", "c"]) == 2
    with pytest.raises(StagingFullError):
        slot_map.assign("t", [0, 1])  # a is held: evicting b would leave it one slot short
    assert pool.take_evicted() == [] and pool.lookup(["a"]) == 1 and "b" in pool
    pool.release("lease")
    assert sorted(slot_map.assign("t", [0, 1])) == [0, 1]
    assert pool.take_evicted() == ["b", "a"] and len(pool) == 0


def test_groups_of_different_block_sizes_match_only_whole_blocks_of_every_group():
    """Each group's pool evicts on its own, so one may hold a run another lacks: a match is
    whole blocks of every group (else its load is refused and the request matched again,
    for ever)."""
    s = PrefillScheduler([GroupSpec(16), GroupSpec(32)], staging_blocks=64, kernel_ratio=1,
                         address=PeerAddress("p", "127.0.0.1", 0), pool_slots=64)
    for req_id, tables, hashes in (
            ("a", ([1, 2, 3, 4], [1, 2]), [["h0", "h1", "h2", "h3"], ["H0", "H1"]]),
            ("b", ([5, 6, 7, 8], [3, 4]), [["h0", "x1", "x2", "x3"], ["Y0", "Y1"]])):
        s.add_request(req_id, 64, block_hashes=hashes)
        s.build_connector_meta([ScheduledRequest(req_id, 0, 64, tables, full_table=True)])
        assert s.request_finished(req_id) is not None
        s.release([req_id])
    s.pools.resize(4)  # group 0 keeps h0 and b's last three; group 1 keeps all four
    assert "h0" in s.pools.pools[0] and "h1" not in s.pools.pools[0]
    assert s.pools.match([["h0", "h1", "h2", "h3"], ["H0", "H1"]], 0) == 0  # 16: not whole
    assert s.pools.match([["h0", "x1", "x2", "x3"], ["Y0", "Y1"]], 0) == 64


@pytest.mark.parametrize("events", [False, True])
def test_a_pools_events_are_kept_only_for_a_taker(events):
    """vLLM's scheduler takes the pool's events every step (and turns them on); a pool used
    without vLLM keeps none, however many requests pass through it."""
    s = PrefillScheduler([GroupSpec(16)], staging_blocks=8, kernel_ratio=1,
                         address=PeerAddress("p", "127.0.0.1", 0), pool_slots=4)
    s.pools.events = events
    for i in range(50):  # a pool of 4 slots: each request's two blocks evict two others
        req_id = f"r{i}"
        s.add_request(req_id, 32, list(range(i, i + 32)), block_hashes=[[f"{i}a", f"{i}b"]])
        s.build_connector_meta([ScheduledRequest(req_id, 0, 32, ([2 * i % 8, 2 * i % 8 + 1],),
                                                 full_table=True)])
        assert s.request_finished(req_id) is not None
        s.release([req_id])
    taken = s.pools.take_events()
    assert s.pools.entries() == 4 and not s.pools._tokens
    if not events:
        assert taken == [] and s.pools._events == []
        return
    stored = [h for e in taken if "stored" in e for h in e["stored"]]
    removed = [h for e in taken if "removed" in e for h in e["removed"]]
    assert len(stored) > 50 and len(stored) - len(removed) == s.pools.entries()
    assert all(len(e["token_ids"]) == 16 * len(e["stored"]) for e in taken if "stored" in e)


@pytest.mark.parametrize("kwargs, named", [
    ({"event_token_ids": [1, 2, 3]}, "event_token_ids must be the prompt's 32 token ids"),
    ({"event_token_ids": "x" * 32}, "event_token_ids must be the prompt's 32 token ids"),
    ({"labels": ["lora"]}, "labels must be None or a mapping"),
])
def test_event_tokens_and_labels_that_cannot_be_the_prompts_are_refused_by_name(kwargs, named):
    s = PrefillScheduler([GroupSpec(16)], staging_blocks=8, kernel_ratio=1,
                         address=PeerAddress("p", "127.0.0.1", 0), pool_slots=4)
    with pytest.raises(InvalidInputError, match=named):
        s.add_request("r", 32, list(range(32)), block_hashes=[["a", "b"]], **kwargs)
    with pytest.raises(InvalidInputError, match="labels must be None or a mapping"):
        s.keep_finished("k", [[0, 1]], [["a", "b"]], list(range(32)), labels="lora")
