"""kvxfer as a vLLM KV connector: `kvxfer.vllm.TPUConnector`.

Configure P and D with (tpu-inference accepts only the connector *names* it
knows, so the class is named `TPUConnector`; the module path is ours):

    --kv-transfer-config '{"kv_connector": "TPUConnector",
        "kv_connector_module_path": "kvxfer.vllm", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"host": "10.0.0.5", "port": 5610}}'
    --kv-transfer-config '{"kv_connector": "TPUConnector",
        "kv_connector_module_path": "kvxfer.vllm", "kv_role": "kv_consumer",
        "kv_load_failure_policy": "recompute"}'

`kv_connector_extra_config` takes the keys of `Settings` (unknown keys are
refused, naming them). The proxy in front forwards P's `kv_transfer_params`
to D, as for vLLM's NIXL connector; P's request carries
`{"do_remote_decode": true}`.

A thin adapter: vLLM's calls are mapped onto `kvxfer.connector`, split by
role the way vLLM splits a connector. `TPUConnector` (here) is the facade
vLLM loads; it hands each call to its role's side, `SchedulerSide`
(`kvxfer.vllm.scheduler_side`) or `WorkerSide` (`kvxfer.vllm.worker_side`).

- Scheduler side (vLLM's scheduler process; no caches, no device): on P,
  `PrefillScheduler` turns each `SchedulerOutput` into save plans, staging
  slots and, for a request whose prefill completes, its generation and
  params, so `request_finished` (which vLLM calls before it has processed the
  worker's output for that step) can return them. On D it answers
  `get_num_new_matched_tokens` with the prompt tokens D does not hold locally
  and, after allocation, hands the worker D's block table and how many of its
  entries D already holds (those are not read).
- Worker side (tpu-inference's runner, `register_runner`): P's
  `PrefillWorker` gathers into the registered staging in `wait_for_save` and
  answers D's notifications whenever the engine steps; D's
  `DecodeConnector` posts reads in `start_load_kv` and, in `get_finished`
  (after the forward pass, before the request is reported received, so no
  forward reads an unfilled block), scatters into `runner.kv_caches` in place
  and verifies. A failed request is reported received *and* failed (with,
  for a model of one KV cache group, its logical block ids in
  `get_block_ids_with_load_errors`), which vLLM recomputes under
  `kv_load_failure_policy="recompute"`.

P frees its device blocks at once (`delay_free=False`): only its host staging
waits for D. The worker reports the requests D has read (or whose lease
expired), so the scheduler side reuses their slots; `has_pending_push_work`
keeps P stepping, answering D, while any request is held.

Streams (`kvxfer proxy --stream`): the router gives P's request a stream id
(`{"do_remote_decode": true, "stream": id}`) and sends the client's request to D
at once with the same id and P's kvxfer address (`{"do_remote_prefill": true,
"stream": id, "peer", "host", "port"}`). D allocates the prompt's blocks and
reads each chunk's blocks as P saves them (`kvxfer.nixl.streams`); D's prompt
is checked against the one P computed with P's first chunk. Without a stream
id everything is as above.

This module is imported by vLLM's API process too: it imports only vLLM's
connector and metric base classes at import time; JAX and NIXL load with the role.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from kvxfer.errors import InvalidInputError
from kvxfer.plan.save_plan import GroupSpec
from kvxfer.vllm.metrics import StatsReporting
from kvxfer.vllm.reports import worker_processes
from kvxfer.vllm.scheduler_side import KvxferMetadata, SchedulerSide
from kvxfer.vllm.settings import Settings
from kvxfer.vllm.worker_side import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


__all__ = ["Settings", "TPUConnector", "block_hashing", "group_specs", "model_description"]

logger = logging.getLogger(__name__)



def group_specs(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig) -> list[GroupSpec]:
    """kvxfer's `GroupSpec` of each of vLLM's KV cache groups, in order."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    dcp = vllm_config.parallel_config.decode_context_parallel_size
    specs = []
    for g, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if isinstance(spec, SlidingWindowSpec):
            specs.append(GroupSpec(spec.block_size, "sliding_window", dcp, spec.sliding_window))
        elif isinstance(spec, MambaSpec):
            specs.append(GroupSpec(spec.block_size, "mamba"))
        elif isinstance(spec, FullAttentionSpec) and not isinstance(spec, ChunkedLocalAttentionSpec):
            specs.append(GroupSpec(spec.block_size, "attention", dcp))
        else:
            raise InvalidInputError(f"KV cache group {g} has a {type(spec).__name__}, which "
                                    f"kvxfer does not transfer")
    return specs


def model_description(vllm_config: VllmConfig, groups: Sequence[GroupSpec]) -> dict[str, Any]:
    """What P's and D's caches hold, the same on both (checked at handshake); tensor
    parallelism and the number of blocks may differ (blocks are staged whole)."""
    model, cache = vllm_config.model_config, vllm_config.cache_config
    return {
        "model": str(model.model),
        "dtype": str(model.dtype),
        "num_kv_heads": int(model.get_total_num_kv_heads()),
        "head_size": int(model.get_head_size()),
        "num_hidden_layers": int(model.get_total_num_hidden_layers()),
        "cache_dtype": str(cache.cache_dtype),
        "groups": [{"kind": g.kind, "block_size": g.block_size,
                    "sliding_window": g.sliding_window} for g in groups],
    }


_RANDOM_SEEDS = ("xxhash", "xxhash_cbor")  # vLLM seeds these at random per process, unless
# PYTHONHASHSEED is set; the others (sha256, sha256_cbor) from a fixed default


def block_hashing(vllm_config: VllmConfig, hash_block_size: int, pool: bool) -> dict[str, Any]:
    """How this instance's vLLM hashes prefix blocks, the host pool's keys (checked at
    handshake where either side keeps a pool): `--prefix-caching-hash-algo`, the hash block
    size, where the seed comes from (`PYTHONHASHSEED`, vLLM's `default`, or `random` per
    process) and a canary, vLLM's hash of one fixed block under that seed (None for a random
    seed: no other process computes the same hashes)."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import DEFAULT_NONE_HASH_SEED, hash_block_tokens

    algo = str(vllm_config.cache_config.prefix_caching_hash_algo)
    seed = os.environ.get("PYTHONHASHSEED")
    source = "PYTHONHASHSEED" if seed is not None else "random" if algo in _RANDOM_SEEDS else "default"
    canary = None
    if source != "random":
        hash_fn = get_hash_fn_by_name(algo)
        root = hash_fn(DEFAULT_NONE_HASH_SEED if seed is None else seed)  # vLLM's NONE_HASH
        canary = bytes(hash_block_tokens(hash_fn, root, tuple(range(hash_block_size)))).hex()[:32]
    return {"algo": algo, "block_size": int(hash_block_size), "seed": source, "canary": canary,
            "pool": bool(pool)}


class TPUConnector(StatsReporting, KVConnectorBase_V1, SupportsHMA):
    """kvxfer's P/D transfer for vLLM-TPU (stats: `kvxfer.vllm.metrics`); see the module docstring.

    The facade: in vLLM's scheduler process `_scheduler` (a `SchedulerSide`) answers, in a
    worker `_worker` (a `WorkerSide`); the other is None.
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config, role, kv_cache_config)
        if kv_cache_config is None:
            raise InvalidInputError("TPUConnector needs the KVCacheConfig (vLLM >= 0.11 passes it)")
        ktc = vllm_config.kv_transfer_config
        self.settings = Settings.from_extra(ktc.kv_connector_extra_config, ktc.engine_id)
        self.groups = group_specs(vllm_config, kv_cache_config)
        self.producer, self.consumer = bool(ktc.is_kv_producer), bool(ktc.is_kv_consumer)
        instance = _p_instance(vllm_config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            recompute = getattr(ktc, "kv_load_failure_policy", "recompute") == "recompute"
            events = getattr(vllm_config, "kv_events_config", None)
            self._scheduler = SchedulerSide(self.settings, self.groups, self.producer,
                                            self.consumer, instance, recompute,
                                            getattr(kv_cache_config, "hash_block_size", None),
                                            bool(getattr(events, "enable_kv_cache_events", False)))
        else:
            hash_block = getattr(kv_cache_config, "hash_block_size", None) or self.groups[0].tokens_per_block
            # models with a sliding-window or SSM group pool nothing (`Pools`)
            pool = (self.settings.connector_config(self.producer).host_pool_bytes > 0
                    and all(g.kind == "attention" for g in self.groups))
            hashing = block_hashing(vllm_config, hash_block, pool)
            if pool and hashing["seed"] == "random":
                logger.warning("the host pool's keys are %s block hashes, which vLLM seeds at "
                               "random per process without PYTHONHASHSEED: this instance and "
                               "every peer refuse each other at handshake; set PYTHONHASHSEED "
                               "alike on every instance, or use sha256_cbor", hashing["algo"])
            if not pool and self.settings.connector_config(self.producer).host_pool_bytes > 0:
                logger.warning("host_pool_bytes is ignored: a model with a sliding-window or "
                               "SSM KV cache group keeps no host pool (%s)",
                               [g.kind for g in self.groups])
            self._worker = WorkerSide(self.settings, kv_cache_config,
                                      dict(model_description(vllm_config, self.groups),
                                           hashing=hashing),
                                      self.producer, self.consumer, instance)

    # -- worker side

    def register_runner(self, runner: Any) -> None:
        """tpu-inference hands its runner over: `runner.kv_caches`, `layer_name_to_kvcache_index`."""
        self._worker.register_runner(runner)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self._worker.start_load(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete between steps (asynchronous), never within a forward

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return  # saved as a whole in wait_for_save, from runner.kv_caches

    def wait_for_save(self) -> None:
        self._worker.save(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sent, received, failed = self._worker.poll()
        return KVConnectorTransferResults(finished_sending=sent, finished_recving=received | failed,
                                          failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The logical block ids of failed loads, for a model of one KV cache group.

        vLLM (0.33) maps block ids back to requests only with one group (ids are
        unique within a group) and raises for several; there a failed request is
        reported in `failed_recving` alone, which vLLM recomputes from its first token.
        """
        errors = self._worker.load_errors()
        return errors if len(self.groups) == 1 else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker.report()

    def shutdown(self) -> None:
        if self.role == KVConnectorRole.WORKER:
            self._worker.close()

    # -- scheduler side

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler.matched_tokens(request, num_computed_tokens)

    def get_external_cache_hit_sources(self, request: Request,
                                       num_external_tokens: int) -> dict[Any, int]:
        """vLLM 0.33's split of a request's loaded tokens by tier: the own pool is host memory
        (`HOST`), D's loads from P a peer's (`P2P`)."""
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        sources = self._scheduler.hit_sources(request.request_id)
        if not num_external_tokens or not sources or sum(sources.values()) != num_external_tokens:
            return super().get_external_cache_hit_sources(request, num_external_tokens)
        return {CacheHitSource(source): n for source, n in sources.items() if n}

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return tuple(range(len(self.groups)))  # P sends every group of the request

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self._scheduler.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvxferMetadata:
        return self._scheduler.build(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        self._scheduler.update_connector_output(connector_output)

    def request_finished(self, request: Request,
                         block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.finished(request, None if block_ids is None else (block_ids,))

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return self._scheduler.finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        return self._scheduler.holding()

    def take_events(self) -> list[Any]:
        """The host pool's stores and removals, as vLLM KV events of medium `CPU`, which vLLM
        publishes beside its own; none unless `--kv-events-config` enables KV cache events."""
        return self._scheduler.take_events() if self._scheduler is not None else []

    def reset_cache(self) -> bool:
        """vLLM's `reset_prefix_cache(reset_connector=True)` (after new weights): P's host
        pool drops every entry, so none is loaded again."""
        return self._scheduler.reset_cache() if self._scheduler is not None else True

    def get_finished_count(self) -> int | None:
        """How many workers report each load finished: vLLM's aggregator waits for that many
        (by default its world size, TP x PP). Under a Ray executor, one worker per placement
        group bundle holding the platform's devices (tpu-inference: one per host, TP x PP
        devices among them); None elsewhere (vLLM's default)."""
        return worker_processes(self._vllm_config)


def _p_instance(vllm_config: VllmConfig) -> str:
    """P's instance id, the same in vLLM's scheduler and worker processes, new at every start:
    from the engine id and the config's instance id (drawn once, sent with the config)."""
    ktc = vllm_config.kv_transfer_config
    seed = f"{ktc.engine_id}/{getattr(vllm_config, 'instance_id', '')}"
    return hashlib.blake2b(seed.encode(), digest_size=8).hexdigest()


_OLD_NAMES = {  # a name of this module before its sides moved out -> (module, name) now
    "scheduled_requests": ("kvxfer.vllm.scheduler_side", "scheduled_requests"),
    "_SchedulerSide": ("kvxfer.vllm.scheduler_side", "SchedulerSide"),
    "_WorkerSide": ("kvxfer.vllm.worker_side", "WorkerSide"),
    "WorkerReport": ("kvxfer.vllm.reports", "WorkerReport"),
}
_WARNED = {"scheduled_requests"}  # public here before: users may hold it


def __getattr__(name: str) -> Any:
    if name not in _OLD_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, new = _OLD_NAMES[name]
    if name in _WARNED:
        warnings.warn(f"{__name__}.{name} is now {module}.{new} (and kvxfer.vllm.{name}); the "
                      f"old path goes in the next release", DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module(module), new)
