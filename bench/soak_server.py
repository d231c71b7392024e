"""The server under soak: a real `vlora serve` subprocess on loopback, its output in a log file.

The soak reads the process from outside only: resident memory from /proc, the log's size from its
file, and everything else through a token-holding client (health and metrics), as an operator would.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from apps.common.stats import percentile


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the soak's process dies, even killed (Linux prctl)."""
    import ctypes
    import signal

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class ServerUnderTest:
    def __init__(self, checkpoint: str, home: Path, token: str, device: str, overrides: list[str],
                 threads: int | None, start_timeout_s: float = 180.0):
        self.token, self.home = token, Path(home)
        self.http_port: int | None = None
        self.log_path = self.home / "serve.log"
        env = {**os.environ, "VLORA_HOME": str(home), "VLORA_TOKEN": token, "PYTHONUNBUFFERED": "1",
               "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
        if threads is None:  # the server's own choice (rpc.engine_threads), torch's default elsewhere
            del env["OMP_NUM_THREADS"]
        cmd = [sys.executable, "-m", "vlora.cli", "serve", f"model.path={checkpoint}", "rpc.host=127.0.0.1",
               "rpc.port=0", f"engine.device={device}", f"hydra.run.dir={home}/runs/serve", *overrides]
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        self.port = self._wait_listening(start_timeout_s)
        self._wait_ready(start_timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        """On a GPU the server listens while it warms its engine up (engine.warm_up=auto) and refuses
        submissions until then: the soak's baseline waits for it, or it would measure refusals."""
        from serve.rpc import Client

        try:
            with Client("127.0.0.1", self.port, self.token) as client:
                client.wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_listening(self, timeout_s: float) -> int:
        """The RPyC port, once the server prints it; `http_port` too when it has the HTTP front end
        (its line comes first)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in self.log_path.read_text(errors="replace").splitlines():
                if line.startswith("vlora serve: HTTP (OpenAI API) on http://"):
                    self.http_port = int(line.rsplit(":", 1)[1].split("/")[0])
                if line.startswith("vlora serve: listening on "):
                    return int(line.rsplit(":", 1)[1])
            if self.proc.poll() is not None:
                raise RuntimeError("the server exited before listening:\n" + self.log_tail())
            time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"the server did not listen within {timeout_s:g} s:\n" + self.log_tail())

    def alive(self) -> bool:
        return self.proc.poll() is None

    def rss_mb(self) -> float:
        """Resident memory (VmRSS) of the server: its process and its children (the engine's own
        process); not theirs (compiler workers come and go), MB."""
        return sum(_vm_rss_kb(pid) for pid in [self.proc.pid, *_children(self.proc.pid)]) / 1024

    def log_size(self) -> tuple[int, int]:
        """(bytes, lines) the server has written to its log."""
        data = self.log_path.read_bytes()
        return len(data), data.count(b"\n")

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(15)
        self._log.close()


def legit_latencies(port: int, token: str, n: int, max_tokens: int, timeout_s: float = 60.0) -> list[float]:
    """Latencies (ms) of n sequential requests of one legitimate client: a 32x32 image, max_tokens out."""
    from serve.rpc import Client

    frame = np.zeros((32, 32, 3), np.uint8)
    out = []
    with Client("127.0.0.1", port, token) as client:
        for _ in range(n):
            start = time.perf_counter()
            final = client.submit_image("How many cars?", [frame],
                                        sampling={"max_tokens": max_tokens, "ignore_eos": True}).result(timeout_s)
            out.append((time.perf_counter() - start) * 1e3)
            if len(final["token_ids"]) != max_tokens:
                raise RuntimeError(f"a legitimate request got {len(final['token_ids'])} tokens, not {max_tokens}")
    return out


def latency_summary(latencies_ms: list[float]) -> dict:
    return {"n": len(latencies_ms), "p50_ms": round(percentile(latencies_ms, 50), 2),
            "p95_ms": round(percentile(latencies_ms, 95), 2), "max_ms": round(max(latencies_ms), 2)}


def snapshot(port: int, token: str) -> dict:
    """The counters the leak checks compare: health, engine stats and server counters, in one dict."""
    from serve.rpc import Client

    with Client("127.0.0.1", port, token) as client:
        health, metrics = client.health(), client.metrics()
    engine, server = metrics["engine"], metrics["server"]
    return {"healthy": health["healthy"], "in_flight": health["in_flight"], "waiting": health["waiting"],
            "running": health["running"], "num_blocks": engine["num_blocks"],
            "blocks_in_use": engine["blocks_in_use"], "blocks_free": engine["num_blocks"] - engine["blocks_in_use"],
            "adapters_loaded": engine.get("adapters_loaded", 0), "adapters_resident": engine.get("adapters_resident", 0),
            "pixels_in_flight": metrics.get("pixels_in_flight"),
            "connections": server.get("connections", 0) - 1,  # less the snapshot's own
            "server_counters": {k: v for k, v in server.items() if k != "connections"}}


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(c) for c in f.read().split()]
    except OSError:  # gone meanwhile
        return []


def _vm_rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:  # gone meanwhile
        pass
    return 0
