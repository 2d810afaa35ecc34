"""P's answering thread: its interval refused by name when not seconds in (0, 1], and stopped by
`close` (what it answers: test_nixl.py, a busy P)."""

import pytest

from kvxfer.device.staging import Staging
from kvxfer.errors import InvalidInputError
from kvxfer.nixl.agent import TransportConfig
from kvxfer.nixl.prefill import PrefillTransport

pytest.importorskip("nixl_cu12._api", reason="NIXL (nixl-cu12) is not installed")


@pytest.mark.parametrize("every_s", [0, -1, 2.0, "0.001", True, float("nan")])
def test_answer_in_background_refuses_an_interval_that_is_not_seconds_up_to_one_naming_it(every_s):
    p = PrefillTransport(TransportConfig("P-answer-bad"), Staging(1, 4, (2,)), {})
    try:
        with pytest.raises(InvalidInputError, match="every_s"):
            p.answer_in_background(every_s)
        assert p._answering is None
    finally:
        p.close()


def test_close_stops_the_answering_thread():
    p = PrefillTransport(TransportConfig("P-answer-close"), Staging(1, 4, (2,)), {})
    p.answer_in_background()
    thread = p._answering
    assert thread.is_alive()
    p.close()
    assert not thread.is_alive() and p.agent is None
