"""D's reads, in vLLM's scheduler process: `DecodeLoads` decides whether a request's params
(P's, or a peer's prefix: `kv_source`) are taken, what is read past what this instance holds,
and which leases are kept alive or let go of. Part of `TPUConnector`'s scheduler side
(`kvxfer.vllm.scheduler_side`), which holds it on every instance that reads."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvxfer.connector.scheduler import LoadRequest
from kvxfer.nixl.wire import StreamParams, params_forged, prompt_digest
from kvxfer.plan.blocks import is_int
from kvxfer.plan.save_plan import GroupSpec, final_blocks
from kvxfer.vllm.fallbacks import Fallbacks, p_engine

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

__all__ = ["DecodeLoads", "asks", "prompt_digest_of", "prompt_extra"]


class DecodeLoads:
    """D's reads from P, in vLLM's scheduler process: whether a request's params are taken
    (the prompt they name, `kv_recompute_threshold`) and how much of its prompt D holds
    already, the loads handed to the workers, the P leases D keeps alive (`expects`) or lets
    go of (`cancels`), and what D computes itself instead (`fallbacks`)."""

    def __init__(self, groups: Sequence[GroupSpec], threshold: int, fallbacks: Fallbacks,
                 keys: Sequence[bytes] = ()):
        self.groups = list(groups)
        self.threshold = threshold  # fewer tokens to load: computed
        self.fallbacks = fallbacks
        self.keys = tuple(keys)  # the fleet keys: params without their MAC are refused
        self._local: dict[str, int] = {}  # tokens D holds (device and pool), from matched
        self._ends: dict[str, int] = {}  # where the read ends: the prompt's, or a source's prefix
        self._prompts: dict[str, str | None] = {}  # the prompt digest, from matched
        self._waiting: dict[str, dict[str, Any]] = {}  # params accepted, load not started
        self._expects: list[dict[str, Any]] = []
        self._cancels: list[dict[str, Any]] = []
        self._loads: dict[str, LoadRequest] = {}

    def matched(self, request: Request, num_computed: int,
                pool_match: Callable[[Request, int], tuple[int, bool]],
                chain: Callable[[Request, int], list[str | None]]) -> tuple[int, bool]:
        """The prompt tokens D reads from P (all past its device hit), or from the peer a
        `kv_source` names (its prefix: `_prefix`), or, where it takes no params, what
        `pool_match` (D's own host pool) holds of it. `chain` gives a request's block hash
        chain at a token count, as P names it in params (`SchedulerSide.chain`)."""
        params, req_id = request.kv_transfer_params, request.request_id
        self._local.pop(req_id, None)  # a call before (vLLM retries) planned another load
        self._prompts.pop(req_id, None)
        self._ends.pop(req_id, None)
        self.fallbacks.arrived(req_id, params)
        read = asks(params, "do_remote_prefill", req_id)
        if read and params.get("kv_source") is not None:
            self._drop_source(request, "the request reads its whole prompt from P")
        if not read:
            if params and params.get("kv_source") is not None:
                return self._prefix(request, num_computed, pool_match, chain)
            return pool_match(request, num_computed)
        streamed = StreamParams.given(params)  # P still prefills: it names its prompt later
        # checked once: a retry of a request whose params D took (its lease kept alive) is
        # not refused for their expiry
        forged = None if streamed or req_id in self._waiting else params_forged(params, self.keys)
        if forged is not None:  # no lease is let go of: the P they name may be anyone's
            self._fall_back("forged", request, f"its kv_transfer_params are refused: {forged}")
            return pool_match(request, num_computed)
        sent = request.num_prompt_tokens if streamed else params.get("num_prompt_tokens")
        digest = prompt_digest_of(request)
        if sent != request.num_prompt_tokens or (not streamed and params.get("prompt") != digest):
            if not streamed:  # P's lease let go of at once: D never reads it
                self._let_go(req_id, params)
            self._fall_back("other_prompt", request, f"its kv_transfer_params are for another "
                            f"prompt ({sent!r:.40} tokens, D's has {request.num_prompt_tokens})")
            return pool_match(request, num_computed)  # what D's own pool holds of it
        count = request.num_prompt_tokens - num_computed
        if count <= 0:
            return 0, False
        if count < self.threshold and not streamed:
            self._let_go(req_id, params)
            self._fall_back("below_threshold", request, f"{count} tokens to load, below "
                            f"kv_recompute_threshold {self.threshold}")
            return pool_match(request, num_computed)
        # D's own pool first: the run past its device hit that it holds is loaded from host,
        # and only the rest read from P
        self._local[req_id] = num_computed + pool_match(request, num_computed)[0]
        self._prompts[req_id], self._ends[req_id] = digest, request.num_prompt_tokens
        if req_id not in self._waiting and not streamed:  # P's lease kept alive
            self._waiting[req_id] = dict(params)
            self._expects.append(dict(params))
        return count, True

    def _prefix(self, request: Request, num_computed: int,
                pool_match: Callable[[Request, int], tuple[int, bool]],
                chain: Callable[[Request, int], list[str | None]]) -> tuple[int, bool]:
        """`kv_source`: the params a peer (any kvxfer instance that stages, P or a D of
        `kv_role` `kv_both`) returned for a prefix of this prompt, found in its device cache
        or host pool (`SchedulerSide.finished`). This instance reads that prefix past what its
        own device and pool hold, and computes the rest. Taken only where the prefix's token
        digest and block hash chain (so its cache salt, LoRA adapter and multimodal keys)
        are this request's own; else refused by name, and computed here."""
        params, req_id = request.kv_transfer_params, request.request_id
        source, ids = params["kv_source"], request.prompt_token_ids
        n = source.get("num_prompt_tokens") if isinstance(source, Mapping) else None
        why = None
        if not isinstance(source, Mapping):
            why = f"kv_source must be a peer's kv_transfer_params, got {source!r:.60}"
        elif (forged := params_forged(source, self.keys)) is not None:
            params["kv_source"] = None  # once: a retry reads nothing; no lease let go of
            self.fallbacks.count("forged", p_engine(source), req_id,
                                 f"its kv_source is refused: {forged}")
            return pool_match(request, num_computed)
        elif not is_int(n) or not 0 < n <= request.num_prompt_tokens:
            why = (f"kv_source names a prefix of {n!r:.20} tokens of a "
                   f"{request.num_prompt_tokens}-token prompt")
        elif ids is None or getattr(request, "prompt_embeds", None) is not None:
            why = "kv_source is refused for a prompt of embeddings (no token ids bind it)"
        elif any(g.kind != "attention" for g in self.groups):
            why = "kv_source needs full-attention KV cache groups only (a prefix of a sliding " \
                  "window or an SSM state is not a prefix of the KV)"
        elif (source.get("prompt") != prompt_digest_of(request, n)
              or source.get("chain") != chain(request, n)):
            why = f"kv_source is for another prefix than this prompt's first {n} tokens (its " \
                  f"token digest or block hash chain differ)"
        if why is not None:
            params["kv_source"] = None  # once: a retry reads nothing
            if isinstance(source, Mapping):
                self._let_go(req_id, source)
            self.fallbacks.count("other_prompt", p_engine(source), req_id, why)
            return pool_match(request, num_computed)
        # whole blocks of every group alone: the chain binds every token read (a partial last
        # block's cache salt, LoRA or multimodal keys are in no hash compared)
        whole = math.lcm(*(g.tokens_per_block for g in self.groups))
        end = n // whole * whole
        pooled = pool_match(request, num_computed)
        local = num_computed + pooled[0]
        if end - local < max(self.threshold, 1):  # held here already, or not worth a read
            self._let_go(req_id, source)
            params["kv_source"] = None
            return pooled
        self._local[req_id], self._ends[req_id] = local, end
        self._prompts[req_id] = prompt_digest_of(request, n)
        if req_id not in self._waiting:  # the peer's lease kept alive
            self._waiting[req_id] = dict(source)
            self._expects.append(dict(source))
        return end - num_computed, True

    def _drop_source(self, request: Request, why: str) -> None:
        """A `kv_source` this request will not read: its peer's lease let go of at once."""
        source = request.kv_transfer_params["kv_source"]
        request.kv_transfer_params["kv_source"] = None
        logger.warning("request %s: its kv_source is not read: %s", request.request_id, why)
        if isinstance(source, Mapping):
            self._let_go(request.request_id, source)

    def _let_go(self, req_id: str, params: Mapping[str, Any]) -> None:
        """D will not read the request P staged for these params: P may free it now (D
        connects to P, to say so, where it has not yet; never to a P named by params
        without the fleet key's MAC, which may name anyone's address)."""
        self._waiting.pop(req_id, None)
        if params_forged(params, self.keys) is not None:
            return
        self._expects.append(dict(params))
        self._cancels.append(dict(params))

    def read_end(self, req_id: str) -> int | None:
        """Where the request's read from P (or a `kv_source`) ends, in tokens, where it reads
        past what D's pool holds of it; else None."""
        return self._ends.get(req_id) if req_id in self._local else None

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external: int,
                    pooled: int, hashes: Callable[[], list[list[str]]]) -> dict[str, int] | None:
        """The load of a request whose params D took, once vLLM allocated its blocks (none
        where vLLM gave it no external tokens: P's lease is let go of); returns its loaded
        tokens by source (`pooled` from D's pool, the rest from P), None where it loads none.
        `hashes()`: its block hashes per group, which pooled blocks read are checked by."""
        params, req_id = request.kv_transfer_params, request.request_id
        read = asks(params, "do_remote_prefill", req_id)
        end = self._ends.pop(req_id, None)
        prefix = end is not None and not read
        if not read and not prefix:
            return None
        origin = params if read else params["kv_source"]  # the params read from
        local = self._local.pop(req_id, 0)
        digest = self._prompts.pop(req_id, None)
        waited = self._waiting.pop(req_id, None)
        sources = None
        if num_external <= 0 and waited is not None:
            self._cancels.append(waited)  # D computes it all itself
        if num_external > 0:
            self.fallbacks.loading(req_id, origin)
            have = [0 if g.kind == "mamba" else local // g.tokens_per_block for g in self.groups]
            upto = [end // g.tokens_per_block for g in self.groups] if prefix else None
            need = []  # what vLLM was told is loaded: every block of it must be read
            for g, h, u in zip(self.groups, have, upto or [None] * len(have)):
                blocks_of = final_blocks(g, end if prefix else request.num_prompt_tokens)
                hi = blocks_of.stop if u is None else min(blocks_of.stop, u)
                need.append((min(max(h, blocks_of.start), hi), hi))
            self._loads[req_id] = LoadRequest(
                dict(origin), [list(ids) for ids in blocks.get_block_ids()], have,
                digest or prompt_digest_of(request), upto, need, hashes())
            sources = {"host": pooled, "p2p": num_external - pooled}
        if read:
            params["do_remote_prefill"] = False  # one transfer per request
        else:
            params["kv_source"] = None
        return sources

    def take(self, meta: Any) -> None:
        """This step's loads and lease news, into the workers' metadata (a `KvxferMetadata`)."""
        meta.loads, self._loads = self._loads, {}
        meta.expects, self._expects = self._expects, []
        meta.cancels, self._cancels = self._cancels, []

    def finished(self, req_id: str) -> None:
        """vLLM's `request_finished`: a request aborted in D's queue lets P's lease go now."""
        self.fallbacks.finished(req_id)
        self._local.pop(req_id, None)
        self._prompts.pop(req_id, None)
        self._ends.pop(req_id, None)
        waited = self._waiting.pop(req_id, None)
        if waited is not None:
            self._cancels.append(waited)

    def _fall_back(self, reason: str, request: Request, why: str) -> None:
        """D computes this request's prompt itself (once: its params stop asking)."""
        params = request.kv_transfer_params
        self.fallbacks.count(reason, p_engine(params), request.request_id, why)
        params["do_remote_prefill"] = False


def prompt_extra(request: Request, num_tokens: int | None = None) -> dict[str, Any] | None:
    """What a request's prompt KV depends on beside its token ids (what vLLM's block hashes
    fold in): its LoRA adapter, cache salt and the multimodal inputs in its first
    `num_tokens` tokens (all: None); None where it has none (`prompt_digest`'s `extra`)."""
    lora = getattr(request, "lora_request", None)
    end = request.num_prompt_tokens if num_tokens is None else num_tokens
    extra = {"lora": lora.name if lora else None,
             "salt": getattr(request, "cache_salt", None) or None,
             "mm": [[f.identifier, f.mm_position.offset]
                    for f in getattr(request, "mm_features", None) or ()
                    if f.mm_position.offset < end]}
    return extra if any(extra.values()) else None


def prompt_digest_of(request: Request, num_tokens: int | None = None) -> str | None:
    """The digest of a request's prompt, or of its first `num_tokens` tokens, with what else
    its KV depends on (`prompt_extra`): params for the same tokens under another adapter,
    salt or image, and the blocks they name, are another prompt's. None for a prompt of
    embeddings."""
    ids = request.prompt_token_ids
    if ids is None:
        return None
    n = request.num_prompt_tokens if num_tokens is None else num_tokens
    return prompt_digest(ids[:n], prompt_extra(request, n))


def asks(params: Mapping[str, Any] | None, key: str, req_id: str) -> bool:
    """Whether a request's `kv_transfer_params` set `key` (`do_remote_prefill`,
    `do_remote_decode`) to true: only `True` asks; any other value is logged and ignored."""
    if not params:
        return False
    value = params.get(key)
    if value is not None and not isinstance(value, bool):
        logger.warning("request %s: kv_transfer_params %r must be true or false, got %r; "
                       "taken as false", req_id, key, value)
    return value is True
