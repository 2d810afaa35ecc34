"""Agreement among the processes of one instance that spans hosts (`jax.distributed`).

Every process of an SPMD engine runs the same steps, so at a step where they
must decide together (is this request read everywhere? freed everywhere?)
each calls `agree` with its own flags, in the same order, and all get every
process's row. Through the key-value store of JAX's coordination service: a
peer that never arrives is a `TransferError` naming it, not a hang.
"""


from __future__ import annotations

import itertools
import secrets
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from kvxfer.errors import TransferError

__all__ = ["agree", "shared_instance", "spans_processes"]


def spans_processes(caches: Sequence[jax.Array]) -> bool:
    """Whether the caches' mesh spans several processes (hosts)."""
    return not caches[0].is_fully_addressable


_AGREE_BUCKET = 256  # agreements per key directory; rank 0 drops a directory two later


_AGREE_TIMEOUT_S = 600.0  # a peer busy compiling can take minutes; a dead one never comes


_agreements = itertools.count()


def _coordination_client() -> Any:
    """JAX's coordination-service client (`jax.distributed`), or None where it is not there."""
    try:
        from jax._src import distributed
    except ImportError:
        return None
    return getattr(distributed.global_state, "client", None)


def agree(flags: Sequence[int] | np.ndarray) -> np.ndarray:
    """`int32[processes, n]`: every process's `flags` (n of them), gathered in every process.

    Through the key-value store of JAX's coordination service (the one
    `jax.distributed.initialize` starts): each process sets its row under the
    call's number and reads the others', at less than half the cost of
    `multihost_utils.process_allgather` (a collective program for a few ints;
    docs/internals.md has the figures). A peer that never arrives is a
    `TransferError` naming it, not a hang. Falls back to `process_allgather`
    where the client is not reachable.
    """
    local = np.asarray(flags, np.int32).reshape(-1)
    client = _coordination_client()
    if client is None:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(local)).reshape(-1, len(local))
    bucket, call = divmod(next(_agreements), _AGREE_BUCKET)
    me, count = jax.process_index(), jax.process_count()
    key = f"kvxfer/agree/{bucket}/{call}"
    client.key_value_set_bytes(f"{key}/{me}", local.tobytes())
    rows = []
    for rank in range(count):
        if rank == me:
            rows.append(local)
            continue
        try:
            data = client.blocking_key_value_get_bytes(f"{key}/{rank}",
                                                       int(_AGREE_TIMEOUT_S * 1000))
        except Exception as e:  # the client raises its own XlaRuntimeError
            raise TransferError(f"process {rank} did not agree within {_AGREE_TIMEOUT_S:.0f} s "
                                f"(agreement {key}): {e}") from e
        row = np.frombuffer(data, np.int32)
        if row.shape != local.shape:
            raise TransferError(f"process {rank} agreed on {row.size} flags at {key}, this "
                                f"process on {local.size}: the processes are out of step")
        rows.append(row)
    if me == 0 and call == 0 and bucket >= 2:
        # Every process has read bucket - 2: each finished bucket - 1's last agreement.
        client.key_value_delete(f"kvxfer/agree/{bucket - 2}")
    return np.stack(rows)


def shared_instance(nbytes: int = 8) -> str:
    """A fresh random value (hex) drawn by process 0 and handed to every process of the
    instance: its P instance id, or the key its request secrets are derived from."""
    from jax.experimental import multihost_utils

    drawn = np.frombuffer(secrets.token_bytes(nbytes), np.uint8)
    return bytes(np.asarray(multihost_utils.broadcast_one_to_all(drawn), np.uint8)).hex()
