"""The host pool's KV events against vLLM's own: for the same request, kvxfer's `BlockStored`
(medium CPU) must say what vLLM's `BlockPool` says of the blocks on the device (hashes,
parent, tokens, block size, LoRA and extra keys), so a router that keys blocks by them
(llm-d's precise prefix scorer, Dynamo's KV router) files both under one key.

Requests are vLLM's own (`vllm.v1.request.Request`, its block hasher); the device events
come from a `BlockPool` caching their blocks, kvxfer's from `SchedulerSide` pooling them as
D keeps a finished request, or as P pools a prompt D has read.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm import SamplingParams
from vllm.lora.request import LoRARequest
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import Request, RequestStatus

from kvxfer.errors import InvalidInputError
from kvxfer.nixl.wire import prompt_digest
from kvxfer.plan.save_plan import GroupSpec
from kvxfer.vllm.reports import WorkerReport
from kvxfer.vllm.scheduler_side import SchedulerSide
from kvxfer.vllm.settings import Settings

HASH = get_hash_fn_by_name("sha256")
init_none_hash(HASH)
NO_STEP = SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={},
                          scheduled_cached_reqs=SimpleNamespace(req_ids=[]))


def _request(req_id: str, tokens, hash_block: int = 16, **kw) -> Request:
    return Request(req_id, None if tokens is None else list(tokens), SamplingParams(max_tokens=4),
                   None, block_hasher=get_request_block_hasher(hash_block, HASH), **kw)


def _device_events(request: Request, block_size: int, hash_block: int, blocks: int) -> list:
    pool = BlockPool(64, True, hash_block, enable_kv_cache_events=True)
    pool.cache_full_blocks(request, pool.get_new_blocks(blocks), 0, blocks, block_size, 0)
    return pool.take_events()


def _side(groups, hash_block: int, producer: bool) -> SchedulerSide:
    side = SchedulerSide(Settings.from_extra({"host_pool_bytes": 1, "staging_blocks": 64}),
                         groups, producer=producer, consumer=not producer,
                         hash_block_size=hash_block)
    side.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=WorkerReport(
        {}, pool_slots=64, slot_bytes=(10,) * len(groups))))
    return side


def _kept_events(request: Request, groups, hash_block: int) -> tuple[SchedulerSide, list]:
    """D keeps `request` as it finishes; its blocks enter the pool once gathered."""
    side = _side(groups, hash_block, producer=False)
    request.status = RequestStatus.FINISHED_STOPPED
    request.num_computed_tokens = request.num_tokens
    tables = [list(range(100, 100 + request.num_tokens // g.tokens_per_block + 1)) for g in groups]
    assert side.finished(request, tables) == (True, None)
    side.build(NO_STEP)
    side.update_connector_output(KVConnectorOutput(
        finished_recving=set(), kv_connector_worker_meta=WorkerReport({request.request_id: 1})))
    return side, side.take_events()


def _p_pooled_events(request: Request) -> list:
    """P prefills `request` for D (one group of 16) and pools its prompt once D has read it."""
    side = _side([GroupSpec(16)], 16, producer=True)
    request.kv_transfer_params = {"do_remote_decode": True}
    n = request.num_prompt_tokens
    table = list(range(10, 10 + -(-n // 16)))
    side.after_alloc(request, SimpleNamespace(get_block_ids=lambda: (table,)), 0)
    side.build(SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=request.request_id, num_computed_tokens=0,
                                            block_ids=(table,))],
        num_scheduled_tokens={request.request_id: n},
        scheduled_cached_reqs=SimpleNamespace(req_ids=[])))
    request.status = RequestStatus.FINISHED_LENGTH_CAPPED
    assert side.finished(request, (table,))[1] is not None  # P's params for D
    side.update_connector_output(KVConnectorOutput(kv_connector_worker_meta=WorkerReport(
        {request.request_id: 1}, pool_slots=64, slot_bytes=(10,))))
    return side.take_events()


def _same(ours, theirs) -> None:
    for field in ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                  "lora_name", "extra_keys", "group_idx"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert (ours.medium, theirs.medium) == ("CPU", "GPU")


@pytest.mark.parametrize("block, hash_block", [(16, 16), (16, 8), (32, 16)])
def test_a_kept_requests_events_say_what_vllms_device_events_say(block, hash_block):
    tokens = range(1000, 1000 + 3 * block + 5)
    (device,) = _device_events(_request("a", tokens, hash_block), block, hash_block, 3)
    _, (pooled,) = _kept_events(_request("a", tokens, hash_block), [GroupSpec(block)], hash_block)
    _same(pooled, device)


def test_a_salted_lora_requests_events_carry_its_adapter_and_extra_keys():
    """A router keys a tenant's salted blocks, and an adapter's, apart from the base model's
    plain ones: the pool's events must label them as vLLM's do."""
    tokens = range(1000, 1000 + 3 * 16 + 5)
    kw = {"cache_salt": "tenant-A", "lora_request": LoRARequest("adapterA", 1, "/x")}
    (device,) = _device_events(_request("a", tokens, **kw), 16, 16, 3)
    _, (pooled,) = _kept_events(_request("a", tokens, **kw), [GroupSpec(16)], 16)
    _same(pooled, device)
    assert pooled.lora_name == "adapterA" and pooled.extra_keys[0] is not None


@pytest.mark.parametrize("embedded", [None, 8])
def test_p_pools_a_prompt_of_embeddings_under_the_tokens_vllms_events_name(embedded):
    """A prompt given as embeddings (all of it, or its first 8 positions): vLLM's events name
    the tokens as its `all_token_ids` holds them (0 where an embedding stands), so do the
    pool's."""
    n = 3 * 16 + 5
    tokens = None if embedded is None else list(range(1000, 1000 + n))
    kw = {"prompt_embeds": torch.zeros(n, 8)}
    if embedded is not None:
        kw["prompt_is_token_ids"] = [i >= embedded for i in range(n)]
    (device,) = _device_events(_request("e", tokens, **kw), 16, 16, 3)
    (pooled,) = _p_pooled_events(_request("e", tokens, **kw))
    _same(pooled, device)


def test_a_pooled_half_of_a_request_whose_read_from_p_failed_is_no_hit():
    """D loads 48 tokens from its pool and reads the rest from P, which fails: vLLM computes
    the request whole, so the pooled part is counted as no hit (its entries stay)."""
    tokens = list(range(1000, 1000 + 5 * 16 + 3))
    side, _ = _kept_events(_request("k", tokens[:48 + 1]), [GroupSpec(16)], 16)
    assert side.prefill.pools.entries() == 3
    request = _request("r", tokens)
    request.kv_transfer_params = {"do_remote_prefill": True, "num_prompt_tokens": len(tokens),
                                  "prompt": prompt_digest(tokens), "peer": "p", "host": "h",
                                  "port": 1}
    assert side.matched_tokens(request, 0) == (len(tokens), True)
    side.after_alloc(request, SimpleNamespace(get_block_ids=lambda: (list(range(10, 16)),)),
                     len(tokens))
    assert side.hit_sources("r") == {"host": 48, "p2p": len(tokens) - 48}
    side.build(NO_STEP)
    side.update_connector_output(KVConnectorOutput(
        finished_recving={"r"}, failed_recving={"r"},
        kv_connector_worker_meta=WorkerReport({}, pool_slots=64, slot_bytes=(10,),
                                              read_failed=("r",))))
    assert side.prefill.pools.counters()["p_pool_hit_tokens"] == 0
    assert side.prefill.pools.entries() == 3


def test_events_must_be_a_bool():
    with pytest.raises(InvalidInputError, match="events must be a bool, got 'yes'"):
        SchedulerSide(Settings.from_extra({}), [GroupSpec(16)], producer=True, consumer=False,
                      events="yes")
