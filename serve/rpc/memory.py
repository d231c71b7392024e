"""Large buffers go back to the system when freed.

glibc raises its mmap threshold each time a large mmapped block is freed (up to 32 MB), after which
blocks of that size come from the arenas of the thread that asked, and the arenas keep them when
they are freed. A server whose connection threads decode frames and pickle requests of megabytes
then grows by hundreds of MB and stays there: 16 clients of 8-frame 320x240 chunks took a server
from 908 to 1436 MB resident (839 to 1010 with the engine in its own process), 856 with the
threshold pinned at 256 KB. Pinning it (mallopt) turns the dynamic adjustment off; an engine
process gets it from its start (the environment variable, which also covers what was allocated
before any code of ours ran). Smaller blocks freed by a burst of requests are handed back by
`trim_when_idle`, once nothing is in flight.

Not in a process whose CPU runs the model's forward passes (an engine on the CPU device,
`pin_unless_forwarding`). There the forward's large temporaries (the logits, a batched attention's
scores) would be mmapped and unmapped every step, and every page of them faulted in again: the tiny
model's decode step of 8 sequences took 9.6-12.5 ms pinned against 5.8-6.7 dynamic, 32 sequences 22-25 ms
against 12-16 (one process, 2 CPU cores; results/soak/cpu/forward_heap). glibc's dynamic threshold lets
those blocks come back from the heap.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import gc
import logging
import os
import threading

log = logging.getLogger("vlora.serve.rpc")
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
MMAP_THRESHOLD_BYTES = 256 << 10
THRESHOLD_ENV = "MALLOC_MMAP_THRESHOLD_"  # glibc reads it at a process's start


def _libc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        return libc if libc is not None and hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim") else None
    except OSError:  # not glibc (musl, macOS): its allocator decides
        return None


def pin_mmap_threshold(nbytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Blocks of nbytes and more are mmapped (and unmapped when freed), here and in processes
    started from here; False where there is no glibc."""
    os.environ.setdefault(THRESHOLD_ENV, str(nbytes))
    libc = _libc()
    ok = bool(libc is not None and libc.mallopt(M_MMAP_THRESHOLD, nbytes))
    if not ok:
        log.debug("the allocator's mmap threshold was not set")
    return ok


def forwards_on_this_cpu(engine) -> bool:
    """Whether `engine` runs the model's forward passes on this process's CPU: an engine on the CPU device
    (an EngineProcess handle or a GPU engine does not)."""
    return getattr(getattr(engine, "device", None), "type", None) == "cpu"


def pin_unless_forwarding(engine) -> bool:
    """pin_mmap_threshold, unless this process's CPU runs `engine`'s forwards (then glibc keeps its dynamic
    threshold: see the module's note); whether it pinned."""
    if forwards_on_this_cpu(engine):
        log.debug("the allocator's mmap threshold left dynamic: the model's forwards run on this CPU")
        return False
    return pin_mmap_threshold()


@contextlib.contextmanager
def unpinned_children():
    """Processes started within get no pinned threshold from this one's environment: an engine process
    decides its own once it knows its device (`pin_unless_forwarding`)."""
    value = os.environ.pop(THRESHOLD_ENV, None)
    try:
        yield
    finally:
        if value is not None:
            os.environ.setdefault(THRESHOLD_ENV, value)


def trim_when_idle(idle, period_s: float = 10.0) -> threading.Event | None:
    """A daemon thread that hands freed heap memory back (malloc_trim) every period_s while idle()
    says nothing is in flight, once per idle spell; set the returned event to stop it."""
    libc = _libc()
    if libc is None:
        return None
    stop = threading.Event()

    def run() -> None:
        trimmed = False
        while not stop.wait(period_s):
            if not idle():
                trimmed = False
            elif not trimmed:
                libc.malloc_trim(0)  # ctypes lets go of the interpreter meanwhile
                trimmed = True

    threading.Thread(target=run, name="vlora-trim", daemon=True).start()
    return stop


def freeze_heap() -> int:
    """Collects the garbage, then exempts every object alive now from later collections (gc.freeze);
    returns how many were frozen.

    A front end's heap after start-up is large and lives as long as the process (torch, transformers,
    the processor's tokenizer), and a full collection walks all of it: one took 290-305 ms on a server at
    camera capacity, the connection threads stood still meanwhile, and that ten-second window's p95 went
    from 0.4 to 1.1-1.4 s (results/streams/nvidia_h200/cold). Frozen objects are still freed by reference counting; only cycles
    among them that become garbage later are kept, which a process serving one server for its life can
    afford (a test process that builds many servers undoes it with gc.unfreeze)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
