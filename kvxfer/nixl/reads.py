"""One read of D's, as its state machine sees it, and the NIXL posts that move its bytes.

`Read` is one request's read (one `Leg` per P agent it reads from), `post`
posts one leg's READ on D's poster thread with `read_descriptors`' NIXL
descriptors, and `Zombies` holds the D slots of failed reads until NIXL
releases their transfers. `kvxfer.nixl.decode` drives them; streams
(`kvxfer.nixl.streams`) too.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvxfer.device.staging import TAG_WORDS, Staging, free_in_all, tags_of
from kvxfer.errors import InvalidInputError, TransferError
from kvxfer.nixl.peers import Peer, Peers
from kvxfer.nixl.wire import ReadParams, StreamParams, is_generation, message_field
from kvxfer.plan.blocks import coalesce_pairs, is_int
from kvxfer.stats import Recorder, Trace

__all__ = ["Arrivals", "Leg", "LegState", "Poster", "Read", "Zombies", "acked", "check_legs",
           "check_new", "post", "posting", "read_descriptors", "release", "say_done", "settle_posts",
           "tags_match", "trace_read", "wait_for_posts"]

logger = logging.getLogger("kvxfer.nixl.decode")


class LegState(enum.Enum):
    """Where one P agent's part of a read stands."""

    XFER = "xfer"  # READ posted (or being posted)
    READ = "read"  # nothing (more) to read; `done` not yet sent
    ACK = "ack"  # `done` sent, waiting for P's ack
    OK = "ok"  # P acked: its part is delivered


@dataclass
class Leg:
    """One P agent's part of a read: what D reads from it, and where its `done` stands."""

    peer: str
    handle: Any = None
    posting: Future | None = None  # the poster thread's `post`, until `_advance` takes its handle
    state: LegState = LegState.XFER
    posted: tuple[float, float, int, int] | None = None  # the poster's (start, end, descs, bytes)


@dataclass
class Read:
    req_id: str  # D's id (the caller's)
    p_req_id: str  # P's id, from the params: what every message to P names
    instance: str
    generation: int
    logical_ids: list[int]
    deadline: float
    legs: dict[str, Leg] = field(default_factory=dict)  # every P agent holding a piece
    started: float = field(default_factory=time.monotonic)
    params: ReadParams | None = None
    plan: dict[str, tuple[int, int] | None] = field(default_factory=dict)  # units per P agent
    waiting: bool = True  # for its peers: nothing posted yet
    d_slots: list[list[int]] = field(default_factory=list)  # per group, D's slots of `params.keys`
    trace: Trace | None = None
    mark: float = 0.0  # when the stage under way began (posted, done sent)
    stream: StreamParams | None = None  # streamed: P names its blocks chunk by chunk
    skip: list[int] = field(default_factory=list)  # streamed: per group, keys below are D's own
    prompt: str | None = None  # D's prompt digest, if known: tags are checked under it
    hashes: list[list[str]] | None = None  # per group, by kernel position: D's block hashes
    secret: str = ""  # streamed: the request's, from its first chunk
    token: str = ""  # its `done_token`, what its `done` and heartbeats carry (once known)
    chunks: list[ReadParams] = field(default_factory=list)  # streamed: named, not yet posted
    last: bool = False  # streamed: P named its last chunk
    wait_until: float = 0.0  # streamed: the latest P's `wait` may move the deadline to
    reconnected: bool = False  # streamed: its `want` found the connection gone, and D reconnected
    landed: bool = False  # its posted READs are done, their blocks not yet checked


class Zombies:
    """Failed reads whose transfers NIXL has not released: a READ could still land, so their
    D slots are freed only once NIXL releases every one."""

    def __init__(self, stagings: Sequence[Staging]):
        self.stagings = stagings
        self._held: list[tuple[str, Any]] = []  # (request, NIXL transfer handle)

    def __contains__(self, req_id: object) -> bool:
        return any(r == req_id for r, _ in self._held)

    def bury(self, req_id: str, handles: Sequence[Any]) -> None:
        """Release a failed read's transfers; its slots are freed once all are released."""
        held = [h for h in handles if h is not None and not release(h)]
        if held:
            self._held += [(req_id, h) for h in held]
        else:
            free_in_all(self.stagings, req_id)

    def reap(self) -> None:
        still = [(req_id, h) for req_id, h in self._held if not release(h)]
        for req_id in {r for r, _ in self._held} - {r for r, _ in still}:
            free_in_all(self.stagings, req_id)
        self._held = still


class Poster(ThreadPoolExecutor):
    """D's poster thread: posts READs (`post`) so the engine's thread never holds the agent."""

    def __init__(self, name: str):
        super().__init__(1, thread_name_prefix=f"kvxfer-post-{name}")

    def post(self, post: Callable[..., Any], *args: Any, idle: bool) -> Future:
        """`post(*args)` on the poster thread; when it is `idle`, hand it the GIL now: an
        engine thread that spins (polling) would otherwise keep it waiting a whole GIL
        switch interval (5 ms) before the READ even starts."""
        started = threading.Event()

        def run() -> Any:
            started.set()
            return post(*args)

        future = self.submit(run)
        if idle:
            started.wait(0.002)
        return future


POST_WAIT_S = 0.0005
"""How long `wait_for_posts` lets the poster thread run before the engine's thread goes on."""


def wait_for_posts(reads: Iterable[Read], timeout: float = POST_WAIT_S) -> bool:
    """Wait, up to `timeout` seconds, for the posts under way on the poster thread; whether
    one still is (`posting`, without looking again).

    An engine polls D every step; while a READ is being posted, a poll that returned at once
    would have the engine's thread spin, holding the GIL the poster thread needs (a GIL
    switch takes up to 5 ms, longer the more threads a many-core host runs). Waiting on the
    posts' futures gives it up, and returns as soon as they are done."""
    under_way = [leg.posting for read in reads for leg in read.legs.values()
                 if leg.posting is not None and not leg.posting.done()]
    return bool(under_way) and bool(futures.wait(under_way, timeout=timeout).not_done)


def posting(reads: Iterable[Read]) -> bool:
    """Whether the poster thread is inside NIXL. Over UCX `cma` a post copies the bytes
    while holding the agent, so any NIXL call from the engine's thread would wait for the
    whole copy: `poll` leaves the agent alone until it is done (notifications wait in UCX;
    deadlines are checked at the next poll)."""
    return any(leg.posting is not None and not leg.posting.done()
               for read in reads for leg in read.legs.values())


def trace_read(read: Read, recorder: Recorder) -> None:
    """Every leg's READ is done: the `read` stage, from the first post to now, with what the
    posts moved (the poster wrote `posted` into each leg before its future was done); a
    stream's reads add up in one."""
    posted = [leg.posted for leg in read.legs.values() if leg.posted is not None]
    read.trace.extend("read", min((t0 for t0, _, _, _ in posted), default=read.mark))
    for t0, t1, descriptors, nbytes in posted:
        recorder.observe("d_post_s", t1 - t0)
        read.trace.descriptors += descriptors
        read.trace.wire_bytes += nbytes
    read.mark = time.monotonic()


def settle_posts(read: Read, who: str) -> None:
    """Cancel a failed read's posts not started and wait for those under way, so every leg's
    transfer handle is known."""
    pending = [leg.posting for leg in read.legs.values()
               if leg.posting is not None and not leg.posting.cancel()]
    futures.wait(pending)
    for leg in read.legs.values():
        posting, leg.posting = leg.posting, None
        if posting is None or posting.cancelled():
            continue
        if posting.exception() is not None:
            logger.warning("D %s: posting the READ of %s from %s failed: %s", who, read.req_id,
                           leg.peer, posting.exception())
        else:
            leg.handle = posting.result()


def post(agent: Any, leg: Leg, descriptors: Callable[[], tuple[np.ndarray, np.ndarray]],
          req_id: str, who: str) -> Any:
    """Post one READ from `leg.peer` of `descriptors()` (on D's poster thread); returns its
    transfer handle. Writes only `leg.posted`, which the engine's thread reads once done."""
    start, peer = time.monotonic(), leg.peer
    local, remote = descriptors()
    handle = agent.initialize_xfer("READ", agent.get_xfer_descs(local, "DRAM"),
                                   agent.get_xfer_descs(remote, "DRAM"), peer)
    try:
        state = agent.transfer(handle)
    except Exception as e:  # part of it may be posted: `_advance` finds it in error
        logger.warning("D %s: NIXL raised posting the READ of %s from %s: %s", who, req_id,
                       peer, e)
        return handle
    if state == "ERR":
        release(handle)
        raise TransferError(f"NIXL refused the READ of {req_id!r} from {peer!r}")
    leg.posted = (start, time.monotonic(), len(local), int(local[:, 1].sum()))
    logger.debug("D %s posted READ of %s from %s (%s descriptors)", who, req_id, peer,
                 len(local))
    return handle


def tags_match(stagings: Sequence[Staging], read: Read) -> bool:
    """Whether every slot read holds the block its params name: the tags P wrote with the
    request's secret (or a pool entry's, `ReadParams.entries`) at each block's position
    (`kvxfer.device.staging.block_tags`), bound to what the block holds as D knows it (its
    own prompt digest and block hashes: `ReadParams.tag_secrets`). Where they match, the
    slots keep those secrets to open what P sealed (`kvxfer.device.seal.opened`)."""
    p, checked = read.params, []
    for g, (staging, keys, slots) in enumerate(zip(stagings, p.keys, read.d_slots)):
        if not keys:
            continue
        bound = p.tag_secrets(g, read.prompt, read.hashes[g] if read.hashes else None)
        rows = staging.tags[slots]
        if not np.array_equal(rows[:, :TAG_WORDS], tags_of(bound, g, keys)):
            return False
        checked.append((staging, slots, bound, rows[:, TAG_WORDS:].any(axis=1)))
    for staging, slots, bound, sealed in checked:  # only a sealed slot needs its secret
        staging.secrets.update((s, b) for s, b, x in zip(slots, bound, sealed) if x)
    return True


def release(handle: Any) -> bool:
    """Release a NIXL transfer; whether NIXL let it go (a READ in flight may not)."""
    try:
        handle.release()
        return True
    except Exception:
        return False


def read_descriptors(peer: Peer, stagings: Sequence[Staging], piece: tuple[int, int, int],
                 p_slots: Sequence[Sequence[int]], d_slots: Sequence[Sequence[int]],
                 span: tuple[int, int], tags: bool) -> tuple[np.ndarray, np.ndarray]:
    """`(local, remote)` NIXL descriptors `[n, 3]` (address, length, device) of one READ.

    Units `span` of every slot of every group: the blocks, then the fingerprint
    rows of the same slots, and with `tags` the slots' whole tags; one
    descriptor per run of slots contiguous on both sides where a slot is read
    whole, else one per slot.
    """
    theirs_piece, ours_piece = peer.piece, piece
    local, remote = [], []
    for theirs, ours, ps, ds in zip(peer.groups, stagings, p_slots, d_slots, strict=True):
        if not ps:
            continue
        # Blocks, then the fingerprint rows of the same slots; per unit, `size` bytes.
        p_row = theirs.prints[1] // theirs.num_slots
        for p_bases, d_bases, p_stride, d_stride in (
                ([a for a, _ in theirs.regions], [a for a, _ in ours.region_addresses()],
                 theirs.block_bytes, ours.block_bytes),
                ([theirs.prints[0]], [ours.prints_address()[0]], p_row,
                 ours.prints.strides[0])):
            size = d_stride // (ours_piece[1] - ours_piece[0])
            length = (span[1] - span[0]) * size
            whole = length == p_stride == d_stride  # slot runs coalesce
            runs = np.asarray(coalesce_pairs(ps, ds) if whole
                              else [(a, b, 1) for a, b in zip(ps, ds)],
                              dtype=np.uint64).reshape(-1, 3)
            lengths = runs[:, 2] * length
            p_off = (span[0] - theirs_piece[0]) * size
            d_off = (span[0] - ours_piece[0]) * size
            for p_base, d_base in zip(p_bases, d_bases, strict=True):
                remote.append(np.stack([p_base + p_off + runs[:, 0] * p_stride, lengths,
                                        0 * lengths], 1))
                local.append(np.stack([d_base + d_off + runs[:, 1] * d_stride, lengths,
                                       0 * lengths], 1))
        if tags:
            row = ours.tags.strides[0]
            runs = np.asarray(coalesce_pairs(ps, ds), dtype=np.uint64).reshape(-1, 3)
            remote.append(np.stack([theirs.tags[0] + runs[:, 0] * row, runs[:, 2] * row,
                                    0 * runs[:, 2]], 1))
            local.append(np.stack([ours.tags_address()[0] + runs[:, 1] * row, runs[:, 2] * row,
                                   0 * runs[:, 2]], 1))
    return np.concatenate(local), np.concatenate(remote)


class Arrivals:
    """The blocks of each read that landed in D's staging and checked (their tags), per
    request and group, reported to D's caller as they arrive (`take`), before the read is
    finished: the caller may write them out while `done` and its ack travel."""

    def __init__(self, stagings: Sequence[Staging], recorder: Recorder, who: str):
        self.stagings, self.recorder, self.who = stagings, recorder, who
        self._arrived: dict[str, list[list[int]]] = {}  # req -> per group, keys read and checked

    def take(self) -> dict[str, list[list[int]]]:
        """What arrived since the last call."""
        arrived, self._arrived = self._arrived, {}
        return arrived

    def forget(self, req_id: str) -> None:
        """A failed read's blocks are not reported."""
        self._arrived.pop(req_id, None)

    def check(self, read: Read) -> bool:
        """Check the blocks `read`'s last READs brought (their tags) and keep them to report;
        False if a tag does not match (the slots at P do not hold the request's blocks)."""
        if not (read.landed or (read.params is not None and not read.stream
                                and read.trace.phases[-1][0] == "connect")):  # none to read
            return True
        read.landed = False
        trace_read(read, self.recorder)
        if not tags_match(self.stagings, read):
            logger.warning("D %s refuses %s: its slots at P do not hold its blocks (params "
                           "altered, or not its own)", self.who, read.req_id)
            return False
        arrived = self._arrived.setdefault(read.req_id, [[] for _ in self.stagings])
        for into, keys in zip(arrived, read.params.keys):
            into += keys
        return True


def check_new(req_id: str, logical_ids: object, reads: Mapping[str, Read], zombies: Zombies,
              stagings: Sequence[Staging]) -> None:
    """Refuse a read of a request D is reading, or whose slots it has not freed yet, or
    whose logical ids (what a failure reports) are not block ids."""
    if not isinstance(logical_ids, Sequence) or not all(
            is_int(b) and b >= 0 for b in logical_ids):
        raise InvalidInputError(f"logical_ids of {req_id!r} must be a list of non-negative "
                                f"int block ids, got {logical_ids!r:.80}")
    if req_id in reads or req_id in zombies:
        raise InvalidInputError(f"request {req_id!r} is already being read")
    if any(req_id in s for s in stagings):
        raise InvalidInputError(
            f"request {req_id!r} still holds D staging from an earlier read; free it first")


def check_legs(read: Read, agent: Any, who: str) -> tuple[str, str] | None:
    """Move each leg of `read` whose READ was posted on: to `READ` once NIXL says it is
    done. Returns `(peer, why)` for the first leg whose post or transfer failed, else None."""
    for leg in read.legs.values():
        if leg.state is not LegState.XFER:
            continue
        if leg.posting is not None:
            if not leg.posting.done():
                continue
            posting, leg.posting = leg.posting, None
            try:
                leg.handle = posting.result()
            except Exception as e:
                return leg.peer, f"posting the READ of {read.req_id} failed: {e}"
        try:
            state = agent.check_xfer_state(leg.handle)
        except Exception as e:
            logger.warning("D %s xfer state of %s: %s", who, read.req_id, e)
            state = "ERR"
        if state == "DONE":
            release(leg.handle)
            leg.handle, leg.state, read.landed = None, LegState.READ, True
        elif state == "ERR":
            return leg.peer, f"READ of {read.req_id} failed"
    return None


def acked(reads: Mapping[str, Read], sender: str, msg: dict[str, Any]) -> tuple[Read | None, bool]:
    """The read P agent `sender`'s `ack` answers (None: none waits for it) and whether P
    still held it (`ok`). Raises `TransferError` for a malformed ack."""
    req_id = message_field(msg, "req_id", lambda v: isinstance(v, str), "a str", sender)
    generation = message_field(msg, "generation", is_generation, "a positive int", sender)
    ok = message_field(msg, "ok", lambda v: isinstance(v, bool), "a bool", sender)
    read = next((r for r in reads.values() if r.p_req_id == req_id
                 and sender in r.legs and r.generation == generation), None)
    if read is None or read.legs[sender].state is not LegState.ACK:
        return None, ok
    return read, ok


def say_done(read: Read, peers: Peers, reader: tuple[int, int]) -> tuple[str, str] | None:
    """Say `done` to each P agent whose READ of `read` landed, and wait for its ack; returns
    `(peer, why)` for the first agent it could not be said to, else None."""
    for leg in read.legs.values():
        if leg.state is LegState.READ:
            try:
                peers.send_done(leg.peer, read.p_req_id, read.instance, read.generation,
                                read.token, reader)
            except TransferError as e:
                return leg.peer, str(e)
            leg.state = LegState.ACK
    return None
