"""An in-process vLLM engine with a simulated JAX worker, for connector tests.

`Engine` drives a REAL vLLM v1 `Scheduler` (vLLM's own prefix caching, chunked
prefill, preemption and KV-connector hooks) and stands in for the model runner
with a tiny simulated forward pass that writes *token-stamped* KV into JAX
arrays laid out the way tpu-inference lays out its paged KV cache.  Two
Engines in one process (kv_role "kv_producer" and "kv_consumer") make a P/D
pair whose connector traffic can be checked byte for byte: the KV that D ends
up with at (layer, position) must equal `stamp(layer, position, token_id)`.

What mirrors what:

* `Engine.__init__` mirrors `EngineCore.__init__` / `_initialize_kv_caches`:
  it builds the `VllmConfig`, a hand-made `KVCacheConfig` shaped the way
  vLLM's planner (`get_kv_cache_config_from_groups`) shapes one, sets
  `cache_config.num_gpu_blocks`, `kv_cache_config.hash_block_size` and
  `cache_hit_alignment_tokens`, creates the Scheduler (which creates the
  SCHEDULER-role connector itself) and the request block hasher.
* The worker side mirrors tpu-inference: the WORKER-role connector comes from
  `KVConnectorFactory.create_connector` (as `ensure_kv_transfer_initialized`
  does), the runner's `kv_caches` is one JAX array per KV-cache *tensor slot*
  (`layer_name_to_kvcache_index` maps layer names onto it; layers of different
  hybrid groups that alias the same bytes in vLLM's plan share one array, as
  in tpu-inference's `initialize_kv_cache`), and the connector gets the runner
  through `register_runner`.
* `Engine.step` mirrors `EngineCore.step` + the runner's `execute_model`
  (+ `KVConnectorModelRunnerMixin._get_kv_connector_output`): schedule, bind
  metadata, start loads, forward, wait for saves, collect transfer results,
  `update_from_output`.  Like tpu-inference (and unlike vLLM's GPU runner,
  which starts async loads after launching the forward) `start_load_kv` runs
  before the forward.

The model is a registered toy architecture (`KvxferToyForCausalLM`) so that
vLLM never imports a real model file (vLLM's model inspection would otherwise
import `vllm.model_executor.models.llama` in a subprocess, which needs
packages this --no-deps install does not have).  No tokenizer is loaded.
"""

from __future__ import annotations

import json
import os
import random
import socket
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

# vLLM picks its platform from this at first use; without it the platform is
# "unspecified" (no hybrid KV cache manager support, no device type).
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

from vllm import ModelRegistry, SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory  # noqa: E402
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402
from vllm.v1.core.kv_cache_utils import (  # noqa: E402
    get_request_block_hasher,
    init_none_hash,
    resolve_cache_hit_alignment_tokens,
    resolve_kv_cache_block_sizes,
)
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    SlidingWindowSpec,
)
from vllm.v1.outputs import DraftTokenIds, KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

TOY_ARCH = "KvxferToyForCausalLM"
VOCAB_SIZE = 1000
MAX_MODEL_LEN = 1024
SLIDING_WINDOW = 32


class KvxferToyForCausalLM(torch.nn.Module):
    """Satisfies vLLM's text-generation model interface; never instantiated.

    Registered as a class (not a "module:Class" string) so vLLM inspects it
    in-process instead of importing a model module in a subprocess.
    """

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


ModelRegistry.register_model(TOY_ARCH, KvxferToyForCausalLM)


def make_model_dir(
    tmp_dir: str | os.PathLike,
    *,
    num_layers: int = 2,
    sliding_window: int | None = None,
    num_kv_heads: int = 4,
    head_dim: int = 32,
) -> str:
    """Writes a tiny Llama-shaped HF `config.json` into `tmp_dir`; returns the dir.

    The model never runs: vLLM only reads shapes (heads, head_dim, layers,
    max_model_len) from it.  `sliding_window` is recorded for completeness;
    the hybrid KV-cache layout is chosen by `Engine(hybrid=True)`, which
    builds the KVCacheConfig by hand.
    """
    os.makedirs(tmp_dir, exist_ok=True)
    cfg = {
        "architectures": [TOY_ARCH],
        "model_type": "llama",
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 8,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
    }
    if sliding_window is not None:
        cfg["sliding_window"] = sliding_window
    with open(os.path.join(tmp_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(tmp_dir)


def layer_name(i: int) -> str:
    """vLLM's attention-layer naming for decoder layer `i`."""
    return f"model.layers.{i}.self_attn.attn"


def packing(dtype: Any) -> int:
    """tpu-inference's sub-32-bit packing factor: 32 // bits (bf16 -> 2)."""
    return max(1, 4 // jnp.dtype(dtype).itemsize)


def kv_slot_shape(num_kv_heads: int, head_dim: int, dtype: Any) -> tuple[int, int, int]:
    """Shape of one token's KV in one layer, tpu-inference layout:
    `[cdiv(2 * num_kv_heads, p), p, head_dim]` (K and V heads interleaved)."""
    p = packing(dtype)
    return (-(-2 * num_kv_heads // p), p, head_dim)


def stamp(
    layer: int,
    position: int,
    token_id: int,
    *,
    num_kv_heads: int = 4,
    head_dim: int = 32,
    dtype: Any = jnp.bfloat16,
) -> np.ndarray:
    """The KV the simulated model writes for (layer, position, token_id).

    Small integers (|v| <= 119, exact in bf16/fp8-free dtypes, never NaN)
    derived from a mix of the three inputs, different in every element of the
    `[heads, p, head_dim]` slice so a transposed or shifted copy is caught.
    """
    return _stamps(np.array([layer]), np.array([position]), np.array([token_id]),
                   kv_slot_shape(num_kv_heads, head_dim, dtype), dtype)[0]


def _stamps(layers: np.ndarray, positions: np.ndarray, tokens: np.ndarray,
            slot_shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """Vectorised `stamp`: one `[*slot_shape]` array per (layer, position, token)."""
    n = int(np.prod(slot_shape))
    seed = (layers.astype(np.int64) * 1_000_003 + positions.astype(np.int64) * 7_919
            + tokens.astype(np.int64) * 104_729) % 2_147_483_647
    vals = (seed[:, None] + np.arange(n, dtype=np.int64)[None, :] * 31) % 239 - 119
    return vals.astype(jnp.dtype(dtype)).reshape((len(layers), *slot_shape))


def sample_token(token_ids: Sequence[int]) -> int:
    """The simulated model's greedy next token: a function of the whole prefix.

    Depends only on the tokens (not on the request id or engine), so P and D
    agree on what comes next for the same sequence.  Never a special id (< 10).
    """
    h = zlib.crc32(np.asarray(token_ids, dtype=np.int64).tobytes())
    return 10 + h % (VOCAB_SIZE - 10)


@dataclass
class Runner:
    """The attributes of tpu-inference's TPUModelRunner that a connector uses."""

    kv_caches: list[jax.Array]
    layer_name_to_kvcache_index: dict[str, int]
    mesh: Mesh
    vllm_config: VllmConfig
    kv_cache_config: KVCacheConfig


@dataclass
class StepResult:
    """What one `Engine.step` did.

    `finished` maps every request that finished this step to the
    `kv_transfer_params` vLLM returned for it (P: what D needs to pull).
    `scheduler_output` is None when vLLM would not have stepped (no requests).
    """

    scheduler_output: SchedulerOutput | None
    finished: dict[str, dict[str, Any] | None] = field(default_factory=dict)
    new_tokens: dict[str, list[int]] = field(default_factory=dict)
    connector_output: KVConnectorOutput | None = None
    model_runner_output: ModelRunnerOutput | None = None
    scheduler_stats: Any = None  # vLLM's SchedulerStats (with `log_stats=True`)


class Engine:
    """One vLLM instance (P, D, or plain) in this process; see the module docstring."""

    def __init__(
        self,
        model_dir: str,
        *,
        kv_role: str | None,
        extra_config: dict | None = None,
        devices: Sequence[jax.Device] | None = None,
        num_blocks: int = 64,
        block_size: int = 16,
        max_num_batched_tokens: int = 64,
        max_num_seqs: int = 8,
        enable_prefix_caching: bool = True,
        prefix_caching_hash_algo: str = "sha256",
        hybrid: bool = False,
        kv_load_failure_policy: str = "recompute",
        num_speculative_lookahead: int = 0,
        dtype: Any = jnp.bfloat16,
        sliding_window: int = SLIDING_WINDOW,
        kv_connector: str = "TPUConnector",
        kv_connector_module_path: str = "kvxfer.vllm",
        engine_id: str | None = None,
        instance_id: str | None = None,
        log_stats: bool = False,
        kv_events: bool = False,
    ) -> None:
        self.block_size = block_size
        self.dtype = jnp.dtype(dtype)
        devices = list(devices) if devices is not None else jax.devices()[:1]

        # --- VllmConfig (what `vllm serve` args would build) ---------------
        model_config = ModelConfig(
            model=model_dir, skip_tokenizer_init=True, dtype="bfloat16",
            max_model_len=MAX_MODEL_LEN, seed=0,
        )
        scheduler_config = SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=MAX_MODEL_LEN, enable_chunked_prefill=True,
            is_encoder_decoder=False, async_scheduling=False,
            # The hybrid manager only matters (and is only allowed to be forced
            # on) when the KV cache really has several groups.
            disable_hybrid_kv_cache_manager=None if hybrid else True,
        )
        cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=enable_prefix_caching,
                                   prefix_caching_hash_algo=prefix_caching_hash_algo)
        kv_transfer_config = None
        if kv_role is not None:
            kv_transfer_config = KVTransferConfig(
                kv_connector=kv_connector, kv_connector_module_path=kv_connector_module_path,
                kv_role=kv_role, kv_connector_extra_config=dict(extra_config or {}),
                kv_load_failure_policy=kv_load_failure_policy,
                **({"engine_id": engine_id} if engine_id is not None else {}),
            )
        speculative_config = None
        if num_speculative_lookahead:
            # "draft_model" with the same toy model is the cheapest method for
            # which vLLM reserves lookahead slots (num_lookahead_tokens == k).
            speculative_config = SpeculativeConfig(
                method="draft_model", model=model_dir,
                num_speculative_tokens=num_speculative_lookahead,
                target_model_config=model_config, target_parallel_config=ParallelConfig(),
            )
        self.vllm_config = VllmConfig(
            model_config=model_config, scheduler_config=scheduler_config,
            cache_config=cache_config, device_config=DeviceConfig("cpu"),
            kv_transfer_config=kv_transfer_config, speculative_config=speculative_config,
            # `--kv-events-config '{"enable_kv_cache_events": true}'`, published nowhere
            kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null")
            if kv_events else None,
        )
        if instance_id is not None:  # the hosts of one instance share it (sent with the config)
            self.vllm_config.instance_id = instance_id

        # --- KVCacheConfig (what EngineCore._initialize_kv_caches plans) ---
        self.num_layers = model_config.get_num_layers(self.vllm_config.parallel_config)
        self.num_kv_heads = model_config.get_total_num_kv_heads()
        self.head_dim = model_config.get_head_size()
        self.kv_cache_config = self._make_kv_cache_config(num_blocks, hybrid, sliding_window)
        self.vllm_config.cache_config.num_gpu_blocks = num_blocks
        sched_block_size, hash_block_size = resolve_kv_cache_block_sizes(
            self.kv_cache_config, self.vllm_config)
        self.kv_cache_config.hash_block_size = hash_block_size
        self.kv_cache_config.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(
            self.kv_cache_config, self.vllm_config, sched_block_size, hash_block_size)

        # --- Scheduler (creates the SCHEDULER-role connector itself) -------
        self.scheduler = Scheduler(
            vllm_config=self.vllm_config, kv_cache_config=self.kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=sched_block_size, hash_block_size=hash_block_size, log_stats=log_stats,
        )
        self.connector = self.scheduler.connector

        # EngineCore: block hashes are needed for prefix caching AND connectors.
        self._block_hasher = None
        if enable_prefix_caching or self.connector is not None:
            hash_fn = get_hash_fn_by_name(self.vllm_config.cache_config.prefix_caching_hash_algo)
            init_none_hash(hash_fn)
            # vLLM 0.33 hashes speculative lookahead tokens too; 0.32 has no such argument.
            lookahead = getattr(self.vllm_config, "num_hash_lookahead_tokens", None)
            self._block_hasher = get_request_block_hasher(
                hash_block_size, hash_fn, *(() if lookahead is None else (lookahead,)))

        # --- Worker side (tpu-inference TPUModelRunner + its connector) ----
        self.runner = self._make_runner(devices)
        self._write = self._make_writer()
        self.worker = None
        if kv_transfer_config is not None:
            self.worker = KVConnectorFactory.create_connector(
                config=self.vllm_config, role=KVConnectorRole.WORKER, kv_cache_config=self.kv_cache_config)
            self.worker.register_runner(self.runner)

        # Called with each step's scheduler output and tokens before the worker runs them.
        self.on_schedule: Callable[[SchedulerOutput, dict], None] | None = None
        # The harness's own (worker-side) view of each request's block table.
        self._tables: dict[str, list[list[int]]] = {}
        # Tables of requests vLLM told the worker are finished (kept for tests:
        # a producer's blocks stay allocated while the connector sends them).
        self._finished_tables: dict[str, list[list[int]]] = {}
        self._closed = False

    # ------------------------------------------------------------------ setup
    def _make_kv_cache_config(self, num_blocks: int, hybrid: bool, sliding_window: int) -> KVCacheConfig:
        """The config vLLM's planner would produce for this model.

        Non-hybrid: one full-attention group with every layer.  Hybrid: even
        layers full attention, odd layers sliding window, one group each.  As
        in `get_kv_cache_config_from_groups` (layer-outermost layout) there is
        one `KVCacheTensor` per group, each `num_blocks * page * L` bytes from
        byte 0, so layer j of group 0 and layer j of group 1 alias the same
        memory (a block id belongs to one group at a time).
        """
        kw = dict(block_size=self.block_size, num_kv_heads=self.num_kv_heads,
                  head_size=self.head_dim, dtype=torch.bfloat16)
        names = [layer_name(i) for i in range(self.num_layers)]
        if hybrid:
            groups = [
                KVCacheGroupSpec(names[0::2], FullAttentionSpec(**kw)),
                KVCacheGroupSpec(names[1::2], SlidingWindowSpec(sliding_window=sliding_window, **kw)),
            ]
        else:
            groups = [KVCacheGroupSpec(names, FullAttentionSpec(**kw))]
        page = groups[0].kv_cache_spec.page_size_bytes
        slots = max(len(g.layer_names) for g in groups)
        tensors = [
            KVCacheTensor(size=page * num_blocks * slots, layers=list(g.layer_names),
                          layer_stride=page * num_blocks, block_stride=page)
            for g in groups
        ]
        return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors, kv_cache_groups=groups)

    def _make_runner(self, devices: list[jax.Device]) -> Runner:
        """tpu-inference-style caches: one array per aliased layer slot."""
        mesh = Mesh(np.array(devices), ("model",))
        shape = (self.kv_cache_config.num_blocks, self.block_size,
                 *kv_slot_shape(self.num_kv_heads, self.head_dim, self.dtype))
        if shape[2] % len(devices):
            raise ValueError(f"{len(devices)} devices do not divide the KV-heads axis ({shape[2]})")
        self.sharding = NamedSharding(mesh, P(None, None, "model"))
        index: dict[str, int] = {}
        for tensor in self.kv_cache_config.kv_cache_tensors:
            for j, name in enumerate(tensor.layers):
                index[name] = j
        n_arrays = max(index.values()) + 1
        zeros = jax.jit(lambda: jnp.zeros(shape, self.dtype), out_shardings=self.sharding)
        caches = [zeros() for _ in range(n_arrays)]
        self.layer_group = {name: g for g, grp in enumerate(self.kv_cache_config.kv_cache_groups)
                            for name in grp.layer_names}
        return Runner(kv_caches=caches, layer_name_to_kvcache_index=index, mesh=mesh,
                      vllm_config=self.vllm_config, kv_cache_config=self.kv_cache_config)

    def _make_writer(self) -> Callable:
        """A jitted, donating scatter: caches[i].at[blocks[i], rows[i]].set(vals[i]).

        Shapes are padded to a fixed token count so it compiles once; padding
        rows use block id `num_blocks` (out of range) and are dropped.
        """
        def write(caches, blocks, rows, vals):
            return tuple(c.at[b, r].set(v, mode="drop") for c, b, r, v in zip(caches, blocks, rows, vals))

        n = len(self.runner.kv_caches)
        return jax.jit(write, donate_argnums=0, out_shardings=(self.sharding,) * n)

    # --------------------------------------------------------------- requests
    def add_request(self, req_id: str, prompt_token_ids: Sequence[int], *, max_tokens: int = 1,
                    kv_transfer_params: dict | None = None, cache_salt: str | None = None
                    ) -> Request:
        """Adds a greedy request.  `kv_transfer_params` travel the way vLLM's
        API server sends them: in `SamplingParams.extra_args["kv_transfer_params"]`,
        from which `Request.__init__` copies them to `request.kv_transfer_params`."""
        extra_args = {"kv_transfer_params": dict(kv_transfer_params)} if kv_transfer_params else None
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args=extra_args)
        req = Request(request_id=req_id, prompt_token_ids=list(prompt_token_ids), sampling_params=params,
                      pooling_params=None, block_hasher=self._block_hasher, cache_salt=cache_salt)
        self.scheduler.add_request(req)
        return req

    def abort(self, req_id: str) -> None:
        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)

    def table(self, req_id: str) -> tuple[list[int], ...]:
        """The harness's (worker-side) block table of `req_id`, one list per group.

        After vLLM reported the request finished, its last table (the blocks
        may since have been freed and reused)."""
        tables = self._tables.get(req_id) or self._finished_tables[req_id]
        return tuple(list(t) for t in tables)

    def read_token_kv(self, layer: int, block_id: int, row: int) -> np.ndarray:
        """KV of layer `layer` at (block_id, row), `[heads, p, head_dim]`, as numpy."""
        cache = self.runner.kv_caches[self.runner.layer_name_to_kvcache_index[layer_name(layer)]]
        return np.asarray(jax.device_get(cache[block_id, row]))

    def stamp(self, layer: int, position: int, token_id: int) -> np.ndarray:
        """`stamp` with this engine's shapes."""
        return stamp(layer, position, token_id, num_kv_heads=self.num_kv_heads,
                     head_dim=self.head_dim, dtype=self.dtype)

    def slot_of(self, req_id: str, layer: int, position: int) -> tuple[int, int]:
        """(block_id, row) where the harness's table puts `position` of `layer`."""
        group = self.layer_group[layer_name(layer)]
        return self.table(req_id)[group][position // self.block_size], position % self.block_size

    # ------------------------------------------------------------------- step
    def step(self) -> StepResult:
        """One `EngineCore.step`: schedule, run the simulated worker, update."""
        if not self.scheduler.has_requests():
            return StepResult(scheduler_output=None)
        so = self.scheduler.schedule()
        tokens = {r: (list(self.scheduler.requests[r].all_token_ids),
                      self.scheduler.requests[r].num_computed_tokens)
                  for r in so.num_scheduled_tokens}
        if self.on_schedule is not None:  # the other hosts of the instance run it too
            self.on_schedule(so, tokens)
        kv_out, mro = self.execute(so, tokens)
        outs = self.scheduler.update_from_output(so, mro)

        result = StepResult(scheduler_output=so, connector_output=kv_out, model_runner_output=mro)
        for eco in outs.values():
            result.scheduler_stats = eco.scheduler_stats or result.scheduler_stats
            for o in eco.outputs:
                if o.new_token_ids:
                    result.new_tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finished:
                    result.finished[o.request_id] = o.kv_transfer_params
        self._propose_drafts(so)
        return result

    def execute(self, so: SchedulerOutput, tokens: dict[str, tuple[list[int], int]]
                ) -> tuple[KVConnectorOutput | None, ModelRunnerOutput]:
        """The worker's half of a step (what every host of an instance runs): `tokens` maps
        each scheduled request to its token ids and computed count after scheduling."""
        self._update_tables(so)
        worker = self.worker
        if worker is not None:
            assert so.kv_connector_metadata is not None
            worker.bind_connector_metadata(so.kv_connector_metadata)
            worker.start_load_kv(None)  # vLLM passes the forward context

        self._apply_block_copies(so)
        req_ids, sampled = self._forward(so, tokens)

        kv_out = None
        if worker is not None:
            worker.wait_for_save()
            res = worker.get_transfer_results(so.finished_req_ids)
            kv_out = KVConnectorOutput(
                finished_sending=res.finished_sending, finished_recving=res.finished_recving,
                failed_recving=res.failed_recving,
                invalid_block_ids=worker.get_block_ids_with_load_errors(),
                kv_connector_stats=worker.get_kv_connector_stats(),
                kv_cache_events=worker.get_kv_connector_kv_cache_events(),
                kv_connector_worker_meta=worker.build_connector_worker_meta(),
            )
            worker.clear_connector_metadata()

        mro = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled, kv_connector_output=kv_out,
        )
        return kv_out, mro

    def _update_tables(self, so: SchedulerOutput) -> None:
        """Mirrors the runner's `_update_states`: whole table for new and
        resumed requests, appended new blocks for running ones."""
        for req_id in so.finished_req_ids:
            if req_id in self._tables:
                self._finished_tables[req_id] = self._tables.pop(req_id)
        for new in so.scheduled_new_reqs:
            self._tables[new.req_id] = [list(b) for b in new.block_ids]
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new_ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                assert new_ids is not None
                self._tables[req_id] = [list(b) for b in new_ids]
            elif new_ids is not None:
                for table, ids in zip(self._tables[req_id], new_ids):
                    table.extend(ids)

    def _apply_block_copies(self, so: SchedulerOutput) -> None:
        """vLLM's copy-on-write of partially hit prefix blocks (rare; all slots)."""
        for copy in so.kv_cache_block_copies or ():
            self.runner.kv_caches = [c.at[copy.dst_block_id].set(c[copy.src_block_id])
                                     for c in self.runner.kv_caches]

    def _forward(self, so: SchedulerOutput, tokens_of: dict[str, tuple[list[int], int]]
                 ) -> tuple[list[str], list[list[int]]]:
        """Writes stamped KV for every scheduled token; samples where a real model would."""
        n_slots = len(self.runner.kv_caches)
        groups = self.kv_cache_config.kv_cache_groups
        blocks: list[list[int]] = [[] for _ in range(n_slots)]
        rows: list[list[int]] = [[] for _ in range(n_slots)]
        keys: list[list[tuple[int, int, int]]] = [[] for _ in range(n_slots)]
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        for req_id, n in so.num_scheduled_tokens.items():
            tokens, computed = tokens_of[req_id]
            spec = so.scheduled_spec_decode_tokens.get(req_id, [])
            # schedule() advances num_computed_tokens by the scheduled count right away
            # (sync scheduling), so the step began n tokens ago.
            start = computed - n
            for pos in range(start, start + n):
                if pos < len(tokens):
                    tok = tokens[pos]
                elif pos - len(tokens) < len(spec):
                    tok = spec[pos - len(tokens)]
                else:
                    tok = tokens[-1]
                for g, grp in enumerate(groups):
                    block = self._tables[req_id][g][pos // self.block_size]
                    for name in grp.layer_names:
                        slot = self.runner.layer_name_to_kvcache_index[name]
                        blocks[slot].append(block)
                        rows[slot].append(pos % self.block_size)
                        keys[slot].append((int(name.split(".")[2]), pos, tok))
            req_ids.append(req_id)
            if start + n < len(tokens):
                sampled.append([])  # partial prefill chunk: nothing sampled
            else:
                sampled.append(self._verify(tokens, spec))
        self._scatter(blocks, rows, keys)
        return req_ids, sampled

    @staticmethod
    def _verify(tokens: list[int], spec: list[int]) -> list[int]:
        """Greedy speculative verification (rejection sampler at temperature 0):
        accepted drafts, then the first correction or the bonus token."""
        out, seq = [], list(tokens)
        for d in spec:
            t = sample_token(seq)
            out.append(t)
            if t != d:
                return out
            seq.append(d)
        out.append(sample_token(seq))
        return out

    def _scatter(self, blocks, rows, keys) -> None:
        cap = max([len(b) for b in blocks] + [1])
        cap = 1 << (cap - 1).bit_length()  # few distinct shapes -> few compiles
        oob = self.kv_cache_config.num_blocks
        slot_shape = kv_slot_shape(self.num_kv_heads, self.head_dim, self.dtype)
        b_args, r_args, v_args = [], [], []
        for b, r, k in zip(blocks, rows, keys):
            pad = cap - len(b)
            b_args.append(np.array(b + [oob] * pad, np.int32))
            r_args.append(np.array(r + [0] * pad, np.int32))
            vals = np.zeros((cap, *slot_shape), self.dtype)
            if k:
                arr = np.array(k, np.int64)
                vals[: len(k)] = _stamps(arr[:, 0], arr[:, 1], arr[:, 2], slot_shape, self.dtype)
            v_args.append(vals)
        self.runner.kv_caches = list(self._write(tuple(self.runner.kv_caches), b_args, r_args, v_args))

    def _propose_drafts(self, so: SchedulerOutput) -> None:
        """EngineCore.post_step: hand the drafter's proposals to the scheduler."""
        k = self.vllm_config.num_speculative_tokens
        if not k or not so.total_num_scheduled_tokens:
            return
        ids = [r for r in so.num_scheduled_tokens if r in self.scheduler.requests]
        drafts = []
        for r in ids:
            toks = list(self.scheduler.requests[r].all_token_ids)
            d = []
            for _ in range(k):
                d.append(sample_token(toks + d))
            drafts.append(d)
        self.scheduler.update_draft_token_ids(DraftTokenIds(ids, drafts))

    # ----------------------------------------------------------------- helpers
    def run_until(self, predicate: Callable[[StepResult], bool] | Callable[[], bool],
                  max_steps: int = 200, min_s: float = 0.0) -> list[StepResult]:
        """Steps until `predicate(result)` (or `predicate()`) is true; returns all results.

        Raises AssertionError after `max_steps` steps without it, and at least `min_s`
        seconds (an engine waiting on a peer steps fast with nothing to do).
        """
        import inspect
        import time

        takes_arg = len(inspect.signature(predicate).parameters) > 0
        results, start, steps = [], time.monotonic(), 0
        while steps < max_steps or time.monotonic() - start < min_s:
            steps += 1
            results.append(self.step())
            if predicate(results[-1]) if takes_arg else predicate():
                return results
            if steps >= max_steps:
                time.sleep(0.005)
        raise AssertionError(f"predicate not reached in {steps} steps")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.worker is not None:
            self.worker.shutdown()
        if self.connector is not None:
            self.connector.shutdown()


def listen_port() -> int:
    """A port for a P to listen on, free now and below Linux's ephemeral range (32768-60999):
    `kvxfer.nixl.agent.free_port`'s is in that range, where an outgoing connection's source
    port may take it before the agent binds it (a test's P then fails to start)."""
    for _ in range(200):
        port = random.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32000")
