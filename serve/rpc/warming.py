"""The engine's warm-up as the front end sees it (serve/engine/warmup.py runs it).

`EngineLoop` runs the warm-up first on its own thread; `EngineProcess` learns when its engine
process has done the same. Until then the server takes no work: submissions and engine calls are
refused with the `warming` kind (cheaply, before any frame is decoded) and health answers
`state: "warming"` without asking the engine, so a client connecting early knows to wait
(`Client.wait_ready`) and cameras never queue behind kernel compiles.
"""

from __future__ import annotations

import threading
import time

from .errors import RequestError


_TOLD = threading.Lock()  # on_warm is called once, whether the warm-up or when_warm comes first


class WarmState:
    warming_since: float | None = None  # time.monotonic() when the warm-up started; None: taking work
    warm: dict | None = None  # the warm-up's report (WarmReport.to_dict()), once done
    on_warm = None  # called with that report once the warm-up is over

    @property
    def warming(self) -> float | None:
        """Seconds the warm-up has run so far, or None when the engine takes work."""
        since = self.warming_since
        return None if since is None else time.monotonic() - since

    def refuse_if_warming(self) -> None:
        seconds = self.warming
        if seconds is not None:
            raise RequestError("warming", f"the engine is warming up ({seconds:.0f} s so far) and takes no work yet; "
                                          "retry once health says state 'ready' (Client.wait_ready)")

    def warmed(self, report: dict) -> None:
        with _TOLD:
            self.warm, self.warming_since = report, None
            hook, self.on_warm = self.on_warm, None
        if hook is not None:
            hook(report)

    def when_warm(self, hook) -> None:
        """hook(report) once the warm-up is over (now, if it is over already)."""
        with _TOLD:
            done = self.warm is not None and self.warming_since is None
            if not done:
                self.on_warm = hook
        if done:
            hook(self.warm)
