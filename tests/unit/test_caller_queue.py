"""`CallerQueue`: when each call's oldest request arrived, from the markers and the calls between them."""
import pytest

from dvabatch_backend.runtime.caller_queue import CallerQueue


def test_nothing_is_known_until_two_markers_have_measured_the_rate() -> None:
    queue = CallerQueue()
    assert queue.oldest_arrival() is None
    queue.came(16, [], True)
    assert queue.oldest_arrival() is None
    queue.came(16, [(3, 10.0)], True)  # a marker sent at 10 s, 12 requests behind it
    assert queue.oldest_arrival() is None and queue.rate is None


def test_requests_between_two_markers_arrived_between_their_sends_at_the_rate_they_give() -> None:
    queue = CallerQueue()
    queue.came(16, [(15, 10.0)], True)  # marker a (sent at 10 s) ends the call
    queue.came(16, [], True)
    queue.came(16, [(4, 10.5)], True)  # marker b, sent at 10.5 s: 16 + 4 requests came between them
    assert queue.rate == pytest.approx(40.0)
    # 11 requests came out behind b: the next call's oldest arrived 11 / 40 s after b was sent
    assert queue.oldest_arrival() == pytest.approx(10.5 + 11 / 40)
    queue.came(16, [], True)
    assert queue.oldest_arrival() == pytest.approx(10.5 + 27 / 40)


def test_a_call_that_is_not_full_says_the_queue_emptied() -> None:
    queue = CallerQueue()
    queue.came(16, [(0, 1.0)], True)
    queue.came(16, [(0, 2.0)], True)
    assert queue.oldest_arrival() is not None
    queue.came(5, [], False)
    assert queue.oldest_arrival() is None
    assert queue.rate == pytest.approx(15.0)
    queue.came(16, [(0, 3.0)], True)  # no rate from a span the queue emptied in: the last stands
    assert queue.rate == pytest.approx(15.0)
    assert queue.oldest_arrival() == pytest.approx(3.0 + 15 / 15.0)


def test_a_request_out_before_a_marker_arrived_before_it_was_sent() -> None:
    """Whatever the rate says, the oldest request arrived before the earliest marker still out was
    sent (the queue is first in, first out): the wait known for certain."""
    queue = CallerQueue()
    assert queue.oldest_arrival(marker_out=4.0) == 4.0  # nothing measured yet
    queue.came(16, [(0, 10.0)], True)
    queue.came(16, [(0, 11.0)], True)  # a slow rate (15 a second)...
    queue.came(16, [], True)
    assert queue.oldest_arrival() == pytest.approx(11.0 + 31 / 15)
    assert queue.oldest_arrival(marker_out=11.5) == 11.5  # ...while a marker sent at 11.5 s is still out
