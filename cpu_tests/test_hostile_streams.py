"""Streams under attack: what a peer may send D in a `chunk` ends in a named failure of one
request, never an exception out of the engine's step (issue: safe at every edge)."""

import os
import sys
import time

import pytest

from kvxfer.connector.scheduler import LoadRequest
from kvxfer.errors import InvalidInputError
from kvxfer.nixl.agent import send
from kvxfer.nixl.streams import Published
from kvxfer.nixl.wire import StreamParams, decode_message, new_stream_id
from kvxfer.plan.save_plan import ScheduledRequest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("field,bad", [
    ("keys", [[2**64]]), ("slots", [[2**64]]), ("keys", [[2**63]]),
    # pool entries' secrets: not hex, for a key the chunk does not name, twice, not per group
    ("entries", [[[1, "z" * 32]]]), ("entries", [[[2, "0" * 32]]]),
    ("entries", [[[1, "0" * 32], [1, "1" * 32]]]), ("entries", "x"), ("entries", [[], []]),
    ("entries", [[[[1], "0" * 32]]])])
def test_a_chunk_naming_a_block_key_or_slot_past_int64_or_bad_entries_fails_its_request_alone(
        pair, field, bad):
    pr = pair()
    a = pr.p.worker.address
    stream, other = new_stream_id(), new_stream_id()
    for req_id, s in (("r", stream), ("q", other)):
        pr.p.add_request(req_id, 64, stream=s)
    pr.d.start_load_kv({
        "r": LoadRequest(StreamParams(a.name, a.host, a.port, stream).to_dict(), [20, 21, 22, 23]),
        "q": LoadRequest(StreamParams(a.name, a.host, a.port, other).to_dict(), [8, 9, 10, 11])})
    pr.save(ScheduledRequest("r", 0, 16, ([5],), full_table=True),
            ScheduledRequest("q", 0, 16, ([6],), full_table=True))
    deadline = time.monotonic() + 10  # until D has P's first chunk of each: the stream is live
    while time.monotonic() < deadline and not all(
            (read := pr.d.transport.reading(r)) is not None and read.p_req_id for r in "rq"):
        pr.p.get_finished()
        pr.get_finished()
        time.sleep(0.001)
    read = pr.d.transport.reading("r")
    chunk = {"stream": stream, "keys": [[1]], "slots": [[0]], "req_id": read.p_req_id,
             "instance": read.instance, "secret": read.secret, "prompt": None,
             "last": False, "generation": None}
    chunk[field] = bad
    send(pr.p.worker.transport.agent, pr.d.transport.config.name, "chunk", **chunk)
    failed, deadline = [], time.monotonic() + 10
    while "r" not in failed and time.monotonic() < deadline:
        pr.p.get_finished()
        failed += pr.get_finished()[1]  # never raises out of D's step
        time.sleep(0.001)
    assert failed == ["r"]
    # The other stream goes on: P completes it and D holds every block.
    pr.save(ScheduledRequest("q", 16, 48, ([7, 12, 13],)))
    finished, deadline = [], time.monotonic() + 10
    while "q" not in finished and time.monotonic() < deadline:
        pr.p.get_finished()
        finished += pr.get_finished()[0]
    assert finished == ["q"]


class _Agent:
    """What `Published` needs of a NIXL agent: who was sent what."""

    def __init__(self):
        self.sent = []

    def send_notif(self, peer, message):
        self.sent.append((peer, decode_message(message, "P")))


def test_one_peer_sending_made_up_subscriptions_cannot_starve_another_and_is_refused_by_name(
        caplog):
    agent = _Agent()
    published = Published(agent, "P", "i", num_groups=1, max_wants=64, wait_s=30.0)
    for _ in range(100):
        published.on_want("hostile", {"t": "want", "stream": new_stream_id()}, 0.0, lambda r: None)
    refused = [m for peer, m in agent.sent if peer == "hostile" and m.get("aborted") is True]
    assert len(refused) == 100 - published.max_wants_per_peer == 84
    assert "refuses subscriptions of hostile" in caplog.text
    stream = new_stream_id()
    published.on_want("real-d", {"t": "want", "stream": stream}, 0.0, lambda r: None)
    # Kept, not refused: P answers that it waits for the request.
    assert [m["t"] for peer, m in agent.sent if peer == "real-d"] == ["wait"]
    published.publish("r", stream, "0" * 32, None, [[]], [[]], False, None)
    assert published._streams[stream].reader == "real-d"
    # Another D naming a stream a D already waits for is refused, not given the stream.
    other = new_stream_id()
    published.on_want("real-d", {"t": "want", "stream": other}, 0.0, lambda r: None)
    published.on_want("thief", {"t": "want", "stream": other}, 0.0, lambda r: None)
    assert [(peer, m["t"]) for peer, m in agent.sent if m["stream"] == other] == [
        ("real-d", "wait"), ("thief", "chunk")]
    assert [m.get("aborted") for peer, m in agent.sent if peer == "thief"][-1] is True


def test_waits_from_another_agent_or_a_past_p_move_no_deadline_and_none_passes_the_cap():
    """Only the stream's P, as the instance D subscribed to, moves a read's deadline by
    `wait`, and never past `stream_wait_s` from subscribing or the last chunk; a chunk, even
    one just before that cap, moves both on."""
    from kvxfer.device.staging import Staging
    from kvxfer.nixl.agent import TransportConfig
    from kvxfer.nixl.reads import Read
    from kvxfer.nixl.streams import StreamReads
    from kvxfer.nixl.wire import new_secret
    from kvxfer.stats import Trace

    config = TransportConfig("d-waits", transfer_timeout_s=1.0, stream_wait_s=5.0)
    stream, failed = new_stream_id(), []
    now = time.monotonic()
    read = Read("r", "", "live", 0, [1], now + 1.0, waiting=False, wait_until=now + 5.0,
                stream=StreamParams("p", "127.0.0.1", 1, stream), trace=Trace("r", "D", ""))
    streams = StreamReads(config, None, [Staging(1, 8, (4,))], None, None, None, {"r": read},
                          lambda r, why=None, reason="": failed.append((why, reason)), None,
                          None)

    def wait(sender, instance):
        streams.on_chunk(sender, {"t": "wait", "stream": stream, "instance": instance})

    for sender, instance in (("another-p", "live"), ("p", "past"), ("p", None), ("p", 7)):
        read.deadline = now + 0.5
        wait(sender, instance)
        assert read.deadline == now + 0.5, (sender, instance)
    wait("p", "live")  # the stream's P: its deadline follows P
    assert read.deadline > now + 0.9
    read.deadline, read.wait_until = now, time.monotonic() + 0.01  # the cap all but reached
    wait("p", "live")
    assert read.deadline <= read.wait_until
    streams.on_chunk("p", {"t": "chunk", "stream": stream, "keys": [[3]], "slots": [[0]],
                           "req_id": "p-r", "instance": "live", "secret": new_secret(),
                           "prompt": None, "last": False, "generation": None})
    assert failed == [] and read.wait_until >= time.monotonic() + 4.0
    assert read.deadline >= time.monotonic() + 0.5

    # A chunk naming nothing (a prefill step that completed no block) shows P alive, not
    # its request progressing: a P sending only those is followed no longer than a `wait`.
    read.deadline, read.wait_until = now, time.monotonic() + 0.01
    for _ in range(3):
        streams.on_chunk("p", {"t": "chunk", "stream": stream, "keys": [[]], "slots": [[]],
                               "req_id": "p-r", "instance": "live", "secret": read.secret,
                               "prompt": None, "last": False, "generation": None})
    assert failed == [] and read.deadline <= read.wait_until < time.monotonic() + 1.0


@pytest.mark.parametrize("entries", ["x", [{9: "0" * 32}], [{1: "0" * 32}, {}], [[1]]])
def test_publish_refuses_entries_that_are_not_the_named_keys_secrets_by_name(entries):
    published = Published(_Agent(), "P", "i", num_groups=1, max_wants=64, wait_s=30.0)
    with pytest.raises(InvalidInputError, match="entries must map keys named in each of 1"):
        published.publish("r", new_stream_id(), "0" * 32, None, [[1]], [[4]], False, None, entries)
    assert published._streams == {}  # nothing held
