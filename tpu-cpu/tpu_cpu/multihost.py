"""One JAX instance over several CPU processes: what a TPU slice's runtime does, for Ray workers.

Off unless `TPU_CPU_JAX_COORDINATOR` is set. `scripts/ray-up` sets these in the environment of
each Ray node (`ray start`), which every Ray worker on that node inherits; vLLM's Ray executor
copies the driver's environment to its workers only where a worker lacks a variable, so the
node's own values win:

- `TPU_CPU_JAX_COORDINATOR`    `host:port` of JAX's coordinator, on the first node (process 0)
- `TPU_CPU_JAX_NUM_PROCESSES`  the number of processes (Ray nodes: one tpu-inference worker each)
- `TPU_CPU_JAX_PROCESS_ID`     this node's process index, 0 on the first node
- `VLLM_HOST_IP`               this node's address, given to gloo (below)

Why: on a TPU slice libtpu joins the hosts' processes into one JAX instance, so `jax.devices()`
lists every host's chips and tpu-inference builds one mesh over them (one Ray worker per host).
On CPU nothing does; each worker would see only its own devices. `install()` calls
`jax.distributed.initialize` from those variables, with gloo (TCP) for XLA:CPU's cross-process
collectives. Gloo finds its own address from the host name, which resolves to loopback inside a
network namespace, so it is given `VLLM_HOST_IP` instead (as `kvxfer.bench.hosts.start_jax` does).

And one difference of the CPU backend from a TPU host that then matters: tpu-inference loads
weights onto `jax.devices("cpu")[0]` (the host's memory on a TPU, where the CPU backend is never
distributed). Here the CPU backend is the distributed one, and `jax.devices("cpu")` lists process
0's devices first, which no other process can address ("cross-host reshard" errors). `install()`
makes `jax.devices("cpu")`, asked for by name, list this process's own devices first; the list
holds the same devices, and `jax.devices()` (the mesh's) keeps JAX's global order.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger(__name__)

COORDINATOR = "TPU_CPU_JAX_COORDINATOR"
NUM_PROCESSES = "TPU_CPU_JAX_NUM_PROCESSES"
PROCESS_ID = "TPU_CPU_JAX_PROCESS_ID"
TIMEOUT_S = 300  # every node's worker must join within this; they start together under Ray

_installed = False


def enabled() -> bool:
    return bool(os.environ.get(COORDINATOR))


def install() -> None:
    """With `TPU_CPU_JAX_COORDINATOR` set: joins this process to the JAX instance (once) and lists
    its own devices first in `jax.devices("cpu")`. Must run before JAX's backends start."""
    global _installed
    if _installed or not enabled():
        return
    import jax
    from jax._src import xla_bridge

    if jax.distributed.is_initialized():
        _installed = True
        return
    try:
        num_processes = int(os.environ[NUM_PROCESSES])
        process_id = int(os.environ[PROCESS_ID])
    except (KeyError, ValueError) as e:
        raise RuntimeError(f"{COORDINATOR} is set, so {NUM_PROCESSES} and {PROCESS_ID} must be "
                           f"ints: {e}") from e
    if xla_bridge.backends_are_initialized():
        raise RuntimeError(f"{COORDINATOR} is set but JAX's backends already started in this "
                           "process: jax.distributed can no longer be initialised")
    _installed = True
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    ip = os.environ.get("VLLM_HOST_IP")
    if ip:
        make = xla_bridge._jax.make_gloo_tcp_collectives
        xla_bridge._jax.make_gloo_tcp_collectives = lambda **kw: make(**kw, hostname=ip)
    log.info("tpu_cpu: joining JAX process %d of %d at %s", process_id, num_processes,
             os.environ[COORDINATOR])
    jax.distributed.initialize(os.environ[COORDINATOR], num_processes=num_processes,
                               process_id=process_id, initialization_timeout=TIMEOUT_S)
    _local_cpu_devices_first()


def _local_cpu_devices_first() -> None:
    import jax

    original = jax.devices
    if getattr(original, "_tpu_cpu", False):
        return

    def devices(backend=None):
        found = original(backend)
        if backend is None or (backend if isinstance(backend, str) else "") != "cpu":
            return found
        me = jax.process_index()
        return ([d for d in found if d.process_index == me]
                + [d for d in found if d.process_index != me])

    devices._tpu_cpu = True
    devices.__wrapped__ = original
    jax.devices = devices
