"""`vlora serve replicas.count=2` on CPU: a local Ray cluster with two engine replicas behind the
RPyC front end. Clients list the adapters, get the single engine's tokens for requests of two
adapters and none, see the server healthy, and are told why adapters cannot be loaded at run time.
With engine.tensor_parallel_size=2 too, each replica leads a two-rank group of its own."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from adapter_cases import build_adapters
from rpc_server import TOKEN, ServerProcess, follower_pids

from serve import Engine, EngineConfig, Request, SamplingParams
from serve.rpc import Client, ServerError

pytest.importorskip("ray.serve")

NAME = "qwen2_vl_tiny"


@pytest.mark.parametrize("tensor_parallel", [1, 2])
def test_replicas_behind_vlora_serve(tiny_zoo, vlora_home, tmp_path, tensor_parallel):
    adapters = {n: str(p) for n, p in build_adapters(tiny_zoo[NAME], tmp_path, ("qv8", "all16")).items()}
    specs = tuple(f"{n}={p}" for n, p in adapters.items())
    rng = np.random.default_rng(0)
    cases = [("How many cars?", [rng.integers(0, 256, (64, 80, 3), dtype=np.uint8)], a)
             for a in ("qv8", "all16", None, "qv8")]
    engine = Engine(tiny_zoo[NAME], EngineConfig(device="cpu", num_kv_blocks=96, adapters=specs))
    want = [engine.generate(Request(prompt=p, images=list(imgs), adapter=a,
                                    sampling=SamplingParams(max_tokens=6, ignore_eos=True))).token_ids
            for p, imgs, a in cases]
    before = follower_pids()
    server = ServerProcess(tiny_zoo[NAME], vlora_home, "replicas.count=2", "replicas.cpus_per_replica=0",
                           "engine.policy=fcfs", f"engine.tensor_parallel_size={tensor_parallel}", f"adapters.manifest={tmp_path}/no-manifest.json",  # only these two
                           "adapters.extra=[" + ",".join(f"'{s}'" for s in specs) + "]",
                           f"rpc.adapter_root={tmp_path}")  # run-time loads allowed from there
    try:
        assert len(follower_pids() - before) == 2 * (tensor_parallel - 1)  # each replica's rank 1
        got: dict[int, list[int]] = {}

        def ask(i: int) -> None:
            prompt, imgs, adapter = cases[i]
            with Client("127.0.0.1", server.port, TOKEN) as c:
                got[i] = c.submit_image(prompt, imgs, adapter=adapter,
                                        sampling={"max_tokens": 6, "ignore_eos": True}).result(120)["token_ids"]

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(cases))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert got == dict(enumerate(want))
        with Client("127.0.0.1", server.port, TOKEN) as c:
            assert {a["name"] for a in c.list_adapters()} == {"qv8", "all16"}
            assert c.health()["healthy"]
            with pytest.raises(ServerError, match="redeploy"):
                c.load_adapter("more", adapters["qv8"])
    finally:
        server.stop()
    assert any("2 replica(s)" in line for line in server.lines)
