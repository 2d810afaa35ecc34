"""P and D put together, in the engine's terms (vLLM's `KVConnectorBase_V1`)."""

from kvxfer.connector._worker import check_block_compatible
from kvxfer.connector.config import ConnectorConfig
from kvxfer.connector.decode import DecodeConnector
from kvxfer.connector.prefill import PrefillConnector, PrefillWorker
from kvxfer.connector.scheduler import PeerAddress, PrefillScheduler, SaveMeta

__all__ = ["ConnectorConfig", "DecodeConnector", "PeerAddress", "PrefillConnector",
           "PrefillScheduler", "PrefillWorker", "SaveMeta", "check_block_compatible"]
