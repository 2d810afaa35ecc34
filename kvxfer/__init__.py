"""kvxfer: KV-cache transfer between prefill and decode instances on JAX/TPU.

Modules, in dependency order: `blocks` (block arithmetic), `scheduler` (save
plans), `layout` and `gather` (device caches <-> pinned host arrays),
`staging` and `transport` (NIXL), `connector`, `cli`.
"""

from kvxfer.errors import (
    CorruptionError,
    InvalidInputError,
    KvxferError,
    LayoutMismatchError,
    TransferError,
)

__all__ = [
    "CorruptionError",
    "InvalidInputError",
    "KvxferError",
    "LayoutMismatchError",
    "TransferError",
]
__version__ = "0.1.0"
