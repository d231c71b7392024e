"""Where the model's forwards run on this CPU, glibc keeps its dynamic mmap threshold (serve/rpc/memory.py):
a pinned one mmapped and unmapped the forward's large temporaries every step. Checked by the allocator's own
count of mmapped blocks (mallinfo2) for a block freed and asked for again, in the process that steps."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest

from serve import Engine, EngineConfig
from serve.rpc import EngineProcess
from serve.rpc.memory import THRESHOLD_ENV, pin_mmap_threshold

NAME = "qwen2_vl_tiny"
BLOCK = 4 << 20  # above the pinned threshold (256 KB), under glibc's dynamic ceiling (32 MB)
HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _libc():
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    if not hasattr(libc, "mallinfo2"):
        pytest.skip("no glibc with mallinfo2 here")
    libc.mallinfo2.restype = _MallInfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    return libc


def mmaps_again(_engine=None) -> bool:
    """Whether a block of BLOCK bytes, freed and asked for again, is mmapped again (module-level: it runs in
    the engine's process through EngineProcess.call)."""
    libc = _libc()
    libc.free(libc.malloc(BLOCK))  # a dynamic threshold rises past BLOCK here
    before = libc.mallinfo2().hblks
    again = libc.malloc(BLOCK)
    mapped = libc.mallinfo2().hblks > before
    libc.free(again)
    return mapped


def cpu_engine(checkpoint) -> Engine:
    return Engine(checkpoint, EngineConfig(device="cpu", num_kv_blocks=32))


def _fresh(lines: str) -> str:
    """The last word `lines` print in a fresh interpreter without the pinning variable."""
    _libc()
    env = {k: v for k, v in os.environ.items() if k != THRESHOLD_ENV}
    code = f"import sys\nsys.path[:0] = [{str(ROOT)!r}, {str(HERE)!r}]\nfrom test_forward_heap import *\n{lines}"
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True,
                          check=True).stdout.split()[-1]


def test_the_probe_tells_a_pinned_threshold_from_a_dynamic_one():
    assert _fresh("print(mmaps_again())") == "False"
    assert _fresh("pin_mmap_threshold()\nprint(mmaps_again())") == "True"


def test_a_server_stepping_a_cpu_engine_in_its_process_keeps_the_dynamic_threshold(tiny_zoo):
    """RpcServer pins for its connections' frames, except where the forwards run in its own process."""
    assert _fresh(f"from serve.rpc import RpcServer\n"
                  f"with RpcServer(cpu_engine({str(tiny_zoo[NAME])!r}), 'forward-heap-token', port=0):\n"
                  f"    print(mmaps_again())") == "False"


def test_a_cpu_engines_process_keeps_the_dynamic_threshold_though_its_parent_pinned(tiny_zoo):
    pin_mmap_threshold()  # as a front end does: the environment would hand it on to a process started now
    assert os.environ.get(THRESHOLD_ENV)
    loop = EngineProcess(partial(cpu_engine, tiny_zoo[NAME])).start()
    try:
        assert loop.call(mmaps_again) is False
    finally:
        loop.stop()
