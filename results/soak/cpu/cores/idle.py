"""The soak's server (tiny model, CPU) with no client: its process tree's cores over 5 s, a few seconds after it
listens.  PYTHONPATH=<repo> python idle.py > idle.txt"""
import tempfile
import time
from pathlib import Path

from bench.soak_cpu import CpuWindow
from bench.soak_server import ServerUnderTest
from zoo import build_checkpoint

home = Path(tempfile.mkdtemp(prefix="vlora-idle-"))
checkpoint = str(build_checkpoint("qwen2_vl_tiny", home / "zoo"))
server = ServerUnderTest(checkpoint, home, "idle-token-0123", "cpu",
                         ["+engine.num_kv_blocks=48", "engine.max_batch_size=8"], 1)
try:
    time.sleep(3)
    window = CpuWindow({"server": [server.proc.pid]}).start()
    time.sleep(5)
    print("server with no client:", window.stop())
finally:
    server.stop()
