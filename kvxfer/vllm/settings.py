"""`Settings`: kvxfer's `kv_connector_extra_config` under vLLM, checked (loads no vLLM).

`kvxfer.vllm` reads it on both roles: where D reaches P (`host`, `port`,
`name`), and every field of `ConnectorConfig` and `TransportConfig` a user may
set, each with its default and its check. Unknown keys are refused by name.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kvxfer.connector.config import ConnectorConfig
from kvxfer.errors import InvalidInputError
from kvxfer.nixl.agent import TransportConfig
from kvxfer.nixl.wire import new_instance
from kvxfer.plan.blocks import is_int

__all__ = ["Settings"]


_ADDRESS = ("host", "port", "name")
"""The keys `Settings` reads itself; every other key is a field of `ConnectorConfig` (but
`transport`) or of `TransportConfig` (but `name`, `host`, `listen_port`), with its default
and its check."""

_THRESHOLD = "kv_recompute_threshold"
"""D's recompute threshold (tokens), which `Settings` reads itself too."""


def _option_keys() -> tuple[list[str], list[str]]:
    """The fields of `ConnectorConfig` and of `TransportConfig` a user may set."""
    connector = [f.name for f in fields(ConnectorConfig) if f.name != "transport"]
    transport = [f.name for f in fields(TransportConfig)
                 if f.init and f.name not in ("name", "host", "listen_port")]
    return connector, transport


@dataclass(frozen=True)
class Settings:
    """`kv_connector_extra_config`, checked.

    - `host`, `port`: where D reaches P's worker (P's NIXL listener). P's
      scheduler names them in params before its worker listens, so P's port
      is fixed (default 5610); D listens on any free port.
    - `name`: the NIXL agent name; default `kvxfer-P-{host}-{port}` on P (D
      tells P instances apart by it) and `kvxfer-D-{random}` on D. With
      `etcd_endpoints` no listener port tells P instances apart, so P's
      default is `kvxfer-P-{host}-{engine_id}`: vLLM's `kv_transfer_config.
      engine_id`, one per engine and the same in its scheduler and worker
      processes, which both name P (a random one would differ between them).
    - `options`: every other key, each a field of `kvxfer.connector.config.
      ConnectorConfig` (`staging_blocks`, `kernel_ratio`, `verify_fingerprints`,
      `precompile`, `host_pool_bytes`, `seal_kv`; `stage_units` is deprecated and ignored)
      or of `kvxfer.nixl.agent.TransportConfig` (`handshake_timeout_s`,
      `transfer_timeout_s`, `lease_s`, `heartbeat_interval_s`, `stream_wait_s`, `ucx_tls`,
      `num_threads`, `progress_wake_us`, `etcd_endpoints`), documented there.
      With `etcd_endpoints` (the same on P and D) agents find each other in
      etcd by name, so `port` is unused and D needs no route to a P listener.
    - `kv_recompute_threshold`: D's; a request with fewer prompt tokens to load than
      this (its prompt less D's own prefix hit) is not loaded: D computes it, as vLLM's
      NIXL connector does under the same key. 0 (the default) loads every prompt; see
      docs/vllm-and-serving.md for why.
    """

    host: str = "127.0.0.1"
    port: int = 5610
    name: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict, hash=False)
    engine_id: str | None = None
    kv_recompute_threshold: int = 0

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None,
                   engine_id: str | None = None) -> Settings:
        """`extra` is `kv_connector_extra_config`; `engine_id` vLLM's `kv_transfer_config.engine_id`."""
        extra = dict(extra or {})
        connector, transport = _option_keys()
        known = {*_ADDRESS, _THRESHOLD, *connector, *transport}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise InvalidInputError(f"kv_connector_extra_config has unknown keys {unknown}; "
                                    f"kvxfer reads {sorted(known)}")
        settings = cls(**{k: extra.pop(k) for k in (*_ADDRESS, _THRESHOLD) if k in extra},
                       options=extra, engine_id=engine_id)
        if settings.name is not None and not (isinstance(settings.name, str) and settings.name):
            raise InvalidInputError(f"kv_connector_extra_config 'name' must be a non-empty str "
                                    f"(or absent, for the default), got {settings.name!r}")
        if not is_int(settings.port) or not 0 < settings.port <= 65535:
            raise InvalidInputError(
                f"kv_connector_extra_config 'port' must be an int in [1, 65535], got "
                f"{settings.port!r}")
        if not is_int(settings.kv_recompute_threshold) or settings.kv_recompute_threshold < 0:
            raise InvalidInputError(
                f"kv_connector_extra_config {_THRESHOLD!r} must be an int >= 0 (tokens; 0 "
                f"loads every prompt), got {settings.kv_recompute_threshold!r}")
        settings.connector_config(True)  # every value checked now, on both roles
        try:  # D connects to it: a name nobody resolves would fail every transfer, later
            socket.getaddrinfo(settings.host, None)
        except OSError as e:
            raise InvalidInputError(f"kv_connector_extra_config 'host' {settings.host!r} does not "
                                    f"resolve here ({e.strerror or e}); give P's address") from None
        return settings

    def connector_config(self, producer: bool) -> ConnectorConfig:
        """The worker's `ConnectorConfig` (raises naming a bad value)."""
        connector, _ = _option_keys()
        return ConnectorConfig(self.transport(producer),
                               **{k: v for k, v in self.options.items() if k in connector})

    @property
    def p_name(self) -> str:
        """P's NIXL agent name: what its scheduler side names in params."""
        if self.name:
            return self.name
        if not self.options.get("etcd_endpoints"):
            return f"kvxfer-P-{self.host}-{self.port}"  # unique: the host's listener holds the port
        if not (isinstance(self.engine_id, str) and self.engine_id):
            raise InvalidInputError(
                f"with etcd_endpoints P's default agent name is made of kv_transfer_config."
                f"engine_id, which is {self.engine_id!r}: give an engine_id, or a 'name' unique "
                f"among the P instances of this etcd")
        return f"kvxfer-P-{self.host}-{self.engine_id}"

    def transport(self, producer: bool) -> TransportConfig:
        """This role's `TransportConfig`: P listens on `port` (unless with etcd), D anywhere."""
        if producer:
            name, port = self.p_name, self.p_port
        else:
            name = self.name or f"kvxfer-D-{new_instance()}"
            port = 0
        _, transport = _option_keys()
        return TransportConfig(name=name, host=self.host, listen_port=port,
                               **{k: v for k, v in self.options.items() if k in transport})

    @property
    def p_port(self) -> int:
        """P's listener port as params name it: 0 with etcd (D finds P there by name)."""
        return 0 if self.options.get("etcd_endpoints") else self.port
