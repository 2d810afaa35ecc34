"""Leases and expected requests at their edges: what D says `done` for names one request of
one P instance, and reaches P even when said before D is connected (issue: safe at every
edge)."""

import os
import sys
import time

import pytest

from kvxfer.connector.config import ConnectorConfig
from kvxfer.connector.prefill import PrefillConnector
from kvxfer.connector.scheduler import LoadRequest
from kvxfer.nixl.agent import TransportConfig
from kvxfer.plan.save_plan import GroupSpec, ScheduledRequest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
pytest.importorskip("nixl_cu12._api", reason="NIXL (nixl-cu12) is not installed")


def _prefill(p, caches, req_id, table):
    p.add_request(req_id, 32)
    p.wait_for_save(caches, p.build_connector_meta([ScheduledRequest(req_id, 0, 32, (table,),
                                                                     full_table=True)]))
    return p.request_finished(req_id)


def _drive(pr, ps, until, timeout):
    """Poll D and every P until `until()`; whether it came true in time."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in ps:
            p.get_finished()
        pr.get_finished()
        if until():
            return True
        time.sleep(0.002)
    return False


def test_cancelling_one_of_two_p_instances_requests_with_one_id_frees_only_that_one(pair):
    pr = pair(lease=2.0, heartbeat=0.5)
    other = PrefillConnector(ConnectorConfig(TransportConfig("P-other", lease_s=2.0,
                                                             heartbeat_interval_s=0.5),
                                             staging_blocks=32), [GroupSpec(16)], pr.p_caches[0])
    try:
        first = _prefill(pr.p, pr.p_caches[0], "r", [2, 3])
        second = _prefill(other, pr.p_caches[0], "r", [4, 5])  # the same id on another P
        pr.d.expect(first)
        pr.d.expect(second)
        assert _drive(pr, [pr.p, other], lambda: False, 0.5) is False  # both connect
        pr.d.cancel(first)
        assert _drive(pr, [pr.p, other], lambda: "r" not in pr.p.scheduler.held(), 1.5)
        # The other P's request is still held (D's heartbeats keep it past its 2 s lease) ...
        _drive(pr, [pr.p, other], lambda: False, 2.5)
        assert "r" in other.scheduler.held()
        # ... and D reads it whole.
        pr.d.start_load_kv({"r-d": LoadRequest(second, [20, 21])})
        done, deadline = ([], []), time.monotonic() + 10
        while done == ([], []) and time.monotonic() < deadline:
            other.get_finished()
            done = pr.get_finished()
        assert done == (["r-d"], [])
    finally:
        other.close()


def test_a_cancel_said_before_d_is_connected_to_p_still_frees_p_before_its_lease_ends(pair):
    pr = pair(lease=4.0, heartbeat=1.0)
    params = _prefill(pr.p, pr.p_caches[0], "r", [2, 3])
    start = time.monotonic()
    pr.d.expect(params)  # the handshake with P begins in the background ...
    pr.d.cancel(params)  # ... and D drops the request before it completes
    assert _drive(pr, [pr.p], lambda: "r" not in pr.p.scheduler.held(), 2.5)
    assert time.monotonic() - start < 4.0  # freed by D's done, not by the lease lapsing
