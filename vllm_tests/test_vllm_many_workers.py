"""The rules of an instance whose workers are several processes (tpu-inference's Ray executor
runs one per host), through vLLM's own `KVOutputAggregator`, which merges the workers' output
before the scheduler sees it: kvxfer never acts on one worker's report alone."""

from types import SimpleNamespace

import pytest
from engine import listen_port
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

from kvxfer.errors import InvalidInputError
from kvxfer.nixl.wire import Source
from kvxfer.vllm.reports import WorkerReport, worker_processes

HALVES = (Source("p-0", 0, 2), Source("p-1", 2, 4))


def output(**kv) -> ModelRunnerOutput:
    out = ModelRunnerOutput(req_ids=[], req_id_to_index={})
    out.kv_connector_output = KVConnectorOutput(**kv)
    return out


def ray_config(bundles, world_size=4):
    group = SimpleNamespace(bundle_specs=bundles)
    return SimpleNamespace(parallel_config=SimpleNamespace(placement_group=group,
                                                           world_size=world_size))


@pytest.fixture
def tpu_key(monkeypatch):
    from vllm.platforms import current_platform

    monkeypatch.setattr(type(current_platform), "ray_device_key", "TPU", raising=False)
    monkeypatch.delenv("VLLM_RAY_BUNDLE_INDICES", raising=False)


def test_d_reports_a_load_finished_once_every_ray_worker_has_it(engines, model_dir, tpu_key):
    """Two hosts of TP 2 each (world size 4, two workers): vLLM's aggregator counts the
    workers kvxfer names, not the world size, so a load both workers finished is finished,
    and one worker's report alone is not."""
    engine = engines(model_dir, kv_role="kv_consumer", extra_config={"port": listen_port()})
    engine.vllm_config.parallel_config.placement_group = SimpleNamespace(
        bundle_specs=[{"TPU": 2, "node:10.0.0.1": 0.001}, {"TPU": 2}, {"CPU": 1}])
    assert engine.connector.get_finished_count() == 2
    aggregator = KVOutputAggregator.from_connector(engine.connector, world_size=4)
    first = aggregator.aggregate([output(finished_recving={"r"}), output()])
    assert not first.kv_connector_output.finished_recving  # one worker of two
    second = aggregator.aggregate([output(), output(finished_recving={"r"})])
    assert second.kv_connector_output.finished_recving == {"r"}


def test_worker_processes_is_one_per_device_bundle_or_vllms_default(tpu_key, monkeypatch):
    assert worker_processes(ray_config([{"TPU": 4}, {"TPU": 4}])) == 2
    assert worker_processes(ray_config([{"CPU": 2}])) is None  # no device bundle: the default
    assert worker_processes(SimpleNamespace(parallel_config=SimpleNamespace())) is None
    monkeypatch.setenv("VLLM_RAY_BUNDLE_INDICES", "0,1,2,3")  # one worker per rank
    assert worker_processes(ray_config([{"TPU": 4}, {"TPU": 4}])) is None


def test_p_reuses_a_requests_slots_only_once_every_p_worker_has_freed_it(engines, model_dir):
    """A P over two hosts: each worker frees its own piece once D read it. The first
    worker's report must not hand the request's slots to the next request while the other
    worker's piece is still being read (tpu-inference freed staging on the first host's
    report and corrupted data)."""
    engine = engines(model_dir, kv_role="kv_producer",
                     extra_config={"port": listen_port(), "staging_blocks": 8})
    prefill = engine.connector._scheduler.prefill
    # The engine's one worker speaks for a P over two hosts: its reports name both halves.
    engine.worker._worker._prefill.processes.sources = list(HALVES)
    engine.connector.update_connector_output(
        KVConnectorOutput(kv_connector_worker_meta=WorkerReport({}, HALVES, 4)))
    for req_id in ("r", "s"):
        engine.add_request(req_id, list(range(10, 30)),
                           kv_transfer_params={"do_remote_decode": True})
        engine.run_until(lambda r, req_id=req_id: req_id in r.finished)
    assert prefill.held() == ["r", "s"]
    aggregator = KVOutputAggregator(2)
    worker0 = aggregator.aggregate([output(kv_connector_worker_meta=WorkerReport({"r": 1})),
                                    output()])
    engine.connector.update_connector_output(worker0.kv_connector_output)
    assert prefill.held() == ["r", "s"]  # one P process of two has freed r
    assert engine.connector.has_pending_push_work()
    both = aggregator.aggregate([output(kv_connector_worker_meta=WorkerReport({"s": 1})),
                                 output(kv_connector_worker_meta=WorkerReport({"r": 1, "s": 1}))])
    assert both.kv_connector_output.kv_connector_worker_meta.freed == {"r": 1, "s": 2}
    engine.connector.update_connector_output(both.kv_connector_output)
    assert prefill.held() == []
    assert not engine.connector.has_pending_push_work()


@pytest.mark.parametrize("freed", [{"r": -1}, {"r": 0}, {"r": True}, {"r": 1.0}, {"r": "1"},
                                   {7: 1}, ["r"]])
def test_a_worker_report_with_a_count_that_is_no_positive_int_is_refused_naming_it(freed):
    """A negative count would hold a request's slots for ever (no worker frees it twice), a
    str one would fail vLLM's scheduler at the next aggregate, far from the worker."""
    with pytest.raises(InvalidInputError, match="WorkerReport freed"):
        WorkerReport(freed)


@pytest.mark.parametrize("sources,units", [(("p-0",), 4), (HALVES, -1), (HALVES, 2.0),
                                           (list(HALVES), 4)])
def test_a_worker_report_with_odd_sources_or_units_is_refused_naming_them(sources, units):
    with pytest.raises(InvalidInputError, match="WorkerReport"):
        WorkerReport({}, sources, units)


def test_a_p_pools_within_the_smallest_budget_any_of_its_workers_reports(engines, model_dir):
    """Each worker of a P over several hosts turns host_pool_bytes into slots of its own piece;
    the scheduler keeps one index over them all, so its budget is the smallest reported."""
    engine = engines(model_dir, kv_role="kv_producer",
                     extra_config={"port": listen_port(), "staging_blocks": 16,
                                   "host_pool_bytes": 8 * 16384})  # 8 slots of this engine's
    prefill = engine.connector._scheduler.prefill
    aggregator = KVOutputAggregator(2)
    both = aggregator.aggregate([output(kv_connector_worker_meta=WorkerReport({}, pool_slots=9,
                                                                             slot_bytes=(64,))),
                                 output(kv_connector_worker_meta=WorkerReport({}, pool_slots=3,
                                                                             slot_bytes=(32,)))])
    report = both.kv_connector_output.kv_connector_worker_meta
    assert (report.pool_slots, report.slot_bytes) == (3, (32,))
    engine.connector.update_connector_output(both.kv_connector_output)
    assert [p.max_slots for p in prefill.pools.pools] == [3]
    assert engine.connector._scheduler.pool_slot_bytes == (32,)
    engine.add_request("r", list(range(10, 43)), kv_transfer_params={"do_remote_decode": True})
    engine.run_until(lambda r: "r" in r.finished)  # this engine's own worker reports its 8
    assert [p.max_slots for p in prefill.pools.pools] == [8]
    with pytest.raises(InvalidInputError, match="WorkerReport pool_slots must be an int >= 0"):
        WorkerReport({}, pool_slots=-1)
