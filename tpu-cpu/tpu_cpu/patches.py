"""The process-wide shims tpu-inference 0.32 needs to start on JAX's CPU backend.

Each function below changes one thing, says why, and is idempotent; `install()` applies them all.
They must run before tpu-inference is imported (torchax builds its op tables at import, and
tpu-inference reads device kinds while it builds its mesh), which is why the platform plugin
(`tpu_cpu.platform`, called when vLLM first resolves its platform in every process, before it
imports the platform class) is what calls `install()`.

None of them touches the model's numerics or the KV cache: they answer questions a TPU would
answer (topology, kind), drop TPU-only compiler options, make host-to-device puts copy as they do
on a TPU, and keep two unrelated torch-side imports from failing.
"""

from __future__ import annotations

import os

# The TPU generation JAX's CPU devices pretend to be. tpu-inference sizes the KV cache from this
# generation's HBM (v6e: 32 GiB per chip) times `--gpu-memory-utilization`, so serve with about
# 0.005-0.01 (160-320 MiB per device).
DEVICE_KIND = "TPU v6 lite"

# Metadata tpu-inference (through tpu-info) otherwise polls from the GCE metadata server, which
# does not exist here: each poll waits for a timeout. Defaults only; the environment wins.
TPU_METADATA = {"TPU_ACCELERATOR_TYPE": "v6e-8", "TPU_NAME": "cpu", "TPU_WORKER_ID": "0"}

_installed = False


def install() -> None:
    """Applies every shim of this module once per process."""
    global _installed
    if _installed:
        return
    _installed = True
    for name, value in TPU_METADATA.items():
        os.environ.setdefault(name, value)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    patch_device_topology()
    patch_device_kind()
    patch_compile_options()
    patch_device_put_copies_host_arrays()
    patch_make_array_from_callback_copies_host_arrays()
    patch_torch_named_overloads()
    patch_torchvision_register_fake()


def patch_device_topology() -> None:
    """Gives JAX CPU devices a TPU-like topology: `coords == (id, 0, 0)`, `core_on_chip == 0`.

    Why: tpu-inference sorts devices by `Device.coords` and `Device.core_on_chip` when it builds
    its mesh and logs them; CPU devices have neither attribute. A line of chips, one core each,
    keeps the devices in id order, which is the order `jax.devices()` already gives.
    """
    from jaxlib import _jax

    if not hasattr(_jax.Device, "coords"):
        _jax.Device.coords = property(lambda device: (device.id, 0, 0))
    if not hasattr(_jax.Device, "core_on_chip"):
        _jax.Device.core_on_chip = property(lambda device: 0)


def patch_device_kind() -> None:
    """Reports a CPU device's `device_kind` as `DEVICE_KIND` ("TPU v6 lite"); `platform` stays "cpu".

    Why: tpu-inference refuses devices whose kind lacks "TPU" ("Expected TPU devices") and reads
    the generation from it (HBM size for KV sizing, block-size tables). JAX itself dispatches on
    `platform`, which this leaves alone, so compilation and execution stay XLA:CPU's.
    """
    from jaxlib import _jax

    original = _jax.Device.device_kind
    if getattr(original, "_tpu_cpu", False):
        return
    get_kind = original.__get__

    def device_kind(device):
        kind = get_kind(device)
        return DEVICE_KIND if kind == "cpu" else kind

    patched = property(device_kind)
    # A property object takes no attributes; mark the getter instead.
    device_kind._tpu_cpu = True
    _jax.Device.device_kind = patched


def patch_compile_options() -> None:
    """Drops `xla_tpu_*` entries from the per-jit XLA option overrides before compiling.

    Why: tpu-inference jits its step and sampling functions with TPU-only options
    (`compiler_options={"xla_tpu_...": ...}`); XLA:CPU rejects every option it does not know
    ("No such compile option"). The options only tune TPU code generation.
    """
    from jax._src import compiler

    original = compiler.get_compile_options
    if getattr(original, "_tpu_cpu", False):
        return

    def get_compile_options(*args, **kwargs):
        overrides = kwargs.get("env_options_overrides")
        if overrides:
            kwargs["env_options_overrides"] = {
                name: value for name, value in overrides.items() if not name.startswith("xla_tpu_")
            }
        return original(*args, **kwargs)

    get_compile_options._tpu_cpu = True
    compiler.get_compile_options = get_compile_options


def patch_device_put_copies_host_arrays() -> None:
    """Makes `jax.device_put` copy numpy arrays before putting them, so the result never aliases them.

    Why: on a TPU, `device_put` always copies host memory into HBM. On JAX's CPU backend it may
    wrap the numpy memory itself (zero-copy; e.g. any 1-D int32 view put with a
    `PartitionSpec("data")` sharding on a 2-device mesh). tpu-inference builds every step's
    inputs (token ids, positions, `query_start_loc`, `seq_lens`, block tables: one
    `DeviceBuffer`) in persistent numpy buffers that it rewrites in place for the next step, and
    with async scheduling (vLLM's default) it prepares step N+1 while step N still runs. Aliased,
    step N's attention then reads step N+1's metadata halfway through: K/V land in the wrong slots
    or pages, cached prefix pages are corrupted, and later requests, even single ones, come out
    different (1e-2..1 in logprob) depending on what ran before. Copying restores TPU semantics.
    Arrays already on a device, and calls that pass `may_alias`, are left alone.
    """
    import jax
    import numpy as np

    original = jax.device_put
    if getattr(original, "_tpu_cpu", False):
        return

    def device_put(x, *args, **kwargs):
        if kwargs.get("may_alias") is None:
            # A private copy per call: whatever JAX then aliases is memory no one else writes.
            # (`may_alias=False` alone still aliases some sharded puts in JAX 0.10.)
            x = jax.tree_util.tree_map(
                lambda leaf: np.array(leaf, copy=True) if isinstance(leaf, np.ndarray) else leaf, x
            )
        return original(x, *args, **kwargs)

    device_put._tpu_cpu = True
    device_put.__wrapped__ = original
    jax.device_put = device_put


def patch_make_array_from_callback_copies_host_arrays() -> None:
    """Makes `jax.make_array_from_callback` copy the numpy arrays its callback returns.

    Why: the same aliasing as `patch_device_put_copies_host_arrays`, on the other path.
    Under its Ray executor (`TPU_MULTIHOST_BACKEND=ray`) tpu-inference puts every step's inputs
    through `general_device_put`, which builds them with `make_array_from_callback(...,
    lambda index: t[index])`: a view of the persistent host buffer it rewrites for the next step.
    JAX's CPU backend may wrap that memory without copying. Seen across two Ray nodes: the same
    greedy request, repeated on one server, gave decode logprobs that differed by about 1e-2 from
    run to run. Copying restores a TPU's semantics (a host-to-device transfer copies).
    """
    import jax
    import numpy as np

    original = jax.make_array_from_callback
    if getattr(original, "_tpu_cpu", False):
        return

    def make_array_from_callback(shape, sharding, data_callback, *args, **kwargs):
        def copied(index):
            data = data_callback(index)
            return np.array(data, copy=True) if isinstance(data, np.ndarray) else data

        return original(shape, sharding, copied, *args, **kwargs)

    make_array_from_callback._tpu_cpu = True
    make_array_from_callback.__wrapped__ = original
    jax.make_array_from_callback = make_array_from_callback


class _MissingOverload:
    """Stands for a named-tensor overload this torch lacks: matches no decomposition, fails if called."""

    def __init__(self, qualname: str):
        self.qualname = qualname

    def __repr__(self) -> str:
        return f"<missing torch overload {self.qualname}>"

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"{self.qualname} does not exist in this torch build (tpu_cpu shim)")


def _is_named_tensor_overload(name: str) -> bool:
    lowered = name.lower()
    return "dimname" in lowered or lowered.startswith("names") or "_names" in lowered


def patch_torch_named_overloads() -> None:
    """Answers a lookup of a missing named-tensor overload (`aten.all.dimname`, ...) with a placeholder.

    Why: torchax 0.0.13 (imported by tpu-inference) lists `Dimname` overloads in its autocast and
    decomposition tables at import time; torch 2.13 no longer has them, so the import raises
    AttributeError. The placeholder is a dict key nobody looks up and is skipped by
    `torch._decomp.get_decompositions`; any other missing attribute still raises.
    """
    from torch import _ops

    original = _ops.OpOverloadPacket.__getattr__
    if getattr(original, "_tpu_cpu", False):
        return

    def getattr_(self, key):
        try:
            return original(self, key)
        except AttributeError:
            if _is_named_tensor_overload(key):
                return _MissingOverload(f"{self._qualified_op_name}.{key}")
            raise

    getattr_._tpu_cpu = True
    _ops.OpOverloadPacket.__getattr__ = getattr_


def patch_torchvision_register_fake() -> None:
    """Makes `torch.library.register_fake("torchvision::<op>")` a no-op when that op is not registered.

    Why: the PyPI torchvision 0.28.0 wheel (the one matching torch 2.13) is a CUDA build whose
    `_C` extension does not load against the CPU torch, so its ops are never registered, and its
    `_meta_registrations` then raises on `register_fake("torchvision::nms")`. tpu-inference imports
    every JAX model at load time, among them a multimodal one whose transformers processor imports
    torchvision. Its pure-Python transforms still work; only the missing ops' fakes are skipped.
    """
    import torch
    import torch.library

    original = torch.library.register_fake
    if getattr(original, "_tpu_cpu", False):
        return

    def register_fake(op, *args, **kwargs):
        if isinstance(op, str) and op.startswith("torchvision::"):
            namespace, name = op.split("::", 1)
            try:
                getattr(getattr(torch.ops, namespace), name)
            except (AttributeError, RuntimeError):
                # Used as `@register_fake(op)` (returns a decorator) or `register_fake(op, fn)`.
                return args[0] if args else (lambda fn: fn)
        return original(op, *args, **kwargs)

    register_fake._tpu_cpu = True
    torch.library.register_fake = register_fake
