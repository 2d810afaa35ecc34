"""kvxfer: KV-cache transfer between prefill and decode instances on JAX/TPU.

The names a serving backend needs, from the modules that own them:

    from kvxfer import (ConnectorConfig, TransportConfig, GroupSpec, ScheduledRequest,
                        PrefillConnector, DecodeConnector, LoadRequest, StreamParams,
                        new_stream_id, prompt_digest)

They load on first use, so that `import kvxfer` (and vLLM's scheduler process,
which imports `kvxfer.connector.scheduler`) loads neither JAX nor NIXL. The
layers, each importing only those before it: `plan` (save plans), `device`
(caches to host-memory staging), `nixl` (the transport), `connector` (P and
D), `vllm` (the vLLM connector); `serve` (the proxy) needs only `plan` and
`nixl`. docs/architecture.md has the reading path.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from kvxfer import _moved
from kvxfer.errors import (
    CorruptionError,
    InvalidInputError,
    KvxferError,
    LayoutMismatchError,
    TransferError,
)

if TYPE_CHECKING:
    from kvxfer.connector.config import ConnectorConfig
    from kvxfer.connector.decode import DecodeConnector
    from kvxfer.connector.prefill import PrefillConnector, PrefillWorker
    from kvxfer.connector.scheduler import LoadRequest, PeerAddress, PrefillScheduler, SaveMeta
    from kvxfer.nixl.agent import TransportConfig
    from kvxfer.nixl.wire import StreamParams, new_stream_id, prompt_digest
    from kvxfer.plan.save_plan import GroupSpec, ScheduledRequest
    from kvxfer.stats import Stats, Trace

_LAZY = {
    "ConnectorConfig": "kvxfer.connector.config",
    "DecodeConnector": "kvxfer.connector.decode",
    "GroupSpec": "kvxfer.plan.save_plan",
    "LoadRequest": "kvxfer.connector.scheduler",
    "PeerAddress": "kvxfer.connector.scheduler",
    "PrefillConnector": "kvxfer.connector.prefill",
    "PrefillScheduler": "kvxfer.connector.scheduler",
    "PrefillWorker": "kvxfer.connector.prefill",
    "SaveMeta": "kvxfer.connector.scheduler",
    "ScheduledRequest": "kvxfer.plan.save_plan",
    "Stats": "kvxfer.stats",
    "StreamParams": "kvxfer.nixl.wire",
    "Trace": "kvxfer.stats",
    "TransportConfig": "kvxfer.nixl.agent",
    "new_stream_id": "kvxfer.nixl.wire",
    "prompt_digest": "kvxfer.nixl.wire",
}

__all__ = [
    "ConnectorConfig",
    "CorruptionError",
    "DecodeConnector",
    "GroupSpec",
    "InvalidInputError",
    "KvxferError",
    "LayoutMismatchError",
    "LoadRequest",
    "PeerAddress",
    "PrefillConnector",
    "PrefillScheduler",
    "PrefillWorker",
    "SaveMeta",
    "ScheduledRequest",
    "Stats",
    "StreamParams",
    "Trace",
    "TransferError",
    "TransportConfig",
    "new_stream_id",
    "prompt_digest",
]
__version__ = "0.1.0"

_moved.install()


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvxfer' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
