"""P and D put together, in the engine's terms (vLLM's `KVConnectorBase_V1`), split by role.

- `scheduler`: `PrefillScheduler` (P's save plans, slots, params), `SaveMeta`,
  `LoadRequest`, `PeerAddress`; plain Python, for an engine's scheduler process.
- `prefill`: `PrefillWorker` (gathers into staging, holds it for D) and
  `PrefillConnector` (both P sides in one process).
- `decode`: `DecodeConnector` (reads, verifies, scatters); `loads`: `Load`, `Loads`
  (P's blocks placed in D's table, and the loads under way).
- `config`: `ConnectorConfig`; `_processes`: one process per instance, or several.

Nothing is imported here, so that importing `kvxfer.connector.scheduler` loads
no JAX; `kvxfer` re-exports the names a serving backend needs.
"""
