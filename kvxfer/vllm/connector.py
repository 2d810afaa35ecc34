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
role the way vLLM splits a connector.

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
import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
)

from kvxfer.connector.scheduler import LoadRequest, PeerAddress, PrefillScheduler, SaveMeta
from kvxfer.errors import InvalidInputError, KvxferError
from kvxfer.nixl.wire import Source, StreamParams, is_stream_id, prompt_digest
from kvxfer.plan.save_plan import GroupSpec, ScheduledRequest
from kvxfer.vllm.fallbacks import Fallbacks, p_engine
from kvxfer.vllm.metrics import StatsReporting
from kvxfer.vllm.reports import VERIFIED_PER_REPORT, WorkerReport, worker_processes
from kvxfer.vllm.settings import Settings

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request


logger = logging.getLogger(__name__)

__all__ = ["Settings", "TPUConnector", "group_specs", "model_description", "scheduled_requests"]


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


def scheduled_requests(so: SchedulerOutput) -> list[ScheduledRequest]:
    """Each request of a `SchedulerOutput`, as the save planner reads it (pre-step counts).

    New requests and resumed ones carry their whole table; running ones the
    blocks added this step (None when no group got one).
    """
    out = [ScheduledRequest(r.req_id, r.num_computed_tokens, so.num_scheduled_tokens[r.req_id],
                            tuple(map(list, r.block_ids)), full_table=True)
           for r in so.scheduled_new_reqs]
    cached = so.scheduled_cached_reqs
    for i, req_id in enumerate(cached.req_ids):
        new_ids = cached.new_block_ids[i]
        out.append(ScheduledRequest(
            req_id, cached.num_computed_tokens[i], so.num_scheduled_tokens[req_id],
            None if new_ids is None else tuple(map(list, new_ids)),
            full_table=req_id in cached.resumed_req_ids))
    return out


@dataclass
class KvxferMetadata(KVConnectorMetadata):
    """Scheduler -> worker, each step: P's saves; D's loads."""

    save: SaveMeta | None = None
    loads: dict[str, LoadRequest] = field(default_factory=dict)
    expects: list[dict[str, Any]] = field(default_factory=list)  # D: accepted, not yet loaded
    cancels: list[dict[str, Any]] = field(default_factory=list)  # D: expected, then dropped


class TPUConnector(StatsReporting, KVConnectorBase_V1, SupportsHMA):
    """kvxfer's P/D transfer for vLLM-TPU (stats: `kvxfer.vllm.metrics`); see the module docstring."""

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
        if role == KVConnectorRole.SCHEDULER:
            recompute = getattr(ktc, "kv_load_failure_policy", "recompute") == "recompute"
            self._scheduler = _SchedulerSide(self.settings, self.groups, self.producer,
                                             self.consumer, instance, recompute)
        else:
            self._worker = _WorkerSide(self.settings, kv_cache_config,
                                       model_description(vllm_config, self.groups),
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
        received, failed = self._worker.poll()
        return KVConnectorTransferResults(finished_recving=received | failed,
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

    def get_loaded_kv_cache_group_ids(self, request: Request) -> tuple[int, ...]:
        return tuple(range(len(self.groups)))  # P sends every group of the request

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self._scheduler.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler.build(scheduler_output)

    def update_connector_output(self, connector_output: Any) -> None:
        meta = connector_output.kv_connector_worker_meta
        if self._scheduler.fallbacks is not None:  # P agents verified first: this step's loads
            self._scheduler.fallbacks.verified(meta.verified if isinstance(meta, WorkerReport) else ())
            self._scheduler.fallbacks.loaded(connector_output.finished_recving or (),
                                             getattr(connector_output, "failed_recving", ()))
        if isinstance(meta, WorkerReport):
            self._scheduler.learn_sources(meta.sources, meta.units)
            self._scheduler.release(meta.freed)

    def request_finished(self, request: Request,
                         block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        return False, self._scheduler.finished(request)

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        return False, self._scheduler.finished(request)

    def has_pending_push_work(self) -> bool:
        return self._scheduler.holding()

    def get_finished_count(self) -> int | None:
        """How many workers report each load finished: vLLM's aggregator waits for that many
        (by default its world size, TP x PP). Under a Ray executor, one worker per placement
        group bundle holding the platform's devices (tpu-inference: one per host, TP x PP
        devices among them); None elsewhere (vLLM's default)."""
        return worker_processes(self._vllm_config)


class _SchedulerSide:
    def __init__(self, settings: Settings, groups: Sequence[GroupSpec], producer: bool,
                 consumer: bool, instance: str | None = None, recompute: bool = True):
        self.groups = list(groups)
        self.consumer = consumer
        self.threshold = settings.kv_recompute_threshold  # D: fewer tokens to load: computed
        # D (not kv_both): requests it computes itself instead of loading, counted and warned of
        self.fallbacks = Fallbacks(recompute) if consumer and not producer else None
        config = settings.connector_config(True)
        self.prefill = PrefillScheduler(
            groups, staging_blocks=config.staging_blocks, kernel_ratio=config.kernel_ratio,
            address=PeerAddress(settings.p_name, settings.host, settings.p_port),
            instance=instance,
        ) if producer else None
        self._local: dict[str, int] = {}  # D: tokens D holds locally, from matched_tokens
        self._prompts: dict[str, str | None] = {}  # D: the prompt digest, from matched_tokens
        self._waiting: dict[str, dict[str, Any]] = {}  # D: params accepted, load not started
        self._expects: list[dict[str, Any]] = []
        self._cancels: list[dict[str, Any]] = []
        self._loads: dict[str, LoadRequest] = {}
        # P: vLLM's request id -> the transfer id P plans, stages and names in params. A
        # request id P still holds for D (a proxy that reuses X-Request-Id, a retry) gets a
        # transfer id of its own, so the two prefills never share slots or params.
        self._transfers: dict[str, str] = {}
        self._reuses = itertools.count(1)
        self._refused_sources: tuple[tuple[Source, ...], int] = ((), 0)  # P: logged already
        self._frees: dict[str, int] = {}  # P: request -> P processes that freed it so far

    # D
    def matched_tokens(self, request: Request, num_computed: int) -> tuple[int, bool]:
        params, req_id = request.kv_transfer_params, request.request_id
        if self.fallbacks is not None:
            self.fallbacks.arrived(req_id, params)
        if not self.consumer or not _asks(params, "do_remote_prefill", req_id):
            return 0, False
        streamed = StreamParams.given(params)  # P still prefills: it names its prompt later
        sent = request.num_prompt_tokens if streamed else params.get("num_prompt_tokens")
        digest = _prompt_digest(request)
        if sent != request.num_prompt_tokens or (not streamed and params.get("prompt") != digest):
            self._fall_back("other_prompt", request, f"its kv_transfer_params are for another "
                            f"prompt ({sent!r} tokens, D's has {request.num_prompt_tokens})")
            return 0, False
        count = request.num_prompt_tokens - num_computed
        if count <= 0:
            return 0, False
        if count < self.threshold and not streamed:  # P's lease let go of at once (below)
            self._waiting.pop(req_id, None)
            self._expects.append(dict(params))
            self._cancels.append(dict(params))
            self._fall_back("below_threshold", request, f"{count} tokens to load, below "
                            f"kv_recompute_threshold {self.threshold}")
            return 0, False
        self._local[request.request_id] = num_computed
        self._prompts[request.request_id] = digest
        if request.request_id not in self._waiting and not streamed:  # P's lease kept alive
            self._waiting[request.request_id] = dict(params)
            self._expects.append(dict(params))
        return count, True

    def after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external: int) -> None:
        params = request.kv_transfer_params
        if not params:
            return
        if self.prefill is not None and _asks(params, "do_remote_decode", request.request_id):
            req_id = request.request_id
            if req_id not in self._transfers and not params.get("_kvxfer_planned"):
                transfer = req_id
                while self.prefill.holds(transfer):
                    transfer = f"{req_id}~{next(self._reuses)}"
                try:
                    self.prefill.add_request(transfer, request.num_prompt_tokens,
                                             request.prompt_token_ids, _stream(params, req_id))
                except InvalidInputError as e:  # a stream id another request holds (a retry)
                    logger.warning("P request %s is not streamed: %s", req_id, e)
                    self.prefill.add_request(transfer, request.num_prompt_tokens,
                                             request.prompt_token_ids)
                self._transfers[req_id] = transfer
                params["_kvxfer_planned"] = True  # once: a resumed request is replanned in place
        if self.consumer and _asks(params, "do_remote_prefill", request.request_id):
            local = self._local.pop(request.request_id, 0)
            digest = self._prompts.pop(request.request_id, None)
            waited = self._waiting.pop(request.request_id, None)
            if num_external <= 0 and waited is not None:
                self._cancels.append(waited)  # D computes it all itself
            if num_external > 0:
                if self.fallbacks is not None:
                    self.fallbacks.loading(request.request_id, params)
                have = [0 if g.kind == "mamba" else local // g.tokens_per_block
                        for g in self.groups]
                self._loads[request.request_id] = LoadRequest(
                    dict(params), [list(ids) for ids in blocks.get_block_ids()], have,
                    digest or _prompt_digest(request))
            params["do_remote_prefill"] = False  # one transfer per request

    def build(self, so: SchedulerOutput) -> KvxferMetadata:
        meta = KvxferMetadata()
        if self.prefill is not None:
            meta.save = self.prefill.build_connector_meta(
                [replace(s, req_id=self._transfers[s.req_id]) if s.req_id in self._transfers else s
                 for s in scheduled_requests(so)])
        meta.loads, self._loads = self._loads, {}
        meta.expects, self._expects = self._expects, []
        meta.cancels, self._cancels = self._cancels, []
        return meta

    def release(self, freed: Mapping[str, int]) -> None:
        """Reuse the slots of the requests every P process has freed (each worker of a P
        across hosts frees its own piece: `WorkerReport.freed` counts them)."""
        if self.prefill is None:
            return
        processes = max(1, len(self.prefill.sources))
        held = set(self.prefill.held())
        counts = {r: n for r, n in self._frees.items() if r in held}  # the rest: gone
        for req_id, n in freed.items():
            counts[req_id] = counts.get(req_id, 0) + n
        done = {r for r, n in counts.items() if n >= processes}
        self._frees = {r: n for r, n in counts.items() if r not in done}
        self.prefill.release(done)

    def learn_sources(self, sources: tuple[Source, ...], units: int) -> None:
        """P across hosts: name every P process in the params from now on. Until the
        workers' first output arrives (one step, two under asynchronous scheduling), params
        name none: a request completed before then is recomputed by D, once its read finds
        no agent of P's name (within D's handshake timeout)."""
        if (self.prefill is None or not sources
                or (sources, units) in ((self.prefill.sources, self.prefill.units),
                                        self._refused_sources)):
            return
        try:
            self.prefill.use_sources(sources, units)
        except InvalidInputError as e:  # the engine goes on; D fails what it cannot read
            self._refused_sources = (sources, units)  # logged once, not at every step
            logger.error("P's workers reported sources the params cannot name: %s", e)
            return
        logger.info("P spans %d processes: params name %s", len(sources),
                    [s.peer for s in sources])

    def finished(self, request: Request) -> dict[str, Any] | None:
        if self.fallbacks is not None:
            self.fallbacks.finished(request.request_id)
        self._local.pop(request.request_id, None)
        self._prompts.pop(request.request_id, None)
        waited = self._waiting.pop(request.request_id, None)
        if waited is not None:  # aborted in D's queue: P frees its blocks now
            self._cancels.append(waited)
        if self.prefill is None:
            return None
        params = self.prefill.request_finished(
            self._transfers.pop(request.request_id, request.request_id))
        if params is None:
            return None
        return {**params, "do_remote_prefill": True, "do_remote_decode": False,
                "num_prompt_tokens": request.num_prompt_tokens}

    def holding(self) -> bool:
        return self.prefill is not None and bool(self.prefill.held())

    def _fall_back(self, reason: str, request: Request, why: str) -> None:
        """D computes this request's prompt itself (once: its params stop asking)."""
        params = request.kv_transfer_params
        if self.fallbacks is not None:
            self.fallbacks.count(reason, p_engine(params), request.request_id, why)
        else:
            logger.warning("D request %s: %s; D computes its prompt itself",
                           request.request_id, why)
        params["do_remote_prefill"] = False


def _prompt_digest(request: Request) -> str | None:
    """The digest of a request's prompt token ids (None for a prompt of embeddings)."""
    ids = request.prompt_token_ids
    return None if ids is None else prompt_digest(ids)


def _p_instance(vllm_config: VllmConfig) -> str:
    """P's instance id, the same in vLLM's scheduler and worker processes, new at every start:
    from the engine id and the config's instance id (drawn once, sent with the config)."""
    ktc = vllm_config.kv_transfer_config
    seed = f"{ktc.engine_id}/{getattr(vllm_config, 'instance_id', '')}"
    return hashlib.blake2b(seed.encode(), digest_size=8).hexdigest()


def _stream(params: Mapping[str, Any], req_id: str) -> str | None:
    """The stream id a router gave P's request (its D reads the KV while P prefills), if a
    valid one; anything else is logged and ignored (D then fails the stream and recomputes)."""
    stream = params.get("stream")
    if stream is not None and not is_stream_id(stream):
        logger.warning("request %s: kv_transfer_params 'stream' must be 32 hex digits, got "
                       "%.40r; not streamed", req_id, stream)
        return None
    return stream


def _asks(params: Mapping[str, Any] | None, key: str, req_id: str) -> bool:
    """Whether a request's `kv_transfer_params` set `key` (`do_remote_prefill`,
    `do_remote_decode`) to true: only `True` asks; any other value is logged and ignored."""
    if not params:
        return False
    value = params.get(key)
    if value is not None and not isinstance(value, bool):
        logger.warning("request %s: kv_transfer_params %r must be true or false, got %r; "
                       "taken as false", req_id, key, value)
    return value is True


class _WorkerSide:
    def __init__(self, settings: Settings, kv_cache_config: KVCacheConfig,
                 model: Mapping[str, Any], producer: bool, consumer: bool,
                 instance: str | None = None):
        self.settings = settings
        self.kv_cache_config = kv_cache_config
        self.model = model
        self.producer, self.consumer = producer, consumer
        self.runner: Any = None
        self._indices: list[list[int]] = []
        self.instance = instance
        self._prefill: Any = None  # PrefillWorker, started with the runner
        self._decode: Any = None  # DecodeConnector
        self._freed: set[str] = set()
        self._verified: set[str] = set()  # D: P agents named in a report already

    def register_runner(self, runner: Any) -> None:
        index = runner.layer_name_to_kvcache_index
        self._indices = []
        for g, group in enumerate(self.kv_cache_config.kv_cache_groups):
            missing = [n for n in group.layer_names if n not in index]
            if missing:
                raise InvalidInputError(f"KV cache group {g} layers {missing[:4]} are not in the "
                                        f"runner's layer_name_to_kvcache_index")
            self._indices.append(list(dict.fromkeys(index[n] for n in group.layer_names)))
        self.runner = runner
        if self.producer:  # at start-up: a bad setting fails the engine's start, not a step
            from kvxfer.connector.prefill import PrefillWorker

            self._prefill = PrefillWorker(self.settings.connector_config(True), self._caches(),
                                          self.instance, model=self.model)
        if self.consumer:
            from kvxfer.connector.decode import DecodeConnector

            self._decode = DecodeConnector(self.settings.connector_config(False), self._caches(),
                                           model=self.model)

    def _caches(self) -> list[list[Any]]:
        caches = self.runner.kv_caches  # donated by every forward: read afresh at each use
        return [[caches[i] for i in indices] for indices in self._indices]

    def _store(self, per_group: list[list[Any]]) -> None:
        caches = list(self.runner.kv_caches)
        for indices, arrays in zip(self._indices, per_group):
            for i, array in zip(indices, arrays):
                caches[i] = array
        self.runner.kv_caches = caches

    def start_load(self, meta: KvxferMetadata) -> None:
        for what, params in [*(("expect", p) for p in meta.expects),
                             *(("cancel", p) for p in meta.cancels)]:
            try:
                getattr(self._decode, what)(params)
            except KvxferError as e:  # the load itself fails the request, by its own rules
                logger.warning("D cannot %s a request's params: %s", what, e)
        if meta.loads:
            self._decode.start_load_kv(meta.loads)

    def save(self, meta: KvxferMetadata) -> None:
        save = meta.save
        if save is None:
            return
        if save.blocks or save.holds or save.cancels:  # a cancel alone frees a stream's slots
            self._prefill.save(self._caches(), save)

    def poll(self) -> tuple[set[str], set[str]]:
        if self._prefill is not None:
            self._freed.update(self._prefill.poll())
        if self._decode is None:
            return set(), set()
        caches, finished, failed = self._decode.get_finished(self._caches())
        self._store(caches)  # the old arrays are donated once anything was scattered
        return set(finished), set(failed)

    def load_errors(self) -> set[int]:
        return self._decode.get_block_ids_with_load_errors() if self._decode else set()

    def report(self) -> WorkerReport | None:
        """This step's news for the scheduler: the requests freed since the last report;
        on a P across hosts, every step, every P process's agent and units; on D, the P
        agents it completed a handshake with since (what labels fallbacks)."""
        freed, self._freed = self._freed, set()
        prefill = self._prefill
        counts = dict.fromkeys(freed, 1)  # this worker's: the aggregate adds every worker's
        names = self._decode.transport.peers.verified_names() if self._decode else ()
        verified = tuple(n for n in names if n not in self._verified)[:VERIFIED_PER_REPORT]
        self._verified.update(verified)  # the rest: in the next reports
        if prefill is not None and prefill.sources:
            return WorkerReport(counts, tuple(prefill.sources), prefill.units, verified)
        return WorkerReport(counts, verified=verified) if counts or verified else None

    def close(self) -> None:
        for side in (self._prefill, self._decode):
            if side is not None:
                side.close()
