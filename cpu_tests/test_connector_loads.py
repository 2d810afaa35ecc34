"""D's loads (`kvxfer.connector.loads`): P's params parsed once, P's blocks placed in D's
table, and the D blocks each load under way writes, freed when it ends."""

import os
import sys
import time
from dataclasses import replace

import pytest

from kvxfer.connector.loads import Load, Loads, table_ids
from kvxfer.connector.scheduler import LoadRequest
from kvxfer.device.layout import CacheLayout
from kvxfer.errors import InvalidInputError
from kvxfer.nixl.wire import ReadParams, StreamParams, bound_secret, new_stream_id, prompt_digest
from kvxfer.plan.save_plan import ScheduledRequest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_streaming import _drive, _stream  # noqa: E402

# 16 kernel blocks, 2 a logical block: D's logical ids are 0..7.
LAYOUT = CacheLayout(1, (16, 8, 16), "int8", (("model", 8),), ((), (), ("model",)), kernel_ratio=2)


def _params(keys, slots, prompt=None):
    return ReadParams(peer="P", instance="i", host="127.0.0.1", port=1, req_id="r", generation=1,
                      keys=(tuple(keys),), slots=(tuple(slots),), secret="0" * 32, prompt=prompt)


def test_p_params_parse_as_a_stream_where_they_name_one_else_as_finished_params():
    finished = _params([0, 1], [5, 6])
    assert LoadRequest.parse_params(finished.to_dict(), 1) == finished
    stream = StreamParams("P", "127.0.0.1", 1, new_stream_id())
    assert LoadRequest.parse_params(stream.to_dict(), 1) == stream
    with pytest.raises(InvalidInputError, match="field 'port' must be an int port, got -1"):
        LoadRequest.parse_params(dict(stream.to_dict(), port=-1), 1)
    with pytest.raises(InvalidInputError, match="must be a list of 2 groups"):
        LoadRequest.parse_params(finished.to_dict(), 2)


def test_params_naming_pool_entries_round_trip_and_bad_entries_are_refused_by_name():
    shared = replace(_params([0, 1, 2], [5, 6, 9]), entries=(((0, "a" * 32), (1, "b" * 32)),))
    back = LoadRequest.parse_params(shared.to_dict(), 1)
    assert back == shared
    # entries' tags bound to the reader's block hash at each key, the rest to its prompt
    assert back.tag_secrets(0, "d" * 32, ["x", "y"]) == [
        bound_secret("a" * 32, "x"), bound_secret("b" * 32, "y"), bound_secret("0" * 32, "d" * 32)]
    assert back.tag_secrets(0, None, None)[2] == "0" * 32  # a reader knowing nothing of its prompt
    assert back.tag_secrets(0, None, None)[0] != bound_secret("a" * 32, "x")
    group = shared.to_dict()["groups"][0]
    for bad in ([[3, "a" * 32]], [[0, "a" * 32], [0, "b" * 32]], [[0, "xyz"]], [0, "a" * 32],
                "entries", [[0, "a" * 32]] * 4, [[True, "a" * 32]], [[[0], "a" * 32]],
                [[{"k": 0}, "a" * 32]]):  # keys that cannot be hashed: named, never a TypeError
        with pytest.raises(InvalidInputError, match="group 0 'entries' must be distinct"):
            LoadRequest.parse_params(dict(shared.to_dict(), groups=[{**group, "entries": bad}]), 1)


def test_params_that_leave_out_a_block_d_counts_as_loaded_are_refused_by_name():
    """D told its engine it loads table entries 1-2 (`need`): params naming no block for
    entry 2, or only one of its two kernel blocks, fail before anything is read."""
    request = LoadRequest(None, [3, 5, 7], have=[1], need=[(1, 3)])
    Load.read([LAYOUT], "r", request, _params(range(6), range(10, 16)))  # all there
    for keys in ([0, 1, 2, 3], [2, 3, 4], [0, 1, 4, 5]):
        with pytest.raises(InvalidInputError, match=r"name no block for table entries \[(2|1)\]"):
            Load.read([LAYOUT], "r", request, _params(keys, range(10, 10 + len(keys))))
    for bad in ([(3, 1)], [(0, 2), (0, 2)], "all", [(0, -1)]):
        with pytest.raises(InvalidInputError, match="'need' must be 1"):
            Load.read([LAYOUT], "r", replace(request, need=bad), _params(range(6), range(10, 16)))


def test_a_read_places_each_block_at_its_position_of_d_table_past_what_d_holds():
    request = LoadRequest(None, [3, 5, 7], have=[1])
    p, load = Load.read([LAYOUT], "r", request, _params(range(6), range(10, 16)))
    assert (p.keys, p.slots) == (((2, 3, 4, 5),), ((12, 13, 14, 15),))  # entry 0 is D's
    assert load.keys == [[2, 3, 4, 5]] and load.kernel_ids == [[10, 11, 14, 15]]
    assert load.logical_ids == [5, 7] and load.reserved == load.kernel_ids


@pytest.mark.parametrize("request_, match", [
    (LoadRequest(None, [3]), "P sends a block D cannot place: table entry 1 is past"),
    (LoadRequest(None, [3, 0]), "holds the null block"),
    (LoadRequest(None, [3, 9]), r"D block ids \[9\] are past D's 8 blocks"),
    (LoadRequest(None, [3, 3]), "D's table repeats a block id"),
    (LoadRequest(None, [3, -4]), r"block table must be 1 list\(s\) .* got \[3, -4\]"),
    (LoadRequest(None, [3, 4], have=[-1]), r"'have' must be 1 non-negative int\(s\), got \[-1\]"),
    (LoadRequest(None, [3, 4], prompt=prompt_digest([1])), "a prompt P was not given"),
])
def test_a_read_d_cannot_place_is_refused_naming_why(request_, match):
    with pytest.raises(InvalidInputError, match=match):
        Load.read([LAYOUT], "r", request_, _params(range(4), range(4)))


def test_a_stream_reserves_d_table_past_what_d_holds_and_places_blocks_as_they_arrive():
    load, skip = Load.stream([LAYOUT], "r", LoadRequest(None, [3, 5, 0, 7], have=[1]))
    assert skip == [2] and load.reserved == [[10, 11, 14, 15]] and load.logical_ids == [5, 7]
    assert load.keys == [[]] and load.kernel_ids == [[]]
    part = load.arrived([LAYOUT], "r", [[2, 3]])
    assert part.keys == [[2, 3]] and part.kernel_ids == [[10, 11]]
    assert load.keys == [[2, 3]] and load.kernel_ids == [[10, 11]]
    with pytest.raises(InvalidInputError, match="table entry 2 holds the null block"):
        load.arrived([LAYOUT], "r", [[4]])


def test_loads_refuse_a_d_block_another_load_writes_until_it_ends():
    loads = Loads(1)
    stream, _ = Load.stream([LAYOUT], "a", LoadRequest(None, [3, 5]))
    loads.check("a", stream)
    loads.add("a", stream)
    _, read = Load.read([LAYOUT], "b", LoadRequest(None, [5]), _params([0], [0]))
    with pytest.raises(InvalidInputError, match="kernel block 10 is being loaded for request 'a'"):
        loads.check("b", read)
    assert list(loads) == ["a"] and loads.pop("a") is stream and loads.pop("a") is None
    loads.check("b", read)  # the stream's blocks that never arrived are free again


def test_a_failure_reports_every_block_id_of_a_malformed_table():
    assert table_ids([[3, "x", -1, 4], (5, [3, 6.0])]) == [3, 4, 5]


def test_d_blocks_a_stream_reserved_but_p_never_sent_are_free_once_it_finished(pair):
    pr = pair()
    stream = new_stream_id()
    pr.p.add_request("r", 32, stream=stream)
    with pytest.raises(InvalidInputError, match="a stream's"):
        pr.d.expect(_stream(pr, stream))
    pr.d.start_load_kv({"r": LoadRequest(_stream(pr, stream), [1, 2, 3, 4])})  # 2 sent
    pr.save(ScheduledRequest("r", 0, 32, ([5, 6],), full_table=True))
    assert _drive(pr, lambda f, x: f or x) == (["r"], [])
    pr.p.add_request("s", 32)
    pr.save(ScheduledRequest("s", 0, 32, ([7, 8],), full_table=True))
    params = pr.p.request_finished("s")
    deadline = time.monotonic() + 5
    while "r" not in pr.freed and time.monotonic() < deadline:  # P's ack of r's done
        pr.freed += pr.p.get_finished()
    pr.serve()
    assert pr.load_all({"s": (params, [3, 4])}, 1) == (["s"], [])
