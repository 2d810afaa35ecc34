"""tpu_cpu: tpu-inference 0.32's real engine (vLLM's TPU backend) on JAX's CPU backend.

A vLLM plugin package for kvxfer's serving tests, installed only into `.venv-tpu`
(`scripts/tpu-inference-env`); it is not part of kvxfer. It lets `vllm serve` run
tpu-inference's own `TPUModelRunner`, metadata, `shard_map`s and KV cache allocation on a machine
without TPUs, by changing as little as possible:

- `platform()`, a `vllm.platform_plugins` entry point, selects tpu-inference's `TpuPlatform`.
  vLLM's built-in TPU plugin selects it only if `import libtpu` works; this one does exactly when
  that fails, so the two never both activate. Before answering, it applies `patches.install()`
  (device topology and kind, TPU-only compiler options, two torch-side import fixes): vLLM calls
  platform plugins in every process before it imports the platform class, which is before
  anything imports tpu-inference.
- `general()`, a `vllm.general_plugins` entry point (vLLM calls those in the engine-core and
  worker processes before it builds the model), swaps the Pallas ragged paged attention kernel
  for the pure-JAX `attention.ragged_paged_attention`.
- `torchvision_hook`, installed by a `.pth` file: the torchvision shim, which must be in place
  before vLLM loads any plugin (see its docstring for the process that needs it).
- the `tokamax` package beside this one is a stub of the two names tpu-inference imports from
  tokamax (which needs Python >= 3.12); see its docstring.

With libtpu importable (a real TPU host) both entry points do nothing.

Off by default: one JAX instance over several Ray nodes (`multihost`: `jax.distributed` from
`TPU_CPU_JAX_COORDINATOR` and its siblings, which `scripts/ray-up` sets on each node), applied by
`general()` in the worker of each node before its backends start.

Off by default: what tpu-inference's own KV connector needs (`tpu_connector`: its copy kernels
in plain JAX, and the order it needs vLLM 0.32 to call `start_load_kv` in), installed only with
`TPU_CPU_TPU_CONNECTOR=1`, for the benchmark that compares connectors (`kvxfer bench serve`).
"""

from __future__ import annotations

import importlib.util
import os

PLATFORM = "tpu_inference.platforms.tpu_platform.TpuPlatform"


def active() -> bool:
    """True where vLLM's own TPU plugin stays inactive: this process cannot import libtpu."""
    return importlib.util.find_spec("libtpu") is None


def platform() -> str | None:
    """vLLM platform plugin: tpu-inference's `TpuPlatform` on CPU, after the process-wide shims."""
    if not active():
        return None
    from tpu_cpu import patches

    patches.install()
    return PLATFORM


def general() -> None:
    """vLLM general plugin: the pure-JAX attention stand-in in place of the Pallas kernel (and,
    with `TPU_CPU_JAX_COORDINATOR` set, this process joined to a JAX instance over several
    processes: `multihost`; with `TPU_CPU_TPU_CONNECTOR=1`, what tpu-inference's own connector
    needs: `tpu_connector`)."""
    if not active():
        return
    from tpu_cpu import attention, multihost, patches

    patches.install()
    multihost.install()
    attention.install()
    if os.environ.get("TPU_CPU_TPU_CONNECTOR") == "1":
        from tpu_cpu import tpu_connector

        tpu_connector.install_copies()
        tpu_connector.load_before_forward()
