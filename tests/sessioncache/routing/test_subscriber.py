"""The sequencing rules of an engine's feed (no sockets: the API tests run those)."""

from __future__ import annotations

from sessioncache.routing.subscriber import Action, Sequencer


def test_sequence_numbers():
    s = Sequencer()
    assert s.classify(0) is Action.APPLY
    assert s.classify(3) is Action.CATCH_UP and s.expected == 0  # joined late: replay from 0
    s.applied(0)
    assert s.classify(1) is Action.APPLY
    assert s.classify(5) is Action.CATCH_UP and s.expected == 1
    s.applied(5)
    assert s.classify(5) is Action.RESTART  # the engine came back and counts from 0 again
    assert s.classify(0) is Action.RESTART
    assert s.classify(6) is Action.APPLY
