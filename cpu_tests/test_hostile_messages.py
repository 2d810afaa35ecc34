"""Messages under attack: a peer decides how many malformed messages it sends, and how it names
itself; what this side logs of them is one line a minute per peer and reason, with the count,
and what it keeps of them is bounded (issue 50: safe at every edge)."""

import logging

import pytest

from kvxfer.errors import InvalidInputError
from kvxfer.nixl.complaints import MAX_PEERS, OTHERS, Complaints
from kvxfer.stats import Recorder

LOGGER = "kvxfer.test.complaints"


class _Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def _lines(caplog):
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


def test_a_peer_sending_many_bad_messages_in_a_minute_is_one_line_then_one_with_the_count(caplog):
    clock, recorder = _Clock(), Recorder()
    complaints = Complaints("P p", logging.getLogger(LOGGER), recorder, "p_messages_dropped",
                            clock=clock)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(500):
            complaints.note("hostile-d", "malformed", "not a kvxfer message")
            clock.now += 0.1  # 50 s in all: within the interval
        assert len(_lines(caplog)) == 1  # the first, at once
        assert "'hostile-d'" in _lines(caplog)[0] and "malformed: 1 since" in _lines(caplog)[0]
        assert complaints.counts() == {("hostile-d", "malformed"): 500}
        assert recorder.counters["p_messages_dropped"] == 500 == complaints.total
        complaints.note("hostile-d", "unknown_type", "a 'bogus' message")  # another reason
        complaints.note("other-d", "malformed", "truncated")  # another peer
        assert len(_lines(caplog)) == 3
        clock.now = 1000.0 + 60.0  # a minute after the first line
        complaints.note("hostile-d", "malformed", "not a kvxfer message")
    lines = _lines(caplog)
    assert len(lines) == 4 and "malformed: 500 since this peer's last such line" in lines[3]
    assert recorder.counters["p_messages_dropped"] == 503


def test_many_made_up_peer_names_keep_state_bounded_and_their_names_cut_in_lines(caplog):
    clock = _Clock()
    complaints = Complaints("P p", logging.getLogger(LOGGER), clock=clock)
    long_name = "x" * 10_000
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for i in range(3000):
            complaints.note(f"junk-{i}", "malformed", "junk " * 1000)
            complaints.note(f"junk-{i}", "unknown_type", "junk")
        complaints.note(long_name, "malformed", "junk")
    counts = complaints.counts()
    assert len({peer for peer, _ in counts}) == MAX_PEERS + 1  # the first ones, then OTHERS
    assert counts[(OTHERS, "malformed")] == 3000 - MAX_PEERS + 1
    assert complaints.total == 2 * 3000 + 1
    lines = _lines(caplog)
    assert len(lines) == 2 * MAX_PEERS + 2  # each kept peer's first, and OTHERS' per reason
    assert max(len(line) for line in lines) < 600  # names and texts cut
    # A minute later the quiet peers are swept: a new one is told apart again.
    clock.now += 60.0
    complaints.note("real-d", "malformed", "bad")
    assert ("real-d", "malformed") in complaints.counts()
    assert len({peer for peer, _ in complaints.counts()}) <= MAX_PEERS + 1


def test_peers_naming_themselves_with_10_mb_each_are_kept_by_a_cut_name(caplog):
    """256 such names were 2.5 GB of keys, held until swept."""
    from kvxfer.nixl.complaints import KEY_CHARS

    complaints = Complaints("P p", logging.getLogger(LOGGER), clock=_Clock())
    huge = "n" * (10 << 20)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for i in range(MAX_PEERS + 10):
            complaints.note(f"{i:04d}" + huge, "malformed", "junk")
            complaints.note(f"{i:04d}" + huge, "malformed", "junk")
    counts = complaints.counts()
    assert max(len(peer) for peer, _ in counts) == KEY_CHARS
    assert counts[("0000" + huge[:KEY_CHARS - 4], "malformed")] == 2
    assert counts[(OTHERS, "malformed")] == 2 * 10
    assert len(_lines(caplog)) == MAX_PEERS + 1 and max(map(len, _lines(caplog))) < 600


def test_a_peer_over_the_cap_is_logged_under_others_with_its_name_cut(caplog):
    complaints = Complaints("D d", logging.getLogger(LOGGER), max_peers=1, clock=_Clock())
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        complaints.note("first", "malformed", "bad")
        complaints.note("y" * 500, "malformed", "bad")
    assert f"'{'y' * 64}...' (counted as {OTHERS})" in _lines(caplog)[1]


@pytest.mark.parametrize("kw", [{"interval_s": -1}, {"interval_s": "60"}, {"interval_s": True},
                                {"max_peers": 0}, {"max_peers": 2.0}])
def test_complaints_refuse_a_bad_interval_or_cap_naming_it(kw):
    with pytest.raises(InvalidInputError, match=next(iter(kw))):
        Complaints("P p", logging.getLogger(LOGGER), **kw)


def test_p_logs_a_flood_of_bad_messages_from_one_d_once_and_counts_each(caplog):
    pytest.importorskip("nixl_cu12._api", reason="NIXL (nixl-cu12) is not installed")
    from kvxfer.device.staging import Staging
    from kvxfer.nixl.agent import TransportConfig
    from kvxfer.nixl.prefill import PrefillTransport
    from kvxfer.nixl.wire import _MAGIC, PROTOCOL_VERSION

    p = PrefillTransport(TransportConfig("P-hostile-messages"), Staging(1, 4, (2,)), {})
    try:
        clock = _Clock()
        p.complaints.clock = clock
        junk = [b"junk"] * 300 + [_MAGIC + b"{not json"] * 300
        bogus = [_MAGIC + f'{{"t": "bogus", "v": {PROTOCOL_VERSION}}}'.encode()] * 100
        p.agent.get_new_notifs = lambda: {"hostile-d": junk + bogus}
        with caplog.at_level(logging.WARNING, logger="kvxfer.nixl.prefill"):
            p.poll(now=0.0)
            p.poll(now=1.0)
            lines = [r.getMessage() for r in caplog.records if r.name == "kvxfer.nixl.prefill"]
            assert len(lines) == 2, lines  # one per reason: malformed, unknown_type
            clock.now += 60.0
            p.poll(now=2.0)
        lines = [r.getMessage() for r in caplog.records if r.name == "kvxfer.nixl.prefill"]
        assert len(lines) == 4 and "malformed: 1200 since" in lines[2]
        assert "unknown_type: 200 since" in lines[3] and "'bogus'" in lines[3]
        assert p.recorder.stats().counters["p_messages_dropped"] == 3 * 700
        assert p.complaints.counts() == {("hostile-d", "malformed"): 1800,
                                         ("hostile-d", "unknown_type"): 300}
    finally:
        p.agent.get_new_notifs = lambda: {}
        p.close()


def test_d_logs_a_flood_of_bad_messages_from_one_peer_once_and_counts_each(caplog):
    from kvxfer.nixl.agent import TransportConfig
    from kvxfer.nixl.peers import Peers

    class _Agent:
        def get_new_notifs(self):
            return {"hostile-p": [b"junk"] * 200}

    peers = Peers(_Agent(), TransportConfig("d-hostile"), [], {}, lambda a, b: None, None,
                  on_ack=lambda sender, msg: None)
    with caplog.at_level(logging.WARNING, logger="kvxfer.nixl.peers"):
        for _ in range(5):
            peers.drain()
    lines = [r.getMessage() for r in caplog.records if r.name == "kvxfer.nixl.peers"]
    assert len(lines) == 1 and "D d-hostile drops a message from 'hostile-p'" in lines[0]
    assert peers.complaints.counts() == {("hostile-p", "malformed"): 1000}


def test_layouts_nobody_asked_for_from_many_made_up_agents_keep_state_bounded():
    from kvxfer.nixl.agent import TransportConfig
    from kvxfer.nixl.peers import MAX_ADVERTS, Peers
    from kvxfer.nixl.wire import encode_message

    class _Agent:
        def get_new_notifs(self):
            return {f"made-up-{i}": [encode_message("layout", agent="x"), b"junk"]
                    for i in range(3 * MAX_ADVERTS)}

    peers = Peers(_Agent(), TransportConfig("d-adverts"), [], {}, lambda a, b: None, None,
                  on_ack=lambda sender, msg: None)
    peers.drain()
    assert len(peers._adverts) == MAX_ADVERTS
    assert peers.take_advert(f"made-up-{3 * MAX_ADVERTS - 1}") is not None  # the newest kept
