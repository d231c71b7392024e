"""Kernels compiled after the warm-up: the cost a cold server pays in its first live steps, named.

The warm-up (serve/engine/warmup.py) runs made-up waves so that every Triton kernel serving needs is
compiled before the server says it is ready. Live traffic can still meet a specialisation the waves
did not (Triton compiles a variant per constexpr value and per argument property: an integer equal
to 1 or divisible by 16, a pointer aligned to 16 bytes); each costs a step 0.5-2 s on an H100/H200,
where steps take 0.2-0.5 s. A hook on Triton's compiler counts the variants compiled in this process
after `mark_ready()` and logs each kernel's first one with its specialisation, so a slow first
minute can be traced to the shape the warm-up should also run. Triton without `knobs` (older than
3.4): nothing is watched.
"""

from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("vlora.serve.engine")


class CompileWatch:
    def __init__(self):
        self.ready_at: float | None = None  # time.monotonic() of the end of the warm-up
        self.before = 0  # variants compiled before it (start-up and warm-up)
        self.late: list[tuple[float, str]] = []  # (seconds after ready, kernel and its specialisation)
        self._named: set[str] = set()
        self._lock = threading.Lock()
        self.installed = False

    def install(self) -> bool:
        """Chains a hook onto Triton's post-compile hook (once per process); False without one."""
        if self.installed:
            return True
        try:
            from triton import knobs
        except ImportError:
            return False
        runtime = getattr(knobs, "runtime", None)
        if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
            return False
        previous = runtime.jit_post_compile_hook

        def hook(*args, **kwargs):
            fn = kwargs.get("fn")
            name = getattr(fn, "name", "?")
            self.compiled(name, describe(name, kwargs.get("compile")) or kwargs.get("repr", ""))
            return previous(*args, **kwargs) if previous is not None else None

        runtime.jit_post_compile_hook = hook
        self.installed = True
        return True

    def mark_ready(self) -> None:
        with self._lock:
            self.ready_at = time.monotonic()

    def compiled(self, name: str, spec: str) -> None:
        with self._lock:
            if self.ready_at is None:
                self.before += 1
                return
            after = time.monotonic() - self.ready_at
            self.late.append((after, spec or name))
            first = name not in self._named
            self._named.add(name)
        if first:
            log.warning("kernel %s compiled %.1f s after the warm-up, while serving (a shape the warm-up did not run): %s",
                        name, after, spec)

    def stats(self) -> dict:
        with self._lock:
            return {"before_ready": self.before, "after_ready": len(self.late),
                    "late": [f"{t:.1f} s: {s}" for t, s in self.late[-16:]]}


def describe(name: str, compile: dict | None) -> str | None:
    """What sets this variant apart, in one line: its compile options, its constexpr values and the
    arguments Triton specialised (an integer equal to 1 becomes a constant; `%16`: a pointer aligned to,
    or an integer divisible by, 16). Triton's own `repr` cannot be trusted for this: on Triton 3.6 it
    lists one argument and stops. None where the hook's arguments are not laid out as expected."""
    try:
        names = list(compile["signature"])
        consts = [f"{names[key[0]]}={value}" for key, value in compile["constants"].items() if len(key) == 1]
        aligned = [f"{names[key[0]]}%16" for key, attrs in compile["configs"][0].items()
                   if len(key) == 1 and ["tt.divisibility", 16] in [list(a) for a in attrs]]
        options = f"num_warps={compile['num_warps']}, num_stages={compile['num_stages']}"
        return f"{name}[{options}]({', '.join(consts + aligned)})"
    except (KeyError, IndexError, TypeError, AttributeError):
        return None


WATCH = CompileWatch()  # one per process: Triton's hook is process-wide
