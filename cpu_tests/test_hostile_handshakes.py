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
