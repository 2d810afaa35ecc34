"""`ConnectorConfig`: everything a connector reads, in one place (its NIXL agent's included)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass

from kvxfer.errors import InvalidInputError
from kvxfer.nixl.agent import TransportConfig
from kvxfer.plan.blocks import is_int

__all__ = ["ConnectorConfig"]


@dataclass(frozen=True)
class ConnectorConfig:
    """What a connector reads, in one place.

    - `transport`: the NIXL agent's settings (name, ports, deadlines, lease).
    - `staging_blocks`: kernel blocks per layer each group's host staging holds.
    - `kernel_ratio`: kernel blocks per logical (engine) block, for every group.
    - `verify_fingerprints`: D checks every received block against P's fingerprints.
    - `stats`: collect counters, timings and traces (`stats()`, `traces()`); False
      collects none (traces are still logged at DEBUG).
    - `precompile`: at start-up, compile every program a save (P) or load (D) of any
      size runs on the XLA backend (`kvxfer.device.gather.precompile`), so that none compiles
      on the transfer path; nothing compiles on the numpy backend.
    - `host_pool_bytes`: the host pool in this process's staging, in bytes: full blocks
      kept there by block hash for later prompts to load instead of prefilling
      (`kvxfer.plan.pool`): on P the prompt blocks a request leaves once D has read them,
      on D (and any instance) the blocks of a finished request, its generated tokens
      included; at most the staging itself. 0 (the default): no pool.
    - `seal_kv`: encrypt every block staged here where it lies (AES-256-CTR, a key per
      request or pool entry that only its reader derives; `kvxfer.device.seal`), so that
      what NIXL serves to a peer and carries over the link is ciphertext. For links
      between hosts that are not otherwise encrypted; costs a pass over the bytes on each
      side (docs/benchmarks.md). A reader opens sealed blocks whatever its own setting.
    - `stage_units`: deprecated, ignored. Every instance stages each block unit-major, as
      the pieces an instance across hosts stages (`kvxfer.device.pieces`), so any instance
      pairs with any other; True still passes, with a `DeprecationWarning`.
    """

    transport: TransportConfig
    staging_blocks: int = 4096
    kernel_ratio: int = 1
    verify_fingerprints: bool = True
    stats: bool = True
    precompile: bool = True
    stage_units: bool = False
    host_pool_bytes: int = 0
    seal_kv: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.transport, TransportConfig):
            raise InvalidInputError(
                f"ConnectorConfig transport must be a TransportConfig, got {self.transport!r:.80}")
        if not is_int(self.host_pool_bytes) or self.host_pool_bytes < 0:
            raise InvalidInputError(f"ConnectorConfig host_pool_bytes must be a non-negative "
                                    f"int (bytes), got {self.host_pool_bytes!r}")
        for name in ("staging_blocks", "kernel_ratio"):
            value = getattr(self, name)
            if not is_int(value) or value <= 0:
                raise InvalidInputError(f"ConnectorConfig {name} must be a positive int, got {value!r}")
        for name in ("verify_fingerprints", "stats", "precompile", "stage_units", "seal_kv"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidInputError(
                    f"ConnectorConfig {name} must be a bool, got {getattr(self, name)!r}")
        if self.seal_kv and self.staging_blocks > 2 ** 24:  # a nonce names the slot in 24 bits
            raise InvalidInputError(f"ConnectorConfig staging_blocks {self.staging_blocks} is more "
                                    f"than seal_kv's nonces name (2**24 slots)")
        if self.stage_units:
            warnings.warn("ConnectorConfig stage_units is deprecated and ignored: every instance "
                          "now stages units, so any instance pairs with any other",
                          DeprecationWarning, stacklevel=3)
