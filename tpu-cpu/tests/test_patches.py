"""tpu_cpu.patches: host-to-device puts copy, as on a TPU."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

# Runs in a fresh process: the aliasing needs two CPU devices, which XLA_FLAGS fixes before JAX
# starts. It builds one step's metadata the way tpu-inference's runner does (its DeviceBuffer, its
# device_array, PartitionSpec(BATCH) on a (data=1, model=2) mesh), starts a computation that reads
# it only after a while, and rewrites the buffer for the "next step" meanwhile, as the runner does
# under async scheduling. The step must see its own metadata.
SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    from tpu_cpu import patches
    patches.install()
    import jax, jax.numpy as jnp, numpy as np
    if sys.argv[1] == "unpatched":
        jax.device_put = jax.device_put.__wrapped__
    if sys.argv[1] == "unpatched_callback":
        jax.make_array_from_callback = jax.make_array_from_callback.__wrapped__
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    from tpu_inference.utils import DeviceBuffer, device_array

    mesh = Mesh(np.array(jax.devices()).reshape(1, 2), ("data", "model"))
    buffer = DeviceBuffer()
    # JAX aliases host memory only where it is aligned enough (which is why the served engine's
    # drift came and went from run to run); align the buffer so that the unpatched put aliases.
    raw = np.zeros(2048, np.int32)
    start = (-raw.ctypes.data % 4096) // 4
    buffer.buffer = raw[start : start + 1024]
    buffer.get_view((64,), key="seq_lens")[:] = np.arange(64)
    blob, layout = buffer.build()
    metadata = device_array(mesh, blob, sharding=NamedSharding(mesh, PartitionSpec("data")))

    def slow(x):
        time.sleep(0.5)
        return np.int32(0)

    @jax.jit
    def step(seq_lens):
        wait = jax.pure_callback(slow, jax.ShapeDtypeStruct((), jnp.int32), seq_lens[0])
        return jnp.sum(seq_lens + wait)

    result = step(metadata)  # dispatched, still running
    buffer.reset()
    buffer.get_view((64,), key="seq_lens")[:] = 1000  # the next step's metadata
    print(int(result), int(metadata[5]))
    """
)


def _start(mode: str, backend: str = "") -> subprocess.Popen:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    env.pop("TPU_MULTIHOST_BACKEND", None)
    if backend:
        env["TPU_MULTIHOST_BACKEND"] = backend
    return subprocess.Popen([sys.executable, "-c", SCRIPT, mode], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


_MODES = [("patched", ""), ("unpatched", ""), ("patched", "ray"), ("unpatched_callback", "ray")]
_RUNS: dict[tuple[str, str], subprocess.Popen] = {}


def run(mode: str, backend: str = "") -> tuple[int, int]:
    # The first call starts all four runs at once: each spends most of its time importing
    # tpu-inference, and one after another they took a minute.
    if not _RUNS:
        _RUNS.update({m: _start(*m) for m in _MODES})
    process = _RUNS[mode, backend]
    stdout, stderr = process.communicate(timeout=240)
    assert process.returncode == 0, stderr[-3000:]
    total, fifth = stdout.split()[-2:]
    return int(total), int(fifth)


def test_a_step_sees_its_own_metadata_while_the_next_step_is_prepared():
    assert run("patched") == (sum(range(64)), 5)


def test_device_put_still_aliases_without_the_patch():
    # Documents why the patch exists; if a JAX release stops aliasing, the patch becomes a no-op.
    assert run("unpatched") != (sum(range(64)), 5)


# Under its Ray executor (TPU_MULTIHOST_BACKEND=ray) tpu-inference's device_array builds the array
# with jax.make_array_from_callback from views of the buffer instead of device_put.
def test_under_ray_a_step_sees_its_own_metadata_while_the_next_step_is_prepared():
    assert run("patched", backend="ray") == (sum(range(64)), 5)


def test_make_array_from_callback_still_aliases_without_the_patch():
    assert run("unpatched_callback", backend="ray") != (sum(range(64)), 5)
