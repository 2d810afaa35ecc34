"""Property: any single change to a request's params fails that request alone, or reads its own.

`kv_transfer_params` pass through proxies and may come from clients. Hypothesis
draws one field of one request's params (slots, keys, generation, instance,
secret, prompt digest) and one change to it (another value, another live
request's value, a reorder); D loads that request between two untouched ones.
The untouched ones always finish with their own blocks. The changed one either
fails (in its own logical ids) or finishes holding exactly its own blocks
(a change that does not matter, such as the same value); D never holds
another request's bytes, and no staging slot leaks.
"""

import itertools
import os
import sys
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvxfer.connector.scheduler import LoadRequest
from kvxfer.nixl.wire import prompt_digest
from kvxfer.plan.save_plan import ScheduledRequest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from procs.pair import Pair, as_bits  # noqa: E402

pytest.importorskip("nixl_cu12._api", reason="NIXL (nixl-cu12) is not installed")

FIELDS = ("slots", "keys", "generation", "instance", "secret", "prompt")
_ids = itertools.count()


@pytest.fixture(scope="module")
def pr():
    made = Pair()
    made.serve()
    yield made
    made.close()


def _prefill(pr, req_id, p_table, prompt):
    pr.p.add_request(req_id, len(prompt), prompt)
    pr.save(ScheduledRequest(req_id, 0, len(prompt), (p_table,), full_table=True))
    return pr.p.request_finished(req_id)


def _change(params, other, field, how, value):
    """`params` with one change to `field`: `how` is "other" (another live request's value),
    "swap" (its first two entries exchanged) or "value" (a drawn one)."""
    changed = dict(params, groups=[dict(g) for g in params["groups"]])
    group = changed["groups"][0]
    if field in ("slots", "keys"):
        if how == "other":
            group[field] = list(other["groups"][0][field])
        elif how == "swap":
            group[field] = group[field][::-1]
        else:
            group[field] = [value % 32] + group[field][1:]
    elif field == "generation":
        changed[field] = other[field] if how == "other" else params[field] + 1 + value % 5
    elif field in ("instance", "secret", "prompt"):
        digits = 16 if field == "instance" else 32
        changed[field] = other[field] if how == "other" else f"{value:0{digits}x}"[-digits:]
    return changed


@settings(max_examples=24, deadline=None, suppress_health_check=list(HealthCheck))
@given(field=st.sampled_from(FIELDS), how=st.sampled_from(["other", "swap", "value"]),
       value=st.integers(0, 2**64))
def test_one_changed_field_fails_its_request_alone_or_reads_its_own_blocks(pr, field, how,
                                                                          value):
    n = next(_ids)
    names = [f"a{n}", f"b{n}", f"c{n}"]
    p_tables = {r: [2 + 2 * i, 3 + 2 * i] for i, r in enumerate(names)}
    d_tables = {r: [10 + 2 * i, 11 + 2 * i] for i, r in enumerate(names)}
    prompts = {r: [1000 * i + t for t in range(32)] for i, r in enumerate(names)}
    params = {r: _prefill(pr, r, p_tables[r], prompts[r]) for r in names}
    a, b, c = names
    changed = _change(params[b], params[c], field, how, value)
    pr.d.start_load_kv({r: LoadRequest(changed if r == b else params[r], d_tables[r],
                                       prompt=prompt_digest(prompts[r])) for r in names})
    finished, failed = pr.wait(3)
    assert sorted(finished + failed) == sorted(names)
    assert a in finished and c in finished, (finished, failed)
    checked = [a, c] + ([b] if b in finished else [])
    for r in checked:  # every request D reports finished holds exactly its own blocks
        for p_cache, d_cache in zip(pr.p_caches[0], pr.d_caches[0]):
            assert (as_bits(d_cache)[d_tables[r]] == as_bits(p_cache)[p_tables[r]]).all(), r
    if b in failed:
        assert pr.d.get_block_ids_with_load_errors() == set(d_tables[b])
    assert pr.d.staging.num_free_slots == pr.d.staging.num_slots
    if b in failed:  # D said nothing to P: P would hold b until its lease ends
        pr.d.expect(params[b])
        pr.d.cancel(params[b])
    deadline = time.monotonic() + 10  # every slot of P is free again for the next example
    while not set(names) <= set(pr.freed):
        assert time.monotonic() < deadline, (names, pr.freed[-6:])
        pr.get_finished()  # D's poll sends the cancel's done
        time.sleep(0.005)
