"""The lock that keeps `alone` tests alone when the tests run in several workers (tests/conftest.py):
an exclusive test waits for the test in progress, and the other worker starts nothing until it is done."""

from __future__ import annotations

import threading
import uuid

from conftest import _Alone


def _enter_in_thread(door: _Alone, alone: bool) -> threading.Event:
    entered = threading.Event()
    threading.Thread(target=lambda: (door.enter(alone), entered.set()), daemon=True).start()
    return entered


def test_an_alone_test_waits_for_the_running_one_and_then_runs_with_none_beside_it():
    run = uuid.uuid4().hex
    mine, other = _Alone(run), _Alone(run)  # two workers: each its own descriptors
    try:
        other.enter(alone=False)  # the other worker's test in progress
        alone = _enter_in_thread(mine, alone=True)
        assert not alone.wait(0.3)  # waits for it
        # the other worker ends its test and at once starts its next: that one waits for the alone test
        next_one = threading.Event()
        threading.Thread(target=lambda: (other.leave(), other.enter(False), next_one.set()), daemon=True).start()
        assert alone.wait(10)
        assert not next_one.wait(0.3)
        mine.leave()
        assert next_one.wait(10)
        other.leave()
    finally:
        mine.close()
        other.close()


def test_ordinary_tests_of_both_workers_run_together():
    run = uuid.uuid4().hex
    first, second = _Alone(run), _Alone(run)
    try:
        first.enter(alone=False)
        assert _enter_in_thread(second, alone=False).wait(10)
        first.leave()
        second.leave()
    finally:
        first.close()
        second.close()
