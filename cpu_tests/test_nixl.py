"""NIXL transport between two real processes on loopback, each with its own agent.

P and D run in `procs/peer.py` children driven over pipes; every call has a
hard timeout and children are killed at teardown, so nothing here can hang.
"""

import base64
import os
import socket
import sys
import time

import numpy as np
import pytest

from kvxfer.device.staging import Staging
from kvxfer.errors import InvalidInputError, TransferError
from kvxfer.nixl.agent import TransportConfig, claim_name, free_port, release_name, start_agent
from kvxfer.nixl.wire import StreamParams, decode_message, done_token, encode_message, new_stream_id

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from procs.harness import Peer, PeerError  # noqa: E402
from procs.peer import block_rows  # noqa: E402

pytest.importorskip("nixl_cu12._api", reason="NIXL (nixl-cu12) is not installed")

LAYERS, SLOTS, SHAPE, DTYPE = 3, 64, (4, 2, 8), "float32"
GROUP = {"block_shape": list(SHAPE), "dtype": DTYPE, "num_layers": LAYERS, "kernel_ratio": 2}
LAYOUT = {"groups": [GROUP]}  # `kvxfer.device.layout.advertised`'s form
TIMEOUT = 3.0  # D's transfer deadline


def spec(name, layout=LAYOUT, **config):
    return {"layers": LAYERS, "slots": SLOTS, "block_shape": list(SHAPE), "dtype": DTYPE,
            "layout": layout,
            "config": {"name": name, "handshake_timeout_s": TIMEOUT,
                       "transfer_timeout_s": TIMEOUT, "heartbeat_interval_s": 0.1, **config}}


@pytest.fixture(scope="module")
def peers():
    """All children start at once (start-up overlaps), are shared, and are always killed."""
    started = {
        "P": Peer("P", spec("P")),
        "D": Peer("D", spec("D")),
        "P_dead": Peer("P", spec("P_dead")),
        "P_lease": Peer("P", spec("P_lease", lease_s=1.0)),
        "P_ratio": Peer("P", spec("P_ratio", layout={"groups": [{**GROUP, "kernel_ratio": 4}]})),
        "P_dtype": Peer("P", spec("P_dtype", layout={"groups": [{**GROUP, "dtype": "bfloat16"}]})),
        "P_corrupt": Peer("P", {**spec("P_corrupt"), "corrupt_layout": True}),
        "P_busy": Peer("P", spec("P_busy")),
        "P_busy_answering": Peer("P", {**spec("P_busy_answering"), "answer_in_background": True}),
    }
    try:
        for peer in started.values():
            peer.port  # noqa: B018 - wait until each is listening
        yield started
    finally:
        for peer in started.values():
            peer.kill()


def connect(d, p, name):
    return d.call("connect", peer=name, host="127.0.0.1", port=p.port)


def read(d, req_id, params, logical_ids, within=TIMEOUT + 2):
    """D reads a request; `logical_ids` are what it reports if the read fails."""
    d.call("read", req_id=req_id, params=params, logical_ids=logical_ids)
    return d.call("wait", req_id=req_id, within=within, timeout=within + 10)


def keys(params):
    return params["groups"][0]["keys"]


def d_rows(d, req_id, keys):
    rows = d.call("rows", req_id=req_id, keys=keys)["rows"]
    return [np.frombuffer(base64.b64decode(r), DTYPE).reshape(len(keys), *SHAPE)
            for r in rows]


def expected(seed_of, kernel_ids):
    """Blocks P staged: `seed_of[k]` is the seed of the newest copy of block k."""
    return [np.stack([block_rows(seed_of[k], [k], layer, SHAPE, DTYPE)[0] for k in kernel_ids])
            for layer in range(LAYERS)]


def assert_same_bytes(got, want):
    for layer, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.tobytes() == w.tobytes(), f"layer {layer} differs"


def stage_and_hold(p, req_id, kernel_ids, seed):
    """P stages `kernel_ids` (content from `seed`) as one chunk and holds them for D."""
    p.call("stage", req_id=req_id, kernel_ids=kernel_ids, seed=seed)
    return p.call("hold", req_id=req_id)["params"]


def assert_read_intact(d, req_id, params, logical_ids, seed_of):
    """D reads the request and holds exactly the newest bytes P staged, under P's keys."""
    assert read(d, req_id, params, logical_ids).get("finished")
    assert_same_bytes(d_rows(d, req_id, keys(params)), expected(seed_of, keys(params)))
    d.call("free", req_id=req_id)


def test_d_reads_exactly_the_bytes_p_staged(peers):
    p, d = peers["P"], peers["D"]
    rng = np.random.default_rng(0)
    p_ids = [int(x) for x in rng.choice(1000, 12, replace=False)]
    d_ids = [int(x) for x in rng.choice(1000, 12, replace=False)]
    params = stage_and_hold(p, "exact", p_ids, seed=11)
    assert connect(d, p, "P")["layout"] == LAYOUT
    assert_read_intact(d, "exact", params, d_ids, dict.fromkeys(p_ids, 11))
    out = p.call("freed")
    assert "exact" in out["freed"] and "exact" not in out["held"]


def test_a_busy_p_acks_ds_done_from_its_answering_thread_not_at_its_next_poll(peers):
    """An engine thread inside a long forward pass polls nothing: D's read waits for P's
    ack until the step ends. P's answering thread acks at once; the slots are still freed
    only by the engine's poll."""
    d = peers["D"]
    for name, answering in (("P_busy", False), ("P_busy_answering", True)):
        p, req = peers[name], f"busy-{answering}"
        connect(d, p, name)
        params = stage_and_hold(p, req, [5, 6, 7], seed=3)
        p.call("busy", on=True)
        free_slots = p.call("held")["free_slots"]
        out = read(d, req, params, [50, 60, 70], within=1.0)
        assert out.get("finished", False) is answering, (name, out)
        assert p.call("held")["free_slots"] == free_slots  # freed only by the engine's poll
        p.call("busy", on=False)
        assert d.call("wait", req_id=req, within=TIMEOUT, timeout=TIMEOUT + 10).get("finished")
        assert _until_freed(p, req)
        assert p.call("held")["free_slots"] == free_slots + 3
        assert_same_bytes(d_rows(d, req, [5, 6, 7]), expected(dict.fromkeys([5, 6, 7], 3), [5, 6, 7]))
        d.call("free", req_id=req)


def _until_freed(p, req, within=TIMEOUT):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if req in p.call("freed")["freed"]:
            return True
        time.sleep(0.05)
    return False


def test_restaged_block_is_read_in_its_newest_copy(peers):
    p, d = peers["P"], peers["D"]
    p.call("stage", req_id="chunks", kernel_ids=[40, 41], seed=1, reserve=3)
    p.call("stage", req_id="chunks", kernel_ids=[41, 42], seed=2)  # 41 straddled the boundary
    params = p.call("hold", req_id="chunks")["params"]
    slots = params["groups"][0]["slots"]
    assert keys(params) == [40, 41, 42] and slots == list(range(slots[0], slots[0] + 3))
    assert_read_intact(d, "chunks", params, [7, 8, 9], {40: 1, 41: 2, 42: 2})


def test_dead_p_fails_request_in_logical_ids_and_d_serves_others(peers):
    p_dead, p, d = peers["P_dead"], peers["P"], peers["D"]
    params = stage_and_hold(p_dead, "doomed", [1, 2, 3, 4], seed=5)
    connect(d, p_dead, "P_dead")
    d.call("read", req_id="doomed", params=params, logical_ids=[5, 10])
    p_dead.kill()
    start = time.monotonic()
    out = d.call("wait", req_id="doomed", within=TIMEOUT + 2, timeout=TIMEOUT + 15)
    assert out.get("failed") == [5, 10]
    assert time.monotonic() - start < TIMEOUT + 2
    params = stage_and_hold(p, "after", [3, 4], seed=6)
    assert_read_intact(d, "after", params, [30, 31], {3: 6, 4: 6})


def test_expired_lease_frees_blocks_and_late_read_fails_not_garbage(peers):
    p, d = peers["P_lease"], peers["D"]
    connect(d, p, "P_lease")
    params = stage_and_hold(p, "late", [5, 6], seed=7)
    p.call("sleep", s=1.3)
    out = p.call("freed")
    assert "late" in out["freed"] and out["held"] == []
    # The freed slots are reused: reading them now would return another request's bytes.
    reused = p.call("stage", req_id="other", kernel_ids=[8, 9], seed=8)["slots"]
    assert set(reused) == set(params["groups"][0]["slots"])
    assert read(d, "late", params, [20]).get("failed") == [20]


def test_heartbeats_keep_a_lease_alive_until_d_reads(peers):
    p, d = peers["P_lease"], peers["D"]
    connect(d, p, "P_lease")
    params = stage_and_hold(p, "kept", [12, 13], seed=9)
    d.call("expect", params=params)
    d.call("sleep", s=2.0)  # twice the lease; D heartbeats every 0.1 s meanwhile
    assert "kept" in p.call("freed")["held"]
    assert_read_intact(d, "kept", params, [50, 51], {12: 9, 13: 9})


def test_heartbeats_without_the_secrets_token_do_not_keep_a_lease_alive(peers):
    """Request id, instance and generation are not secret: heartbeats naming them with no
    token, or the token of another secret, must not hold P's slots past the lease."""
    p, d = peers["P_lease"], peers["D"]
    connect(d, p, "P_lease")
    params = stage_and_hold(p, "unheld", [16, 17], seed=11)
    forged = [encode_message("hb", instance=params["instance"],
                             reqs=[["unheld", params["generation"]]]),
              encode_message("hb", instance=params["instance"],
                             reqs=[["unheld", params["generation"], done_token("ab" * 16)]])]
    start = time.monotonic()
    while time.monotonic() - start < 1.5:  # past the 1 s lease, a heartbeat every 0.1 s
        for raw in forged:
            d.call("notify", peer="P_lease", raw=base64.b64encode(raw).decode())
        time.sleep(0.1)
    out = p.call("freed")
    assert "unheld" in out["freed"] and out["held"] == []


def test_a_cancelled_expectation_stops_heartbeats_and_frees_p_at_once(peers):
    p, d = peers["P_lease"], peers["D"]
    connect(d, p, "P_lease")
    params = stage_and_hold(p, "dropped", [14, 15], seed=10)
    d.call("expect", params=params)
    d.call("sleep", s=1.5)  # past the 1 s lease: heartbeats keep it
    assert "dropped" in p.call("freed")["held"]
    d.call("cancel", req_id="dropped")
    d.call("sleep", s=0.3)  # well inside the lease the last heartbeat gave
    out = p.call("freed")
    assert "dropped" in out["freed"] and "dropped" not in out["held"]


def test_every_expired_lease_is_reaped_not_only_up_to_a_live_one(peers):
    p, d = peers["P_lease"], peers["D"]
    connect(d, p, "P_lease")
    params = {req: stage_and_hold(p, req, [60 + i], seed=i)
              for i, req in enumerate(["e1", "live", "e2"])}
    d.call("expect", params=params["live"])
    d.call("sleep", s=1.3)
    out = p.call("freed")
    assert {"e1", "e2"} <= set(out["freed"]) and out["held"] == ["live"]


def test_peer_with_other_kernel_ratio_is_rejected_at_handshake(peers):
    with pytest.raises(PeerError, match="group 0 kernel_ratio: peer=4 local=2") as e:
        connect(peers["D"], peers["P_ratio"], "P_ratio")
    assert e.value.kind == "LayoutMismatchError"


def test_peer_with_other_dtype_is_rejected_naming_the_field(peers):
    with pytest.raises(PeerError, match=r"dtype: peer='bfloat16' local='float32'") as e:
        connect(peers["D"], peers["P_dtype"], "P_dtype")
    assert e.value.kind == "LayoutMismatchError"


def test_truncated_layout_message_is_a_clear_error(peers):
    with pytest.raises(PeerError, match="corrupt or truncated") as e:
        connect(peers["D"], peers["P_corrupt"], "P_corrupt")
    assert e.value.kind == "TransferError"


def test_unknown_peer_times_out_with_a_clear_error(peers):
    start = time.monotonic()
    with pytest.raises(PeerError, match=r"'nobody'.*no NIXL metadata within") as e:
        connect(peers["D"], type("NoPeer", (), {"port": free_port()})(), "nobody")
    assert e.value.kind == "TransferError"
    assert time.monotonic() - start < TIMEOUT + 5


@pytest.mark.parametrize(
    "raw, match",
    [
        (b"\x00\x01garbage", "not a kvxfer message"),
        (encode_message("layout", agent="P", layout={})[:-5], "corrupt or truncated"),
        (b"kvxfer:[1, 2]", "no type"),
        (b'kvxfer:{"v": 99, "t": "layout"}', "protocol 99"),
    ],
)
def test_bad_message_bytes_raise_transfer_error(raw, match):
    with pytest.raises(TransferError, match=match):
        decode_message(raw, "P")


def _idle_cpu_s(agent_config, idle_s: float) -> float:
    """CPU seconds this process spends while `idle_s` pass with a fresh agent."""
    import resource

    from kvxfer.nixl.agent import _create_agent

    agent, _ = _create_agent(agent_config)
    try:
        before = resource.getrusage(resource.RUSAGE_SELF)
        time.sleep(idle_s)
        after = resource.getrusage(resource.RUSAGE_SELF)
    finally:
        del agent
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def test_an_idle_agent_does_not_spin_a_core():
    """NIXL's Python API starts its progress thread with a zero poll timeout, which
    spins; kvxfer's agents wait for events (CPU time, not wall time, is asserted)."""
    from kvxfer.nixl.agent import TransportConfig

    idle = 1.0
    spent = _idle_cpu_s(TransportConfig("idle-agent"), idle)
    assert spent < 0.25 * idle, f"an idle agent used {spent:.2f} CPU-s in {idle} s"


def test_agents_created_on_two_threads_at_once_leave_nixl_as_it_was_and_idle():
    import resource
    import threading

    from kvxfer.nixl.agent import TransportConfig, _create_agent, _nixl

    bindings = sys.modules[_nixl()[0].__module__].nixlBind
    original = bindings.nixlAgentConfig
    agents = []

    def make(n):
        agents.append(_create_agent(TransportConfig(f"twin-{n}"))[0])

    threads = [threading.Thread(target=make, args=(n,)) for n in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(agents) == 2 and bindings.nixlAgentConfig is original
    before = resource.getrusage(resource.RUSAGE_SELF)
    time.sleep(1.0)
    after = resource.getrusage(resource.RUSAGE_SELF)
    spent = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert spent < 0.25, f"two idle agents used {spent:.2f} CPU-s in 1 s"


def test_message_round_trips():
    msg = decode_message(encode_message("done", req_id="r", instance="a1", generation=3), "D")
    assert (msg["t"], msg["req_id"], msg["generation"]) == ("done", "r", 3)


def test_nixl_benchmark_reports_its_figures():
    from kvxfer.bench.nixl import run

    out = run(layers=2, blocks=8, block_bytes=4096, iters=1, timeout_s=20, verbose=False)
    assert {"nixl_read_gbps", "memcpy_gbps", "nixl_over_memcpy", "descriptors"} <= set(out)
    assert out["descriptors"] == 2  # one run per layer: each side's slots are contiguous
    assert out["bytes"] == 2 * 8 * 4096 and out["nixl_read_gbps"] > 0


def _restarted(peer, name, port):
    """Kill `peer` and start a new P under the same name, listening on `port`."""
    peer.kill()
    new = Peer("P", spec(name, listen_port=port))
    new.port  # noqa: B018 - wait until it listens
    return new


@pytest.mark.parametrize("same_port", [True, False], ids=["same_port", "new_port"])
def test_restarted_p_refuses_old_params_and_serves_new_ones(peers, same_port):
    """P restarts under its name; D still holds params from before and has a live connection."""
    d, name = peers["D"], f"P_restart_{int(same_port)}"
    port = free_port()
    p = Peer("P", spec(name, listen_port=port))
    try:
        old = stage_and_hold(p, "r", [1, 2], seed=21)
        assert_read_intact(d, "warm", stage_and_hold(p, "warm", [5], seed=20), [9], {5: 20})
        p = _restarted(p, name, port if same_port else free_port())
        new = stage_and_hold(p, "r", [1, 2], seed=22)  # the same id and keys, other bytes
        # Generations start again at 1: only the instance tells the two prefills apart.
        assert new["instance"] != old["instance"] and new["generation"] == old["generation"] == 1
        # Old params first: the connected instance is gone, so D reconnects, and refuses them.
        assert read(d, "r", old, [3, 4]).get("failed") == [3, 4]
        assert_read_intact(d, "r", new, [3, 4], {1: 22, 2: 22})
        # And the other way round: old params while connected to the new instance.
        again = stage_and_hold(p, "r2", [1, 2], seed=23)
        assert read(d, "r2", {**old, "req_id": "r2"}, [5]).get("failed") == [5]
        assert_read_intact(d, "r2", again, [5], {1: 23, 2: 23})
        assert p.call("freed")["held"] == []
    finally:
        p.kill()


def test_the_first_stream_to_a_p_restarted_under_its_name_and_port_is_read(peers):
    """A stream names no P instance: D's first `want` after the restart meets the connection
    to the killed start, and D connects afresh instead of failing the request."""
    d, name, port = peers["D"], "P_restart_stream", free_port()
    p = Peer("P", spec(name, listen_port=port))
    try:
        assert_read_intact(d, "warm", stage_and_hold(p, "warm", [5], seed=20), [9], {5: 20})
        p = _restarted(p, name, port)
        stream = new_stream_id()
        d.call("stream", req_id="s", logical_ids=[1, 2],
               params=StreamParams(name, "127.0.0.1", port, stream).to_dict())
        p.call("publish", req_id="s", stream=stream, kernel_ids=[3, 4], seed=24, last=True)
        assert d.call("wait", req_id="s", within=TIMEOUT + 2, timeout=TIMEOUT + 15).get("finished")
        assert_same_bytes(d_rows(d, "s", [3, 4]), expected({3: 24, 4: 24}, [3, 4]))
        d.call("free", req_id="s")
    finally:
        p.kill()


@pytest.mark.parametrize("how", ["killed", "closed"])
def test_a_d_restarted_under_its_name_connects_to_a_listening_p_that_served_its_last_start(
        peers, how):
    """P keeps NIXL's metadata of the D it served; a D started again under that name (after a
    crash, or a clean close) must connect and read without P restarting."""
    p, name = peers["P"], f"D_again_{how}"
    d = Peer("D", spec(name))
    try:
        assert_read_intact(d, "r", stage_and_hold(p, f"r_{how}_1", [1], seed=31), [2], {1: 31})
        if how == "killed":
            d.kill()
        else:
            d.close()
        d = Peer("D", spec(name))
        assert connect(d, p, "P")["layout"] == LAYOUT
        assert_read_intact(d, "r", stage_and_hold(p, f"r_{how}_2", [1], seed=32), [2], {1: 32})
    finally:
        d.kill()


def test_a_second_agent_under_a_live_agents_name_is_refused_at_start_naming_it(peers):
    p, d = peers["P"], peers["D"]  # D is live, in a process of its own
    with pytest.raises(InvalidInputError, match=rf"name 'D' is already in use by process "
                                                rf"{d.proc.pid} \(on this host"):
        start_agent(TransportConfig("D"), [Staging(1, 4, (8,))])
    assert_read_intact(d, "twin", stage_and_hold(p, "twin", [90], seed=3), [2], {90: 3})


def test_malformed_or_forged_notifications_are_dropped_alone_and_the_batch_goes_on(peers):
    p, d = peers["P"], peers["D"]
    connect(d, p, "P")
    params = stage_and_hold(p, "amid", [70, 71], seed=30)
    garbage = [
        encode_message("hb", instance=params["instance"], reqs="amid"),
        encode_message("hb", instance=params["instance"], reqs=[[1, "a"]]),
        encode_message("hb", instance=7, reqs=[]),
        encode_message("hb", instance=params["instance"], reqs=[["amid", 1, "zz" * 16]]),
        encode_message("done", req_id="amid", instance=params["instance"], generation="1"),
        encode_message("done", req_id=5, instance=params["instance"], generation=1),
        encode_message("done", req_id="amid", generation=params["generation"]),  # no instance
        encode_message("done", req_id="amid", instance=params["instance"], generation=True),
        # Well formed, but not from a holder of the params: without the secret's token.
        encode_message("done", req_id="amid", instance=params["instance"],
                       generation=params["generation"]),
        encode_message("done", req_id="amid", instance=params["instance"],
                       generation=params["generation"], token=done_token("ab" * 16)),
        encode_message("done", req_id="amid", instance=params["instance"],  # not even a str
                       generation=params["generation"], token="\ud800"),  # JSON can say it
        encode_message("done", req_id="amid", instance=params["instance"],
                       generation=params["generation"], token="zz" * 16),
        encode_message("nonsense"),
        b"kvxfer:{\"v\": 2, \"t\": 5}",
        b"\xff\xfe",
    ]
    for raw in garbage:  # D -> P, before the real done
        d.call("notify", peer="P", raw=base64.b64encode(raw).decode())
    for raw in [encode_message("ack", req_id="amid", generation="x", ok=True),
                encode_message("ack", req_id="amid", generation=params["generation"], ok="yes"),
                encode_message("ack", req_id="amid", generation=params["generation"], ok=True),
                encode_message("layout", agent="P")]:  # P -> D: an early ok must not count
        p.call("notify", peer="D", raw=base64.b64encode(raw).decode())
    assert "amid" in p.call("freed")["held"]  # none of it freed the request
    assert_read_intact(d, "amid", params, [1], {70: 30, 71: 30})
    assert "amid" in p.call("freed")["freed"]


def test_p_refuses_to_hold_a_request_twice(peers):
    p = peers["P"]
    stage_and_hold(p, "twice", [80], seed=1)
    with pytest.raises(PeerError, match="'twice' is already held") as e:
        p.call("hold", req_id="twice")
    assert e.value.kind == "InvalidInputError"


def test_a_listen_port_in_use_is_refused_at_start_up_naming_it():
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(InvalidInputError, match=f"cannot listen on listen_port {port}: it is "
                                                    f"in use"):
            start_agent(TransportConfig("P_port_taken", listen_port=port), [Staging(1, 4, (8,))])
    claim_name("P_port_taken")  # free again: nothing of the failed start is left live
    release_name("P_port_taken")
