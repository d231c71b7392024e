"""A replica awaits its requests' final events on its event loop, not on worker threads
(serve.distributed.replicas._final), and a ticket's final event is queued before anyone is woken."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from serve.rpc.loop import Ticket

pytest.importorskip("ray")
from serve.distributed.replicas import _final  # noqa: E402


def test_the_final_event_is_queued_before_the_ticket_says_finished():
    ticket, seen = Ticket("r1", owner="t"), []
    ticket.on_finish = lambda: seen.append([e["type"] for e in ticket.take(0.0)])
    ticket.put({"type": "token", "text": "a"})
    ticket.put({"type": "final", "text": "a"})
    assert seen == [["token", "final"]] and ticket.finished.is_set()


def test_requests_in_flight_hold_no_worker_thread():
    # the replica's pool of worker threads (asyncio's default executor) also prepares new requests: with its
    # one thread busy, 40 requests in flight must still be answered (a thread waiting per request hung here)
    async def main():
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(max_workers=1))
        blocker = threading.Event()
        busy = loop.run_in_executor(None, blocker.wait)  # the pool's only thread, taken
        tickets = [Ticket(f"r{i}", owner="t") for i in range(40)]

        def engine(t: Ticket):  # answers from a thread of its own, as the EngineLoop does
            threading.Thread(target=lambda: (time.sleep(0.05), t.put({"type": "final", "text": t.request_id})),
                             daemon=True).start()

        finals = await asyncio.wait_for(asyncio.gather(*(_final(t, lambda t=t: engine(t)) for t in tickets)), 10)
        blocker.set()
        await busy
        return finals

    finals = asyncio.run(main())
    assert [f["text"] for f in finals] == [f"r{i}" for i in range(40)]
    assert all(f["type"] == "final" for f in finals)
