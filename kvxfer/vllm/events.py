"""The host pool's stores and removals as vLLM's KV events (`TPUConnector.take_events`): what
`kvxfer.plan.pool.Pools.take_events` keeps, in vLLM's types, medium `CPU`, with the labels vLLM's
own `BlockStored` events carry."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvxfer.plan.save_plan import GroupSpec

if TYPE_CHECKING:
    from vllm.v1.request import Request

__all__ = ["event_labels", "vllm_events"]


def vllm_events(events: list[dict]) -> list[Any]:
    """A host pool's events (`kvxfer.plan.pool.Pools.take_events`) as vLLM's KV events with
    medium `CPU` (`BlockStored`, `BlockRemoved`), block hashes as vLLM's own events give them."""
    from vllm.distributed.kv_events import MEDIUM_CPU, BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash, to_event_extra_keys

    out: list[Any] = []
    for e in events:
        if "removed" in e:
            out.append(BlockRemoved(block_hashes=[maybe_convert_block_hash(h) for h in e["removed"]],
                                    medium=MEDIUM_CPU, group_idx=e["group"]))
            continue
        parent = e["parent"]
        out.append(BlockStored(
            block_hashes=[maybe_convert_block_hash(h) for h in e["stored"]],
            parent_block_hash=None if parent is None else maybe_convert_block_hash(parent),
            token_ids=e["token_ids"] or [], block_size=e["block_size"],
            lora_id=e.get("lora_id"), medium=MEDIUM_CPU, lora_name=e.get("lora_name"),
            group_idx=e["group"],
            extra_keys=to_event_extra_keys(e.get("extra_keys") or [None] * len(e["stored"]))))
    return out


def event_labels(request: Request, groups: Sequence[GroupSpec], num_tokens: int
                 ) -> dict[str, Any] | None:
    """What vLLM's own `BlockStored` events say of a request's blocks beside their hashes and
    tokens: its LoRA adapter, and per group, each full block's extra keys (LoRA name, cache
    salt, multimodal and prompt-embeds keys: vLLM's `generate_block_hash_extra_keys`), up to
    `num_tokens`; None when there is nothing to say (the usual case)."""
    from vllm.v1.core.kv_cache_utils import generate_block_hash_extra_keys

    lora = getattr(request, "lora_request", None)
    if lora is None and not request.cache_salt and not request.mm_features and (
            request.prompt_embeds is None):  # nothing for any block: no walk over them
        return None
    extra: list[list[Any]] = []
    for g in groups:
        keys, mm = [], 0
        for i in range(num_tokens // g.tokens_per_block):
            key, mm = generate_block_hash_extra_keys(request, i * g.tokens_per_block,
                                                     (i + 1) * g.tokens_per_block, mm)
            keys.append(key)
        extra.append(keys)
    if lora is None and all(k is None for keys in extra for k in keys):
        return None
    return {"lora_id": lora.adapter_id if lora else None, "lora_name": lora.name if lora else None,
            "extra_keys": extra}
