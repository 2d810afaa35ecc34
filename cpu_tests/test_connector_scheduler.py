"""End to end: P and D as two real processes, each with its own mesh and NIXL agent.

P prefills several prompts in chunks (a straddling block, lookahead blocks, a
prefix-cache hit), saving what `SaveTracker` plans; D reads each finished
request into its own block ids, checks fingerprints, scatters, and compares
every prompt token's KV with P's, byte for byte.
"""

import pytest

from kvxfer import KvxferError
from kvxfer.demo.kvbytes import BytesConfig, run_bytes

SMALL = dict(layers=2, heads=8, head_dim=64, num_blocks=128, prompts=[40, 300, 133],
             cached=[0, 64, 0], budget=96, lookahead=3, timeout_s=90)


def assert_all_tokens_equal(result, cfg):
    assert [r["req_id"] for r in result["requests"]] == [f"req{i}" for i in range(len(cfg.prompts))]
    for r, prompt in zip(result["requests"], cfg.prompts):
        assert r["ok"], r
        assert r["stale_tokens"] == 0 and r["tokens"] == prompt
    assert result["p_freed"] == sorted(f"req{i}" for i in range(len(cfg.prompts)))


@pytest.mark.parametrize("tp_p, tp_d, dtype", [(4, 8, "bfloat16"), (4, 2, "float8_e4m3fn"),
                                               (2, 4, "int8")])
def test_every_prompt_token_reaches_d_byte_exact_across_tp(tp_p, tp_d, dtype):
    cfg = BytesConfig(layout="attention", dtype=dtype, tp_p=tp_p, tp_d=tp_d, **SMALL)
    assert_all_tokens_equal(run_bytes(cfg), cfg)


@pytest.mark.parametrize("layout, tp_d", [("mla", 2), ("attention4d", 8)])
def test_mla_and_4d_layouts_reach_d_byte_exact(layout, tp_d):
    cfg = BytesConfig(layout=layout, dtype="bfloat16", tp_p=4, tp_d=tp_d, **SMALL)
    assert_all_tokens_equal(run_bytes(cfg), cfg)


def test_demo_rejects_unknown_layout_before_starting_processes():
    with pytest.raises(KvxferError, match="'paged'"):
        run_bytes(BytesConfig(layout="paged"))


def _prefill_scheduler(**kw):
    from kvxfer.connector.scheduler import PeerAddress, PrefillScheduler
    from kvxfer.plan.save_plan import GroupSpec

    args = dict(staging_blocks=8, kernel_ratio=1, address=PeerAddress("P", "127.0.0.1", 5610))
    args.update(kw)
    return PrefillScheduler([GroupSpec(16)], **args)


@pytest.mark.parametrize("kw, named", [
    (dict(staging_blocks=0), "staging_blocks must be a positive int, got 0"),
    (dict(kernel_ratio="2"), "kernel_ratio must be a positive int, got '2'"),
    (dict(address=("P", "h", 1)), "address must be a PeerAddress"),
])
def test_prefill_scheduler_names_a_bad_argument(kw, named):
    from kvxfer.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match=named):
        _prefill_scheduler(**kw)


@pytest.mark.parametrize("port", [-1, 70000, "5610"])
def test_peer_address_refuses_a_bad_port(port):
    from kvxfer.connector.scheduler import PeerAddress
    from kvxfer.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match=f"port must be an int in \\[0, 65535\\], got {port!r}"):
        PeerAddress("P", "127.0.0.1", port)


def test_peer_address_takes_port_0_for_a_p_found_in_etcd():
    from kvxfer.connector.scheduler import PeerAddress

    assert PeerAddress("P", "127.0.0.1", 0).port == 0


def test_prefill_scheduler_generations_are_fresh_and_slots_come_back_on_release():
    from kvxfer.plan.save_plan import ScheduledRequest

    s = _prefill_scheduler()
    gens = []
    for req_id in ("a", "b"):
        s.add_request(req_id, 32)
        meta = s.build_connector_meta([ScheduledRequest(req_id, 0, 32, ([1, 2],), full_table=True)])
        gens.append(meta.holds[req_id])
        assert s.request_finished(req_id)["generation"] == gens[-1]
    assert gens == sorted(set(gens)) and s.held() == ["a", "b"]
    assert s.slot_maps[0].num_free_slots == 4
    with pytest.raises(KvxferError, match="still held on P"):
        s.add_request("a", 32)
    s.release(["a"])
    assert s.held() == ["b"] and s.slot_maps[0].num_free_slots == 6
    s.add_request("a", 32)  # the id is free again


def test_prefill_scheduler_saves_each_logical_block_as_its_kernel_blocks_at_their_positions():
    """40-24-0 (the first bug in docs/save-plans.md) with kernel blocks of half a logical block: step 2
    copies the straddling entry 1 again, as kernel blocks at positions 2 and 3, and the
    params name the same positions D writes at."""
    from kvxfer.plan.save_plan import ScheduledRequest

    s = _prefill_scheduler(kernel_ratio=2)
    s.add_request("r", 40)
    first = s.build_connector_meta([ScheduledRequest("r", 0, 24, ([5, 9, 4],), full_table=True)])
    assert first.blocks["r"] == ([(0, 10), (1, 11), (2, 18), (3, 19)],)
    second = s.build_connector_meta([ScheduledRequest("r", 24, 16, None)])
    assert second.blocks["r"] == ([(2, 18), (3, 19), (4, 8), (5, 9)],)
    assert second.slots["r"][0][:2] == first.slots["r"][0][2:]  # re-staged in its own slots
    assert s.request_finished("r")["groups"][0]["keys"] == [0, 1, 2, 3, 4, 5]


def test_releasing_a_request_still_prefilling_keeps_its_staged_blocks():
    from kvxfer.plan.save_plan import ScheduledRequest

    s = _prefill_scheduler()
    s.add_request("r", 40)
    first = s.build_connector_meta([ScheduledRequest("r", 0, 24, ([5, 9, 4],), full_table=True)])
    s.release(["r", "nobody"])  # not held for D yet: nothing to free
    assert s.slot_maps[0].num_free_slots == 8 - 2
    s.build_connector_meta([ScheduledRequest("r", 24, 16, None)])
    params = s.request_finished("r")
    assert params["groups"][0]["keys"] == [0, 1, 2]
    assert params["groups"][0]["slots"][:2] == first.slots["r"][0]


def test_holds_refuses_an_id_that_is_not_a_str():
    s = _prefill_scheduler()
    assert not s.holds("r")
    with pytest.raises(KvxferError, match=r"request id must be a str, got \['r'\]"):
        s.holds(["r"])
