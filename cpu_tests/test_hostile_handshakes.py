"""Handshakes under attack: params may name any number of made-up P agents; what D keeps of
their failures is bounded and swept, and only a P agent D completed a handshake with names
a fallback's `p_engine` label (issue: safe at every edge; issue 50, 8)."""

from kvxfer.errors import TransferError
from kvxfer.nixl.agent import TransportConfig
from kvxfer.nixl.handshake import MAX_FAILED, Handshakes
from kvxfer.vllm.fallbacks import MAX_ENGINES, MAX_VERIFIED, Fallbacks, counter_name


class _NoPeers:
    """What `Handshakes` needs of `Peers` when no P ever answers."""

    agent = None
    config = TransportConfig("d-hostile", handshake_timeout_s=2.0)

    def drain(self):
        pass

    def forget(self, peer):
        pass

    def __contains__(self, peer):
        return False


def test_failed_handshakes_with_3000_made_up_p_names_are_bounded_and_swept():
    handshakes = Handshakes(_NoPeers())
    for i in range(3000):
        handshakes._give_up(f"made-up-{i}", TransferError("no such P"), now=100.0)
    assert len(handshakes._failed) == MAX_FAILED
    # The newest are kept: a request naming one still fails at once, as before.
    assert isinstance(handshakes.status("made-up-2999"), TransferError)
    assert handshakes.status("made-up-0") is None  # forgotten: a new handshake may begin
    handshakes.advance(now=101.0)  # not expired yet
    assert len(handshakes._failed) == MAX_FAILED
    handshakes.advance(now=102.5)  # handshake_timeout_s after the failures: all gone
    assert handshakes._failed == {}


def _labels(fallbacks, reason):
    prefix = counter_name(reason, "")
    return {k[len(prefix):]: n for k, n in fallbacks.counters.items() if k.startswith(prefix)}


def test_fallbacks_of_100_made_up_p_names_are_unverified_and_a_handshaken_p_keeps_its_name():
    """Params come from clients: before, the first 64 names any client sent took every
    label for the process's life, and a real P's fallbacks counted as `other`."""
    fallbacks = Fallbacks()
    for i in range(100):
        fallbacks.count("other_prompt", f"made-up-{i}", f"r{i}", "params for another prompt")
    fallbacks.verified(["real-p", "big-p-0", "big-p-1"])  # a worker's handshakes completed
    for engine in ("real-p", "big-p", "made-up-0"):
        fallbacks.loading(f"{engine}-req", {"peer": engine})
    fallbacks.loaded([f"{e}-req" for e in ("real-p", "big-p", "made-up-0")],
                     failed=[f"{e}-req" for e in ("real-p", "big-p", "made-up-0")])
    assert _labels(fallbacks, "other_prompt") == {"unverified": 100}
    # A P across hosts: its params name `big-p`, D handshakes with `big-p-0`, `big-p-1`, ...
    assert _labels(fallbacks, "load_failed") == {"real-p": 1, "big-p": 1, "unverified": 1}
    fallbacks.count("below_threshold", "real-p", "t", "3 tokens")  # verified once: kept
    fallbacks.count("below_threshold", "big-p-1", "u", "3 tokens")  # an agent: verified too
    assert _labels(fallbacks, "below_threshold") == {"real-p": 1, "big-p-1": 1}


def test_verified_p_names_beyond_the_cap_count_as_other_and_what_is_kept_is_bounded():
    fallbacks = Fallbacks()
    fallbacks.verified(f"p{i}" for i in range(100))
    for i in range(100):
        fallbacks.count("load_failed", f"p{i}", f"r{i}", "its KV load failed")
    got = _labels(fallbacks, "load_failed")
    assert got["other"] == 100 - MAX_ENGINES and len(got) == MAX_ENGINES + 1
    fallbacks.verified(f"q{i}" for i in range(10 * MAX_VERIFIED))
    assert len(fallbacks._verified) == MAX_VERIFIED
    fallbacks.verified(["", 7, None])  # not names: ignored
    fallbacks.count("load_failed", "none", "n", "x")  # the fixed labels stay as they are
    assert _labels(fallbacks, "load_failed")["none"] == 1


class _Agent:
    """What `Hellos` needs of P's NIXL agent: whose metadata it drops, and what it sends."""

    def __init__(self):
        self.removed, self.sent = [], []

    def remove_remote_agent(self, name):
        self.removed.append(name)

    def check_remote_metadata(self, name):
        return True

    def send_notif(self, peer, message):
        self.sent.append(peer)


def test_a_hellos_start_that_is_no_str_huge_or_alternating_costs_p_a_bounded_drop_each():
    from kvxfer.nixl.complaints import Complaints
    from kvxfer.nixl.handshake import MAX_STARTS, MAX_WAITING, Hellos

    agent = _Agent()
    hellos = Hellos(agent, TransportConfig("p-hostile"), None, lambda: {},
                    Complaints("P p-hostile", __import__("logging").getLogger(__name__)))
    hellos.heard("d", "first", 0.0)
    for start in (None, 7, ["first"], {"a": 1}, "", True, 1e308):  # not a start: as before
        hellos.heard("d", start, 0.0)
    assert agent.removed == []
    huge = "s" * 10_000_000
    hellos.heard("d", huge, 0.0)
    hellos.heard("d", huge, 0.0)  # the same start again: kept cut, not dropped again
    assert agent.removed == ["d"] and len(hellos._starts["d"]) == 64
    for i in range(10):  # two "starts" taking turns under one name: one drop per turn
        hellos.heard("d", f"turn-{i % 2}", 0.0)
    assert agent.removed == ["d"] * 11
    for i in range(2 * MAX_STARTS):
        hellos.heard(f"made-up-{i}", huge, 0.0)
    assert len(hellos._starts) == MAX_STARTS and "d" not in hellos._starts
    assert len(hellos._waiting) == MAX_WAITING  # a flood of hellos: the newest wait
    hellos.answer(0.0)
    assert len(hellos._waiting) == 0 and len(agent.sent) == MAX_WAITING
    assert hellos.complaints.counts()[("(other peers)", "hello_dropped")] > 0


def test_a_hello_under_a_live_ds_name_from_a_made_up_start_costs_d_one_read_then_d_reconnects():
    """NIXL names are not authenticated: any agent may call itself D and say hello naming
    another start. P then drops D's metadata (as for a D restarted under its name) and its
    acks miss D. D's read in flight fails by its deadline, never hangs; D then connects
    afresh (its hello names its own start) and reads again without P or D restarting."""
    import time

    import numpy as np
    import pytest

    pytest.importorskip("nixl_cu12._api", reason="NIXL (nixl-cu12) is not installed")
    from kvxfer.device.layout import check_block_compatible
    from kvxfer.device.staging import Staging
    from kvxfer.nixl.agent import _create_agent
    from kvxfer.nixl.decode import DecodeTransport
    from kvxfer.nixl.prefill import PrefillTransport
    from kvxfer.nixl.wire import ReadParams, encode_message

    group = {"block_shape": [4, 8], "dtype": "float32", "num_layers": 1, "kernel_ratio": 1}
    layout, timeout = {"groups": [group]}, 1.0

    def config(name):
        return TransportConfig(name, handshake_timeout_s=2.0, transfer_timeout_s=timeout,
                               heartbeat_interval_s=0.1)

    p = PrefillTransport(config("P-forged-hello"), Staging(1, 8, (4, 8), "float32"), layout)
    d = DecodeTransport(config("D-forged-hello"), Staging(1, 8, (4, 8), "float32"), layout,
                        check_block_compatible)
    impostor = None

    def read(req_id, seed):
        p.staging.stage(req_id, [seed], [np.full((1, 4, 8), seed, np.float32)])
        d.start_read(req_id, ReadParams.parse(p.hold(req_id), 1), [seed])
        end = time.monotonic() + 4 * timeout + 2.0  # a handshake afresh, then the read
        while time.monotonic() < end:
            p.poll()
            finished, failed = d.poll()
            if finished or failed:
                ok = bool(finished) and (d.staging.rows(0, d.staging.slots(req_id, [seed]))
                                         == seed).all()
                d.free(req_id)
                return "finished" if ok else "failed"
            time.sleep(0.002)
        return "pending"

    try:
        assert read("before", 1) == "finished"
        impostor, _ = _create_agent(config("D-forged-hello"))  # past the name's claim
        impostor.fetch_remote_metadata("P-forged-hello", "127.0.0.1", p.port)
        end = time.monotonic() + 5
        while not impostor.check_remote_metadata("P-forged-hello") and time.monotonic() < end:
            p.poll()
            time.sleep(0.005)
        impostor.send_notif("P-forged-hello",
                            encode_message("hello", agent="D-forged-hello", start="made-up"))
        end = time.monotonic() + 5
        while p.agent.check_remote_metadata("D-forged-hello") and time.monotonic() < end:
            p.poll()
            time.sleep(0.005)
        assert not p.agent.check_remote_metadata("D-forged-hello")  # P dropped the real D's
        outcomes = [read(f"after-{i}", 2 + i) for i in range(3)]
        assert "pending" not in outcomes  # every read ended by its deadline
        assert outcomes[0] == "failed" and outcomes[1:] == ["finished", "finished"], outcomes
    finally:
        d.close()
        p.close()
        del impostor


def test_a_unit_axis_of_another_json_type_or_none_is_refused_and_a_huge_layout_cut():
    """`True == 1` and `1.0 == 1` in Python: a peer saying unit_axis `true` was paired with a D
    cutting axis 1. A peer's layout of a million ints made a 7 MB error, kept and logged."""
    import pytest

    from kvxfer.device.layout import check_block_compatible
    from kvxfer.errors import LayoutMismatchError

    group = {"block_shape": [4, 8], "dtype": "float32", "num_layers": 1, "kernel_ratio": 1,
             "unit_axis": 1}
    local = {"groups": [group], "model": {}}
    check_block_compatible(local, {"groups": [dict(group, block_shape=(4, 8))], "model": {}})
    omitted = {k: v for k, v in group.items() if k != "unit_axis"}
    for theirs in ({**group, "unit_axis": True}, {**group, "unit_axis": 1.0},
                   {**group, "unit_axis": "1"}, {**group, "unit_axis": -1}, omitted,
                   {**group, "num_layers": True}, {**group, "block_shape": [4.0, 8]}):
        with pytest.raises(LayoutMismatchError, match="peer cache layout differs: group 0"):
            check_block_compatible(local, {"groups": [theirs], "model": {}})
    for huge in ({"groups": [{**group, "block_shape": list(range(10**6))}]},
                 {"groups": [{**group, "unit_axis": "y" * 10**7}]}, {"groups": "x" * 10**7}):
        with pytest.raises(LayoutMismatchError) as e:
            check_block_compatible(local, {**huge, "model": {}})
        assert len(str(e.value)) < 1000
