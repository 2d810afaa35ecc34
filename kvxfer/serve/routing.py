"""Which P and which D a request goes to, and when D prefills it alone: `kvxfer proxy`'s policy.

The proxy remembers, per instance, the prompts it answered, as a chain of span hashes
(`Prompt`): 16 token ids a span for a prompt given as ids, 64 bytes of text (about 16
tokens) for a text prompt or a chat's messages. A new request's expected hit on an
instance is its longest run of leading spans that instance answered, in tokens (text at 4
bytes a token). It is an estimate for choosing, never a claim on KV: what an instance
reuses is decided by its own vLLM, by block hash.

`Router.choose`, with the `prefix` policy:

- The candidates are the instances not marked down (`mark`; all of them when every one is).
- Among the candidates whose requests in flight are at most `imbalance` over the least
  loaded one's: the one the client's session (`X-Session-Id`) went to last; else the one
  with the longest expected hit; ties go in turn (round robin), so unrelated prompts
  spread as before.
- D is chosen first; when its expected hit leaves at most `local_prefill_tokens` of the
  prompt, and no P is expected to hold more of it, P is skipped and D prefills that suffix
  itself (a local prefill, `local`: vLLM on D finds the rest in its prefix cache). Else P
  is chosen the same way over P's memory of the prompts it prefilled (its device cache and
  host pool hold them).

- With `decode_slots` (each D's decode batch, its `--max-num-seqs`), a D with that many
  requests in flight is full: a request for it would wait for a slot. It is then served
  whole (`whole`, reason `d_full`) by a P with fewer than `whole_slots` requests in flight,
  the one expected to hold most of the prompt (the session's, when it went whole there
  last): P is then a colocated instance whose decode capacity would otherwise idle between
  prefills. With every P as full, the request goes to D as it would have and waits there.
- With `prefill_queue`, a request whose chosen P already has that many requests in flight
  (prefilling for D, or served whole) is prefilled by its D itself (`local`, reason
  `p_busy`) while D has a slot: D is then a colocated instance whose core would otherwise
  wait for P's queue.

An instance remembers a prompt once it has answered it (`answered`): requests in flight
at once that share a prefix none has yet all go through P, since D holds nothing of it
before the first is done. The `round_robin` policy takes P and D in turn, each
independently, as the proxy did before it had a policy. Each decision is counted by choice
and reason (`counts`).
Memory is bounded: each instance keeps at most `index_spans` span hashes (least recently
used go first), and no more than its KV cache holds once that is known (`holds`: the proxy
reads it from the instance's `vllm:cache_config_info`), so that a prompt its vLLM has
likely evicted is not counted as held; a prompt is read up to `MAX_SPANS` spans; and the
sessions remembered are at most `MAX_SESSIONS`.
"""

from __future__ import annotations

import json
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvxfer.errors import InvalidInputError
from kvxfer.plan.blocks import is_int

__all__ = ["POLICIES", "Prompt", "Route", "Router"]

POLICIES = ("prefix", "round_robin")
IDS_PER_SPAN = 16
"""Token ids a span of a prompt given as ids."""
BYTES_PER_SPAN = 64
"""UTF-8 bytes a span of a text prompt or of a chat's messages."""
BYTES_PER_TOKEN = 4
"""The estimate of text's bytes a token (English under BPE tokenizers is about 4)."""
MAX_SPANS = 16384
"""The most spans of one prompt read: 256k tokens as ids, 1 MiB of text."""
MAX_SESSIONS = 65536
"""Sessions remembered, least recently used dropped first."""


@dataclass(frozen=True)
class Prompt:
    """A request's prompt as the router sees it: `chain`, the hash of each whole span with
    everything before it; `tokens`, the prompt's length in tokens (estimated for text);
    `per_span`, tokens a span."""

    chain: tuple[int, ...]
    tokens: int
    per_span: int

    @staticmethod
    def of(path: str, body: dict[str, Any]) -> Prompt | None:
        """The prompt of a `/v1/completions` or `/v1/chat/completions` body; None for one the
        router does not read (a batch of prompts, a missing or malformed one: vLLM answers it).
        The chain starts from the body's `model` and `cache_salt`: as in vLLM's block hashes,
        prompts under another model (a LoRA adapter) or another tenant's salt never match."""
        root = hash(tuple(_key(body.get(k)) for k in ("model", "cache_salt")))
        try:
            if path.endswith("/chat/completions"):
                messages = body.get("messages")
                if not isinstance(messages, list):
                    return None
                return _text_prompt(root, "".join(_message(m) for m in messages))
            prompt = body.get("prompt")
        except (RecursionError, ValueError):  # content JSON will not write again: unread
            return None
        if isinstance(prompt, str):
            return _text_prompt(root, prompt)
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            spans = [tuple(prompt[i:i + IDS_PER_SPAN])
                     for i in range(0, min(len(prompt), MAX_SPANS * IDS_PER_SPAN), IDS_PER_SPAN)]
            return Prompt(_chain(root, (c for c in spans if len(c) == IDS_PER_SPAN)), len(prompt),
                          IDS_PER_SPAN)
        return None


def _key(value: Any) -> str | tuple[str, str] | None:
    """`model` or `cache_salt` as part of a chain's root: no salt and the salt `"None"` differ,
    and a value vLLM would refuse (not a string) is never written out."""
    return value if value is None or isinstance(value, str) else ("?", type(value).__name__)


def _message(message: Any) -> str:
    """One chat message as text that is a prefix-stable piece of the conversation's."""
    if not isinstance(message, dict):
        return json.dumps(message, sort_keys=True, default=str) + "\x1e"
    content = message.get("content")
    if not isinstance(content, str):
        content = json.dumps(content, sort_keys=True, default=str)
    return f"{message.get('role')}\x1f{content}\x1e"


def _text_prompt(root: int, text: str) -> Prompt:
    data = text.encode("utf-8", "surrogatepass")
    end = min(len(data), MAX_SPANS * BYTES_PER_SPAN) // BYTES_PER_SPAN * BYTES_PER_SPAN
    return Prompt(_chain(root, (data[i:i + BYTES_PER_SPAN] for i in range(0, end, BYTES_PER_SPAN))),
                  -(-len(data) // BYTES_PER_TOKEN), BYTES_PER_SPAN // BYTES_PER_TOKEN)


def _chain(root: int, spans) -> tuple[int, ...]:
    out, parent = [], root
    for span in spans:
        parent = hash((parent, span))
        out.append(parent)
    return tuple(out)


@dataclass(frozen=True)
class Route:
    """Where one request goes: `prefill`, P's URL (None when D prefills alone); `decode`, D's
    (with `whole`, the P that serves the request whole); `expected_hit`, the tokens of the
    prompt the chosen D (or, through P, P) is expected to hold; `reason`, why D was chosen
    (`session`, `prefix`, `turn`, `round_robin`), `p_unreachable` when D prefills alone
    because P could not be reached, `d_unreachable` when the D first chosen could not be, or
    `d_full` when a P serves it whole."""

    prefill: str | None
    decode: str
    expected_hit: int
    reason: str
    whole: bool = False

    @property
    def choice(self) -> str:
        """`whole` when a P serves it whole, `local` when D prefills alone, else `pd`."""
        return "whole" if self.whole else "pd" if self.prefill is not None else "local"

    def header(self) -> str:
        """The answer's `X-Kvxfer-Route` value."""
        return (f"choice={self.choice}; prefill={self.prefill or '-'}; decode={self.decode}; "
                f"expected_hit={self.expected_hit}; reason={self.reason}")


class _Instances:
    """One role's instances: what each was sent, its requests in flight, whether it is down."""

    def __init__(self, urls: Sequence[str], index_spans: int) -> None:
        self.urls = tuple(urls)
        self.index_spans = index_spans
        self.sent: dict[str, OrderedDict[int, None]] = {u: OrderedDict() for u in self.urls}
        self.in_flight: Counter[str] = Counter()
        self.capacity: dict[str, int] = {}  # url -> tokens its KV cache holds, once known
        self.down: set[str] = set()
        self.turn = 0

    def hit(self, url: str, prompt: Prompt | None) -> int:
        """`prompt`'s expected hit on `url`, in tokens."""
        if prompt is None:
            return 0
        sent, n = self.sent[url], 0
        while n < len(prompt.chain) and prompt.chain[n] in sent:
            n += 1
        return min(n * prompt.per_span, prompt.tokens)

    def remember(self, url: str, prompt: Prompt | None) -> None:
        if prompt is None:
            return
        sent = self.sent[url]
        for h in reversed(prompt.chain):  # the start most recent: it goes last, as vLLM evicts
            sent[h] = None                 # a request's blocks from its end
            sent.move_to_end(h)
        self.trim(url)

    def trim(self, url: str) -> None:
        """Forget the least recently answered spans of `url` beyond its `bound`."""
        sent, bound = self.sent[url], self.bound(url)
        while len(sent) > bound:
            sent.popitem(last=False)

    def bound(self, url: str) -> int:
        """The most spans kept for `url`: `index_spans`, or fewer when its KV cache is known
        to hold fewer tokens (`Router.holds`)."""
        tokens = self.capacity.get(url)
        return self.index_spans if tokens is None else max(1, min(self.index_spans,
                                                                  tokens // IDS_PER_SPAN))

    def candidates(self, imbalance: int) -> list[str]:
        """The instances up and within `imbalance` of the least loaded, in turn order."""
        up = [u for u in self.urls if u not in self.down] or list(self.urls)
        least = min(self.in_flight[u] for u in up)
        n = len(self.urls)
        ordered = [self.urls[(self.turn + i) % n] for i in range(n)]
        return [u for u in ordered if u in up and self.in_flight[u] <= least + imbalance]

    def take(self, url: str) -> str:
        """`url`, moving the turn past it."""
        self.turn = (self.urls.index(url) + 1) % len(self.urls)
        return url


class Router:
    """The proxy's routing state and policy (see the module's docstring).

    **Arguments:** `prefill`, `decode`: the instances' base URLs; `policy`, one of
    `POLICIES`; `local_prefill_tokens`, the longest suffix D prefills alone (0: never);
    `imbalance`, how many more requests in flight than the least loaded instance a prefix or
    session may choose; `index_spans`, span hashes kept per instance; `decode_slots`, each
    D's decode batch, and `whole_slots`, the requests each P may have in flight while it
    serves one whole (0 for either: none is served whole); `prefill_queue`, the requests in
    flight on the chosen P from which its D, with a slot free, prefills the request itself
    (0: never).
    """

    def __init__(self, prefill: Sequence[str], decode: Sequence[str], policy: str = "prefix",
                 local_prefill_tokens: int = 0, imbalance: int = 4,
                 index_spans: int = 1 << 17, decode_slots: int = 0,
                 whole_slots: int = 0, prefill_queue: int = 0) -> None:
        if policy not in POLICIES:
            raise InvalidInputError(f"--route must be one of {', '.join(POLICIES)}, got {policy!r}")
        for flag, value, low in (("--local-prefill-tokens", local_prefill_tokens, 0),
                                 ("--route-imbalance", imbalance, 0),
                                 ("index_spans", index_spans, 1),
                                 ("--decode-slots", decode_slots, 0),
                                 ("--whole-slots", whole_slots, 0),
                                 ("--prefill-queue", prefill_queue, 0)):
            if not is_int(value) or value < low:
                raise InvalidInputError(f"{flag} must be an int of at least {low}, got {value!r}")
        self.policy, self.local_prefill_tokens, self.imbalance = policy, local_prefill_tokens, imbalance
        self.decode_slots, self.whole_slots = decode_slots, whole_slots
        self.prefill_queue = prefill_queue
        self.prefill = _Instances(prefill, index_spans)
        self.decode = _Instances(decode, index_spans)
        self.sessions: OrderedDict[int, str] = OrderedDict()  # session hash -> its last D
        self.counts: Counter[tuple[str, str]] = Counter()  # (choice, reason) -> requests

    def choose(self, prompt: Prompt | None, session: str | None = None) -> Route:
        """Where a request with `prompt` (None: unread) and the client's `session` goes; the
        session's D is remembered (an empty `session` is none). The route is counted once it
        is final (`settled`)."""
        session = session or None
        if self.policy == "round_robin":
            return Route(self._turn(self.prefill), self._turn(self.decode), 0, "round_robin")
        sticky = self.sessions.get(hash(session))
        d_url, d_hit, reason = self._pick(self.decode, prompt, sticky)
        full = self.decode_slots and self.decode.in_flight[d_url] >= self.decode_slots
        if full and (whole := self._whole(prompt, sticky)) is not None:
            route = whole
        elif (self.local_prefill_tokens and d_hit and prompt is not None
                and prompt.tokens - d_hit <= self.local_prefill_tokens
                and all(self.prefill.hit(u, prompt) <= d_hit
                        for u in self.prefill.candidates(self.imbalance))):
            route = Route(None, d_url, d_hit, reason)
        else:
            p_url, p_hit, _ = self._pick(self.prefill, prompt, None)
            route = Route(p_url, d_url, p_hit, reason)
            if (self.prefill_queue and not full
                    and self.prefill.in_flight[p_url] >= self.prefill_queue):
                route = Route(None, d_url, d_hit, "p_busy")  # D has a slot and P a queue
        if session is not None:
            self.sessions[hash(session)] = route.decode
            self.sessions.move_to_end(hash(session))
            if len(self.sessions) > MAX_SESSIONS:
                self.sessions.popitem(last=False)
        return route

    def _whole(self, prompt: Prompt | None, sticky: str | None) -> Route | None:
        """A P with room to serve the request whole (`whole_slots`), None where none has."""
        room = [u for u in self.prefill.candidates(1 << 62)
                if u not in self.prefill.down and self.prefill.in_flight[u] < self.whole_slots]
        if not room:
            return None
        hits = [(u == sticky, self.prefill.hit(u, prompt)) for u in room]
        url = room[hits.index(max(hits))]
        return Route(None, self.prefill.take(url), self.prefill.hit(url, prompt), "d_full",
                     whole=True)

    def _pick(self, role: _Instances, prompt: Prompt | None, sticky: str | None
              ) -> tuple[str, int, str]:
        candidates = role.candidates(self.imbalance)
        if sticky in candidates:
            return role.take(sticky), role.hit(sticky, prompt), "session"
        hits = [role.hit(u, prompt) for u in candidates]
        best = max(hits)
        url = candidates[hits.index(best)]
        return role.take(url), best, "prefix" if best else "turn"

    @staticmethod
    def _turn(role: _Instances) -> str:
        return role.take(role.candidates(1 << 62)[0])

    def started(self, route: Route) -> None:
        """`route`'s request is in flight on its instances."""
        self._count(route, 1)

    def finished(self, route: Route) -> None:
        """`route`'s request has ended: answered, failed or abandoned."""
        self._count(route, -1)

    def _count(self, route: Route, by: int) -> None:
        if route.prefill is not None:
            self.prefill.in_flight[route.prefill] += by
        (self.prefill if route.whole else self.decode).in_flight[route.decode] += by

    def looking_up(self, url: str, by: int) -> None:
        """A lookup on `url`, a P or a D (`kvxfer.serve.sources`), has started (`by` 1) or
        ended (-1): it is in flight there meanwhile."""
        role = self.decode if url in self.decode.urls else self.prefill
        if url not in role.urls or by not in (1, -1):
            raise InvalidInputError(f"a lookup is on one of the proxy's P or D instances, by 1 "
                                    f"or -1, got {url!r:.200} by {by!r}")
        role.in_flight[url] += by

    def settled(self, route: Route) -> None:
        """Count a request under the route it took in the end (`counts`: only ever grows)."""
        self.counts[(route.choice, route.reason)] += 1

    def answered(self, route: Route, prompt: Prompt | None) -> None:
        """`route`'s instances answered `prompt` (2xx): they hold it now."""
        if route.prefill is not None:
            self.prefill.remember(route.prefill, prompt)
        (self.prefill if route.whole else self.decode).remember(route.decode, prompt)

    def instead_of_p(self, route: Route) -> Route:
        """`route` with D prefilling alone because its P could not be reached (`local`,
        reason `p_unreachable`)."""
        return Route(None, route.decode, 0, "p_unreachable")

    def holds(self, url: str, tokens: int) -> None:
        """`url`'s KV cache holds `tokens` tokens: remember no more of what it was sent (the
        least recently sent go first, as vLLM evicts its free blocks)."""
        if not is_int(tokens) or tokens < 1:
            raise InvalidInputError(f"an instance's KV cache must hold a positive number of "
                                    f"tokens, got {tokens!r} for {url}")
        for role in (self.prefill, self.decode):
            if url in role.urls:
                role.capacity[url] = tokens
                role.trim(url)

    def other_decode(self, route: Route, prompt: Prompt | None = None) -> Route | None:
        """`route` with another D that is up instead of its own, which could not be reached
        (reason `d_unreachable`): the one expected to hold most of `prompt`, in turn on a tie;
        None when no other D is up. A local prefill goes through a P that is up instead where
        that D is expected to hold less than all but `local_prefill_tokens` of the prompt."""
        others = [u for u in self.decode.candidates(1 << 62)
                  if u != route.decode and u not in self.decode.down]
        if not others:
            return None
        hits = [self.decode.hit(u, prompt) for u in others]
        d_url = self.decode.take(others[hits.index(max(hits))])
        if route.prefill is not None:  # P's params name P, whom any D reads from
            return Route(route.prefill, d_url, route.expected_hit, "d_unreachable")
        if (prompt is not None and prompt.tokens - max(hits) > self.local_prefill_tokens
                and any(u not in self.prefill.down for u in self.prefill.urls)):
            p_url, p_hit, _ = self._pick(self.prefill, prompt, None)
            return Route(p_url, d_url, p_hit, "d_unreachable")
        return Route(None, d_url, max(hits), "d_unreachable")

    def mark(self, url: str, up: bool) -> None:
        """Route to `url` again (`up`) or not until it is marked up. An instance marked down
        forgets what it was sent: it may come back restarted, its prefix cache empty."""
        for role in (self.prefill, self.decode):
            if url in role.urls:
                if not up and url not in role.down:
                    role.sent[url].clear()
                (role.down.discard if up else role.down.add)(url)

    def any_decode(self) -> str:
        """A D instance that is up, in turn (for requests that are not completions)."""
        return self._turn(self.decode)
