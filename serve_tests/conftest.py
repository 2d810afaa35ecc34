"""The serving tests' stacks, one per module that asks for it (see serve_stack.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from serve_stack import Stack, start, start_ray

EVENTS = "kv-events"
"""fail_stack's P publishes KV events on the socket ipc://<its run directory>/EVENTS."""
EVERY_PROMPT_THROUGH_P = "--local-prefill-tokens 0"
"""The stacks' proxies send every prompt through P, even one D holds: their tests move KV (the
proxy's default routing has its own test, `test_serve.py`'s `routing_proxy`)."""


@pytest.fixture(scope="module")
def tp_stack() -> Iterator[Stack]:
    """P at TP 2, D at TP 1 (forced CPU devices), D recomputing a failed load."""
    yield from start("tp", PD_P_TP="2", PD_D_TP="1", PD_D_POLICY="recompute",
                     PD_P_PORT="8110", PD_D_PORT="8210", PD_PROXY_PORT="8010", PD_KV_PORT="5611",
                     PD_PROXY_ARGS=EVERY_PROMPT_THROUGH_P)


@pytest.fixture(scope="module")
def fail_stack() -> Iterator[Stack]:
    """P and D at TP 1, D failing a request whose load failed (`kv_load_failure_policy=fail`);
    no device prefix cache on either, and a host pool on P (16 MiB), so that P's prompt hits
    are its pool's; P publishes KV events over ZMQ on `EVENTS_PORT`."""
    yield from start("fail", PD_D_POLICY="fail", PD_P_PORT="8120", PD_D_PORT="8220",
                     PD_PROXY_PORT="8020", PD_KV_PORT="5612", PD_HOST_POOL_BYTES=str(16 << 20),
                     PD_PROXY_ARGS=EVERY_PROMPT_THROUGH_P,
                     PD_KV_EVENTS="1",  # on an ipc:// socket in its run directory
                     PD_EXTRA_ARGS="--enable-prompt-tokens-details --no-enable-prefix-caching")


@pytest.fixture(scope="module")
def router_stack() -> Iterator[Stack]:
    """P and D at TP 1 behind vllm-router (`PD_FRONT=vllm-router`) instead of `kvxfer proxy`,
    each engine pinned to a core of its own (`PD_P_CPUS`, `PD_D_CPUS`), D with the decode
    batch of two colocated instances (`PD_D_MAX_NUM_SEQS`)."""
    yield from start("router", PD_FRONT="vllm-router", PD_P_PORT="8140", PD_D_PORT="8240",
                     PD_PROXY_PORT="8040", PD_KV_PORT="5614", PD_P_CPUS="0", PD_D_CPUS="1",
                     PD_D_MAX_NUM_SEQS="8")


@pytest.fixture(scope="module")
def ray_stack() -> Iterator[Stack]:
    """P and D each over two Ray nodes (tpu-inference's Ray executor), by `scripts/ray-pd-up`."""
    yield from start_ray("ray")
