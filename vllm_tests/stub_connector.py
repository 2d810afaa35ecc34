"""A do-nothing HMA connector that records calls: checks the harness's connector plumbing."""

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    SupportsHMA,
)

CALLS: list[tuple[str, str, Any]] = []  # (role, method, detail)


class StubConnector(KVConnectorBase_V1, SupportsHMA):
    def _log(self, name, detail=None):
        CALLS.append((self.role.name, name, detail))

    # scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        self._log("get_num_new_matched_tokens", request.request_id)
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        self._log("update_state_after_alloc", request.request_id)

    def build_connector_meta(self, scheduler_output):
        self._log("build_connector_meta")
        return KVConnectorMetadata()

    def request_finished_all_groups(self, request, block_ids):
        self._log("request_finished", (request.request_id, request.kv_transfer_params))
        return False, {"from": "stub", "req": request.request_id}

    def request_finished(self, request, block_ids):
        return self.request_finished_all_groups(request, (block_ids,))

    # worker side
    def register_runner(self, runner):
        self.runner = runner
        self._log("register_runner", len(runner.kv_caches))

    def start_load_kv(self, forward_context, **kwargs):
        self._log("start_load_kv")

    def wait_for_layer_load(self, layer_name):
        pass

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        pass

    def wait_for_save(self):
        self._log("wait_for_save")
