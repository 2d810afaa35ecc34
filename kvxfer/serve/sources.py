"""What a conversation's next turn on P reads from a peer: `kvxfer proxy --peer-reads`.

A turn that goes through P (its new message is longer than `--local-prefill-tokens`, or
local prefill is off) finds P without the previous answer: only the D that decoded it holds
that, in its device cache and host pool. With `--peer-reads` (every P and D started with
`kv_role` `kv_both`, each D with a NIXL listener of its own: `scripts/pd-up`'s
`PD_PEER_READS`), the proxy asks that D for the conversation so far as a prefill of its own:
a one-token request of that prefix's token ids with `do_remote_decode` (the lookup), which
D's caches answer, computing only what they lack (at least the prefix's last token). D's
`kv_transfer_params` go to P as `kv_source`: P reads that prefix from D and computes only the
rest, and takes it only where the prefix's token digest and block hash chain (its cache
salt included) are its prompt's own (`kvxfer.vllm`). Where the router chose a P other than
the one it expects to hold the most of a prompt (by load), that other P is looked up the same
way (`kvxfer.serve.proxy._holder`). A lookup is made where it reads at least
`MIN_READ_TOKENS` past what the router expects the chosen P to hold already; one that fails
for any reason leaves P to compute the prompt, as without `--peer-reads`.

What D holds is remembered per session (`X-Session-Id`, scoped to the client's
`Authorization` and `cache_salt` as routing scopes it; sessions only): the D that answered its
last turn, that turn's prompt in token ids (its length and digest; the proxy asks an
instance's `/tokenize` for them, once a request) and its answer's length, the
`completion_tokens` of the usage at the end of D's answer. A non-streamed answer has it; for
a streamed one the proxy asks D for it (`usage_asked`) where the client did not, and takes
that event out of what the client gets (`Relayed`). Without it the lookup covers the
previous prompt alone, and P computes the answer again.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from kvxfer.plan.blocks import is_int

__all__ = ["DROP_USAGE", "MIN_READ_TOKENS", "TAIL", "Held", "Relayed", "Turn", "completion_tokens",
           "token_ids", "usage_asked"]

log = logging.getLogger(__name__)

MIN_READ_TOKENS = 64
"""The shortest prefix worth a lookup (one block of tpu-inference's default size): below it
P computes the prompt, as its own caches would."""

LOOKUP_TIMEOUT_S = 5.0
"""How long a lookup may take (D's queue, its step, its staging): past it P computes the
prompt (D's lease on what it staged lapses at its `lease_s`)."""

MAX_TOKENIZE_BYTES = 16 << 20
"""The most of a `/tokenize` answer read: the ids of a prompt of about two million tokens."""

MAX_SESSIONS = 65536
"""Sessions remembered, least recently used dropped first."""

TAIL_BYTES = 4096
"""Of D's answer, the last bytes kept to read its usage from."""

_TOKENIZE_KEYS = ("model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                  "continue_final_message", "chat_template", "chat_template_kwargs", "tools",
                  "mm_processor_kwargs")
"""The keys of a completion's body that vLLM's `/tokenize` reads to tokenize it alike."""

_COMPLETION_TOKENS = re.compile(rb'"completion_tokens"\s*:\s*(\d{1,9})(?!\d)')

MAX_EVENT_BYTES = 1 << 20
"""The longest event of a streamed answer held back to be read (`Relayed`): past it the
rest of the answer is passed on as it comes."""

_EVENT_END = re.compile(rb"(\r?\n\r?\n)")
_FINISHED = re.compile(rb'"finish_reason"\s*:\s*"')

TAIL = web.ResponseKey("tail", bytes) if hasattr(web, "ResponseKey") else "tail"
"""Where an answer relayed to its end keeps its last `TAIL_BYTES` (aiohttp's keys since 3.12, a
str before); one ended before its end has none."""
DROP_USAGE = web.RequestKey("drop_usage", bool) if hasattr(web, "RequestKey") else "drop_usage"
"""Set on a client's request whose streamed answer the proxy asked D's usage for and the
client did not (`usage_asked`): `Relayed` takes that event out."""


@dataclass(frozen=True)
class Turn:
    """A session's last turn: `url`, the D that answered it; `tokens` and `digest`, its
    prompt's length and digest in token ids; `answer`, its answer's tokens (0: unknown)."""

    url: str
    tokens: int
    digest: str
    answer: int

    def prefix(self, ids: list[int]) -> int:
        """The tokens of the prompt `ids` the D of this turn holds: the last turn's prompt and
        answer (but the answer's last token, whose KV it never computed), where `ids` starts
        with that prompt; at most all but the last of `ids`; 0 where `ids` goes another way."""
        if len(ids) <= self.tokens or _digest(ids[: self.tokens]) != self.digest:
            return 0
        return min(self.tokens + max(self.answer - 1, 0), len(ids) - 1)


class Held:
    """What each session's D holds (`Turn`), the `MAX_SESSIONS` used last."""

    def __init__(self) -> None:
        self._turns: OrderedDict[str, Turn] = OrderedDict()

    def get(self, session: str | None) -> Turn | None:
        key = _key(session) if session is not None else None
        turn = self._turns.get(key) if key is not None else None
        if turn is not None:
            self._turns.move_to_end(key)
        return turn

    def remember(self, session: str, url: str, ids: list[int], answer: int | None) -> None:
        key = _key(session)  # a digest: a client's long header or salt is not kept
        self._turns[key] = Turn(url, len(ids), _digest(ids), answer or 0)
        self._turns.move_to_end(key)
        while len(self._turns) > MAX_SESSIONS:
            self._turns.popitem(last=False)


def _key(session: str) -> str:
    return hashlib.blake2b(session.encode(errors="replace"), digest_size=16).hexdigest()


def _digest(ids: list[int]) -> str:
    return hashlib.blake2b(repr(ids).encode(), digest_size=16).hexdigest()


def completion_tokens(tail: bytes | None) -> int | None:
    """The `completion_tokens` of the last usage in the end of an answer, if any."""
    found = _COMPLETION_TOKENS.findall(tail or b"")
    return int(found[-1]) if found else None


async def token_ids(session: aiohttp.ClientSession, url: str, body: dict[str, Any],
                    headers: dict[str, str], timeout_s: float) -> list[int] | None:
    """The prompt of a completion's `body` in token ids, as the instance at `url` tokenizes
    it (`/tokenize`); None where it cannot say (logged: the turn is then not remembered)."""
    if isinstance(body.get("prompt"), list) and body["prompt"] and all(
            is_int(t) for t in body["prompt"]):
        return list(body["prompt"])
    sent = {k: body[k] for k in _TOKENIZE_KEYS if k in body}
    if "messages" in sent:
        sent.setdefault("add_generation_prompt", True)  # as a chat completion renders it
    try:
        async with session.post(url + "/tokenize", json=sent, headers=headers,
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            data = bytearray()
            while resp.status == 200 and len(data) <= MAX_TOKENIZE_BYTES and (
                    chunk := await resp.content.read(MAX_TOKENIZE_BYTES + 1 - len(data))):
                data += chunk
        answer = json.loads(data) if 0 < len(data) <= MAX_TOKENIZE_BYTES else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, RecursionError) as e:
        log.warning("peer reads: %s/tokenize failed (%s); the turn is not remembered", url, e)
        return None
    ids = answer.get("tokens") if isinstance(answer, dict) else None
    if not isinstance(ids, list) or not all(is_int(t) for t in ids):
        log.warning("peer reads: %s/tokenize gave no token ids; the turn is not remembered", url)
        return None
    return ids


def usage_asked(body: dict[str, Any]) -> dict[str, Any] | None:
    """`body` asking for its usage at the end of the stream, where it streams one choice
    and says it does not want the usage (`include_usage` absent, null or false), the client's
    other `stream_options` kept, usage at the end only; None where its answer has it already
    (or may: any other `include_usage`, which vLLM may read as true), its usage would sum
    several choices, or `body` is D's to refuse (`stream_options` not an object)."""
    options = body.get("stream_options")
    if body.get("stream") is not True or body.get("n") not in (None, 1) or not isinstance(
            options, dict | None) or (options or {}).get("include_usage") not in (None, False):
        return None
    return {**body, "stream_options": {**(options or {}), "include_usage": True,
                                       "continuous_usage_stats": False}}


class Relayed:
    """D's answer as the proxy relays it: `feed` each chunk, send what it returns, then `rest`;
    `tail` keeps its last `TAIL_BYTES` (where its usage is).

    Where the client's request is marked `DROP_USAGE` (and D streams it), the answer's usage
    event (`"choices": []` beside `"usage"`, which `usage_asked` asked for) is taken out, and
    its `system_fingerprint` goes to the events before it that end a choice (a
    `finish_reason`), where vLLM puts it when no usage was asked for: those are held until
    the next event. An event is passed on once whole; past `MAX_EVENT_BYTES` what is held of
    one is passed on (the rest of it as it comes), and the events after it are read again.
    Usage beside a choice means the server gives every client usage (vLLM's
    `--enable-force-include-usage`): from then on the answer is passed on as it is."""

    def __init__(self, request: web.Request, resp: aiohttp.ClientResponse) -> None:
        self.tail = b""
        self._drops = bool(request.get(DROP_USAGE)) and resp.status == 200 and (
            resp.content_length is None and resp.content_type == "text/event-stream")
        self._held = bytearray()  # an event begun
        self._ends: list[bytes] = []  # events that end a choice, each with its end
        self._long = False  # what is held is the rest of an event passed on in part
        self._forced = False  # the server gives every client usage: nothing to take out

    def feed(self, chunk: bytes) -> bytes:
        self.tail = (self.tail + chunk)[-TAIL_BYTES:]
        if not self._drops:
            return chunk
        start = max(len(self._held) - 3, 0)  # an event's end may straddle the chunks
        self._held += chunk
        sent = []
        if _EVENT_END.search(self._held, start):
            *whole, rest = _EVENT_END.split(bytes(self._held))  # events and their ends
            self._held = bytearray(rest)
            for event, end in zip(whole[0::2], whole[1::2]):
                sent.append(event + end if self._long else self._event(event, end))
                self._long = False  # the end of an event passed on in part: passed on unread
        if len(self._held) > MAX_EVENT_BYTES:
            sent.append(self._passed())
            self._long = True
        return b"".join(sent)

    def rest(self) -> bytes:
        return self._passed() if self._drops else b""

    def _event(self, event: bytes, end: bytes) -> bytes:
        """What to send for one whole event now."""
        data = None if self._forced else _with_usage(event)
        if data is not None and data.get("choices") == []:  # the usage event: dropped
            ends, self._ends = self._ends, []
            return b"".join(_stamped(e, data.get("system_fingerprint")) for e in ends)
        if data is not None:  # usage beside a choice: the server forces it on every client
            self._forced = True  # (vLLM's --enable-force-include-usage): dropped from none
        if not self._forced and _FINISHED.search(event):
            self._ends.append(event + end)
            return b""
        return self._passed(held=False) + event + end

    def _passed(self, held: bool = True) -> bytes:
        """The events held back unchanged (and what is held of an event begun)."""
        out, self._ends = b"".join(self._ends), []
        if held:
            out, self._held = out + bytes(self._held), bytearray()
        return out


def _stamped(event_and_end: bytes, fingerprint: Any) -> bytes:
    """An event with `system_fingerprint` added to its JSON object, where it has none."""
    body = event_and_end.rstrip(b"\r\n")
    at = body.rfind(b"}")
    if not isinstance(fingerprint, str) or at < 0 or b'"system_fingerprint"' in body:
        return event_and_end
    return (body[:at] + b', "system_fingerprint": ' + json.dumps(fingerprint).encode()
            + event_and_end[at:])


def _with_usage(event: bytes) -> dict[str, Any] | None:
    """The object of an event that carries a `"usage"` object, else None."""
    line = event.strip()
    if not line.startswith(b"data:") or b'"usage"' not in line:
        return None
    try:
        data = json.loads(line[5:])
    except (ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("usage"), dict) else None
