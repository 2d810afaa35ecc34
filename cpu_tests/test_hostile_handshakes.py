"""Handshakes under attack: params may name any number of made-up P agents; what D keeps of
their failures is bounded and swept (issue: safe at every edge)."""

from kvxfer.errors import TransferError
from kvxfer.nixl.agent import TransportConfig
from kvxfer.nixl.handshake import MAX_FAILED, Handshakes


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
