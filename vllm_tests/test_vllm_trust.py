"""Params a client edits, through vLLM's real scheduler with kvxfer's connector.

vLLM's OpenAI server takes `kv_transfer_params` in a request body, so a client that reaches
an instance can hand it params a holder really issued, trimmed or relabelled. Each case here
was a success before: the reader counted blocks it never read as loaded, or loaded one
prompt's KV as another's, and decoded on it (and pooled it for every later request). Now
the read fails by name and vLLM computes the prompt; the forward stamps (layer, position,
token) into every token's KV, so every cache is checked byte for byte.
"""

from __future__ import annotations

import logging

import test_vllm_connector
import test_vllm_peer_reads
from test_vllm_connector import _prompt, _spy_reads, assert_prompt_kv, decode, scheduled_tokens
from test_vllm_peer_reads import _decode, _turn_one

from kvxfer.nixl.wire import prompt_digest

pd = test_vllm_connector.pd  # the P/D pair fixture
fleet = test_vllm_peer_reads.fleet  # two kv_both engines, D with a host pool


def _without(params: dict, drop: set[int]) -> dict:
    """`params` with the blocks at `drop` (indices into group 0's keys) deleted."""
    group = params["groups"][0]
    kept = [i for i in range(len(group["keys"])) if i not in drop]
    keys = [group["keys"][i] for i in kept]
    trimmed = {**group, "keys": keys, "slots": [group["slots"][i] for i in kept]}
    if "entries" in group:  # pool entries' secrets, named by key
        trimmed["entries"] = [e for e in group["entries"] if e[0] in keys]
    return {**params, "groups": [trimmed]}


def test_params_trimmed_of_blocks_fail_on_d_and_the_prompt_is_computed(pd, caplog):
    """P's params for a 50-token prompt (4 blocks) with 2 of its 3 whole blocks deleted: D
    counted all 50 tokens as loaded and decoded on whatever its 2 unread blocks held."""
    p, d = pd()
    prompt = _prompt(81, 50)
    params = _without(p.prefill("r", prompt), {1, 2})
    with caplog.at_level(logging.WARNING):
        steps = decode(d, "r-d", prompt, params)
    assert any("name no block for table entries [1, 2]" in r.getMessage() for r in caplog.records)
    first, total = scheduled_tokens(steps, "r-d")
    assert first + total >= 50 and total > 2  # computed again, not taken
    assert_prompt_kv(d, "r-d", prompt)


def test_params_relabelled_to_another_prompt_fail_their_tags_on_d(pd, caplog):
    """P's params for prompt X with `prompt` set to the digest of Y, sent to D with Y: D's
    check of the digest passed (the field was the client's), and D loaded X's KV as Y's."""
    p, d = pd()
    x, y = _prompt(82, 50), _prompt(83, 50)
    params = {**p.prefill("x", x), "prompt": prompt_digest(y)}
    with caplog.at_level(logging.WARNING):
        steps = decode(d, "y-d", y, params)
    assert any("do not hold its blocks" in r.getMessage() for r in caplog.records)
    first, total = scheduled_tokens(steps, "y-d")
    assert first + total >= 50 and total > 2
    assert_prompt_kv(d, "y-d", y)


def test_a_peer_source_trimmed_of_blocks_fails_and_p_computes_the_prompt(fleet, monkeypatch):
    """A lookup's params for a client's own 60-token prefix (3 whole blocks) with 2 of them
    deleted: P counted the 48-token prefix as read and computed only what followed."""
    p, d = fleet()
    history = _turn_one(p, d, 84)
    source = _without(d.prefill("look", history), {1, 2})
    read = _spy_reads(monkeypatch)
    second = history + _prompt(85, 10)
    params = p.prefill("b", second, kv_source=source)
    assert "b" not in read  # refused before anything was read
    assert scheduled_tokens(p.steps, "b") == (0, len(second))
    p.call(assert_prompt_kv, p.engine, "b", second)
    _decode(d, "b-d", second, params, max_tokens=2)
    d.call(assert_prompt_kv, d.engine, "b-d", second)


def test_a_peer_source_relabelled_to_another_prefix_fails_its_tags_on_p(fleet, monkeypatch,
                                                                          caplog):
    """A lookup's `kv_source` for prefix X with its `prompt`, `chain` and `num_prompt_tokens`
    rewritten to prefix Y's: P read X's KV as Y's, and its caches then served it to an
    innocent request for Y."""
    p, d = fleet()
    x = _turn_one(p, d, 86)
    y = _prompt(87, len(x))
    source_x, source_y = d.prefill("look-x", x), d.prefill("look-y", y)
    forged = {**source_x, **{k: source_y[k] for k in ("prompt", "chain", "num_prompt_tokens")}}
    read = _spy_reads(monkeypatch)
    second = y + _prompt(88, 10)
    with caplog.at_level(logging.WARNING):
        params = p.prefill("b", second, kv_source=forged)
    assert read["b"] == [[0, 1, 2]]  # read, then refused: the tags are X's blocks'
    assert any("do not hold its blocks" in r.getMessage() for r in caplog.records)
    assert scheduled_tokens(p.steps, "b") == (0, len(second))  # computed, nothing taken
    p.call(assert_prompt_kv, p.engine, "b", second)
    _decode(d, "b-d", second, params, max_tokens=2)
    d.call(assert_prompt_kv, d.engine, "b-d", second)


def test_a_peer_source_lent_before_a_cache_reset_fails_after_it(fleet, monkeypatch):
    """D's lookup lent P its pooled blocks; then D's cache was reset (new weights) and its
    workers stepped once: P's read of the lookup's params was still answered with the blocks
    from before the reset. Now D's reset revokes them and P computes the prompt."""
    p, d = fleet()
    history = _turn_one(p, d, 89)
    source = d.prefill("look", history)
    sched = d.engine.connector._scheduler
    assert d.call(d.engine.scheduler.reset_prefix_cache, reset_connector=True)
    d.until(lambda: not sched.prefill.revoking, 10.0, "D's workers never stepped after the reset")
    second = history + _prompt(90, 10)
    p.prefill("b", second, kv_source=source)
    assert scheduled_tokens(p.steps, "b") == (0, len(second))  # computed, nothing taken
    assert p.call(lambda: sum(p.engine.connector._scheduler.fallbacks.counters.values())) == 1
    p.call(assert_prompt_kv, p.engine, "b", second)
    assert d.call(lambda: sched.prefill.pools.entries()) == 0


def _keyed(pd, key_file):
    """A P/D pair sharing one fleet key: params are issued under its MAC."""
    extra = {"fleet_key_file": key_file}
    return pd(extra=extra, d={"extra": extra})


def test_with_a_fleet_key_edited_or_unsigned_params_are_refused_by_name_before_any_read(
        pd, tmp_path, monkeypatch, caplog):
    """P's params carry a MAC under the fleet key over every field D acts on: D refuses
    params edited in any of them, stripped of their MAC, or expired, as `forged`, before it
    reads anything or connects to the P they name; the unedited params load."""
    import secrets

    from kvxfer.vllm.fallbacks import counter_name

    key = tmp_path / "fleet.key"
    key.write_text(secrets.token_hex(32))
    p, d = _keyed(pd, str(key))
    prompt = _prompt(91, 50)
    params = p.prefill("r", prompt)
    assert "mac" in params and "expires" in params
    read = _spy_reads(monkeypatch)
    edits = {"port": {**params, "port": 1}, "chain": {**params, "chain": ["00" * 16]},
             "unsigned": {k: v for k, v in params.items() if k != "mac"},
             "expired": {**params, "expires": params["expires"] - 10**6}}
    with caplog.at_level(logging.WARNING):
        for i, forged in enumerate(edits.values()):
            decode(d, f"f{i}", prompt, forged)
            assert_prompt_kv(d, f"f{i}", prompt)
    assert read == {}  # D computed each, and read nothing
    fallbacks = d.connector._scheduler.fallbacks.counters
    assert sum(n for k, n in fallbacks.items() if k.startswith(counter_name("forged", ""))) == 4
    decode(d, "r-d", prompt, params)  # past D's own prefix hit (the edits' prompt), from P
    assert read["r-d"] == [[3]]
    assert_prompt_kv(d, "r-d", prompt)


def test_with_a_fleet_key_d_never_dials_an_address_unsigned_params_name(pd, tmp_path,
                                                                         monkeypatch):
    """A request asking to read its whole prompt from P (`do_remote_prefill`) with a made-up
    `kv_source` beside it, or unsigned params below the recompute threshold: D lets no lease
    go at the address they name (it would connect there to say so)."""
    import secrets

    key = tmp_path / "fleet.key"
    key.write_text(secrets.token_hex(32))
    p, d = _keyed(pd, str(key))
    prompt = _prompt(92, 50)
    params = p.prefill("r", prompt)
    stranger = {"peer": "stranger", "instance": "i", "host": "203.0.113.7", "port": 4444,
                "req_id": "x", "generation": 1, "secret": "0" * 32,
                "groups": [{"keys": [0], "slots": [0]}], "num_prompt_tokens": 50}
    from kvxfer.vllm.decode_loads import DecodeLoads

    told, real = [], DecodeLoads.take

    def take(self, meta):  # what D's workers are told to expect or let go of, at whose P
        real(self, meta)
        told.extend((e.get("host"), e.get("port")) for e in meta.expects + meta.cancels)

    monkeypatch.setattr(DecodeLoads, "take", take)
    decode(d, "r-d", prompt, {**params, "kv_source": stranger})
    decode(d, "s-d", prompt, {**stranger, "do_remote_prefill": True})
    assert ("127.0.0.1", params["port"]) in told  # P's own lease, kept alive for r-d
    assert ("203.0.113.7", 4444) not in told
    assert_prompt_kv(d, "r-d", prompt)


def test_params_for_the_same_tokens_under_another_cache_salt_are_another_prompts(pd,
                                                                                  monkeypatch):
    """P's params for prompt X under one cache salt, sent to D with X under another: the token
    ids alike, the KV not necessarily (a LoRA adapter or an image the salt stands for here
    changes it), and D's cache would keep it under the other salt's hashes. D took them;
    now the prompt digest folds in salt, adapter and multimodal inputs, and D computes."""
    from kvxfer.vllm.fallbacks import counter_name

    p, d = pd()
    prompt = _prompt(93, 50)
    params = p.prefill("x", prompt, cache_salt="tenant-a")
    read = _spy_reads(monkeypatch)
    d.add_request("x-d", prompt, max_tokens=2, kv_transfer_params=params, cache_salt="tenant-b")
    steps = d.run_until(lambda r: "x-d" in r.finished, max_steps=400, min_s=30.0)
    assert read == {} and scheduled_tokens(steps, "x-d") == (0, 51)
    fallbacks = d.connector._scheduler.fallbacks.counters
    assert sum(n for k, n in fallbacks.items()
               if k.startswith(counter_name("other_prompt", ""))) == 1
    params = p.prefill("y", prompt, cache_salt="tenant-b")  # the same salt: read as before
    d.add_request("y-d", prompt, max_tokens=2, kv_transfer_params=params, cache_salt="tenant-b")
    d.run_until(lambda r: "y-d" in r.finished, max_steps=400, min_s=30.0)
    assert read["y-d"] == [[3]]  # taken: past D's own hit (x-d's prompt under tenant-b)
    assert_prompt_kv(d, "y-d", prompt)
