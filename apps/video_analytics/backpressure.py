"""Bounded queues between a stream's reader and its worker, with drop policies and counters.

When the server falls behind, a live camera does not wait: something has to go.

    drop_oldest   FIFO; a put into a full queue drops the oldest item. Everything that is kept
                  is processed in order, at most `capacity` items late.
    latest_frame  the consumer always takes the newest item and every older one is dropped:
                  results are as fresh as possible, intermediate chunks are skipped.
    block         a put waits for room (nothing is dropped): for offline files, where the
                  reader can simply slow down.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Generic, TypeVar

POLICIES = ("drop_oldest", "latest_frame", "block")
T = TypeVar("T")


@dataclass
class QueueStats:
    put: int = 0  # items offered
    taken: int = 0  # items handed to the consumer
    dropped: int = 0  # items let go by the policy
    high_water: int = 0  # most items ever waiting at once

    def to_dict(self) -> dict[str, int]:
        return {"put": self.put, "taken": self.taken, "dropped": self.dropped, "high_water": self.high_water}


class Closed(Exception):
    """put() on a closed queue."""


class BoundedQueue(Generic[T]):
    def __init__(self, capacity: int, policy: str = "drop_oldest"):
        if policy not in POLICIES:
            raise ValueError(f"backpressure policy must be one of {POLICIES}, got {policy!r}")
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"queue capacity must be an int >= 1, got {capacity!r}")
        self.capacity, self.policy = capacity, policy
        self.stats = QueueStats()
        self._items: deque[T] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self.dropped_items: deque[T] = deque(maxlen=64)  # the latest drops, for reports and tests

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)

    @property
    def closed(self) -> bool:
        return self._closed

    def _drop(self, item: T) -> None:
        self.stats.dropped += 1
        self.dropped_items.append(item)

    def put(self, item: T, timeout: float | None = None) -> bool:
        """Offer an item. Returns False only when `block` timed out (the item is then dropped)."""
        with self._cond:
            if self._closed:
                raise Closed("put() on a closed queue")
            self.stats.put += 1
            if len(self._items) >= self.capacity:
                if self.policy == "block":
                    deadline = None if timeout is None else time.monotonic() + timeout
                    while len(self._items) >= self.capacity and not self._closed:
                        left = None if deadline is None else deadline - time.monotonic()
                        if left is not None and left <= 0:
                            self._drop(item)
                            return False
                        self._cond.wait(left)
                    if self._closed:
                        raise Closed("the queue was closed while put() waited")
                else:
                    self._drop(self._items.popleft())
            self._items.append(item)
            self.stats.high_water = max(self.stats.high_water, len(self._items))
            self._cond.notify_all()
            return True

    def get(self, timeout: float | None = None) -> T | None:
        """The next item (by policy), waiting up to `timeout`; None on timeout or when closed and empty."""
        with self._cond:
            deadline = None if timeout is None else time.monotonic() + timeout
            while not self._items:
                if self._closed:
                    return None
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._cond.wait(left)
            if self.policy == "latest_frame":
                item = self._items.pop()
                while self._items:
                    self._drop(self._items.popleft())
            else:
                item = self._items.popleft()
            self.stats.taken += 1
            self._cond.notify_all()
            return item

    def close(self) -> None:
        """No more puts; get() drains what is left, then returns None."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def clear(self) -> int:
        """Drop everything waiting (a stream being removed); returns how many items went."""
        with self._cond:
            n = len(self._items)
            while self._items:
                self._drop(self._items.popleft())
            self._cond.notify_all()
            return n

    @property
    def drained(self) -> bool:
        with self._cond:
            return self._closed and not self._items
