"""kvxfer as a vLLM KV connector: `kvxfer.vllm.TPUConnector` (see README.md here).

vLLM loads it by name (`"kv_connector_module_path": "kvxfer.vllm"`). The connector, which
imports vLLM, loads on first use of one of its names, so `kvxfer.vllm.settings` and
`kvxfer.vllm.metrics` import without vLLM.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvxfer.vllm.connector import Settings, TPUConnector, group_specs, model_description
    from kvxfer.vllm.scheduler_side import scheduled_requests

__all__ = ["Settings", "TPUConnector", "group_specs", "model_description", "scheduled_requests"]

_HOMES = {"scheduled_requests": "kvxfer.vllm.scheduler_side"}  # the rest: kvxfer.vllm.connector


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module 'kvxfer.vllm' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES.get(name, "kvxfer.vllm.connector")), name)


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
