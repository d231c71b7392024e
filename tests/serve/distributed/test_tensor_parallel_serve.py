"""`vlora serve` with tensor parallel on CPU: torchrun starts two ranks (gloo); rank 0 serves RPyC
clients and drives rank 1. Image and video requests from concurrent clients get the tokens of the
single-process engine, and the whole group goes away on SIGTERM."""

from __future__ import annotations

import threading

import numpy as np
from rpc_server import TOKEN, ServerProcess

from serve import Engine, EngineConfig, Request, SamplingParams
from serve.distributed import free_port
from serve.rpc import Client

NAME = "qwen2_vl_tiny"


def test_two_rank_server_answers_like_one_process(tiny_zoo, vlora_home):
    rng = np.random.default_rng(0)
    cases = [("How many cars?", [rng.integers(0, 256, (64, 80, 3), dtype=np.uint8)], None),
             ("Which way do they go?", [], rng.integers(0, 256, (4, 56, 56, 3), dtype=np.uint8))]
    engine = Engine(tiny_zoo[NAME], EngineConfig(device="cpu", num_kv_blocks=96))
    want = [engine.generate(Request(prompt=p, images=list(imgs), video=clip,
                                    sampling=SamplingParams(max_tokens=6, ignore_eos=True))).token_ids
            for p, imgs, clip in cases]
    launcher = ("torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
                "--master_port", str(free_port()), "-m")
    server = ServerProcess(tiny_zoo[NAME], vlora_home, "engine.tensor_parallel_size=2", "engine.policy=fcfs",
                           launcher=launcher)
    try:
        got: dict[int, list[int]] = {}

        def ask(i: int) -> None:
            prompt, imgs, clip = cases[i % 2]
            with Client("127.0.0.1", server.port, TOKEN) as c:
                stream = (c.submit_image(prompt, imgs, sampling={"max_tokens": 6, "ignore_eos": True}) if imgs else
                          c.submit_video(prompt, clip, sampling={"max_tokens": 6, "ignore_eos": True}))
                got[i] = stream.result(120)["token_ids"]

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert {i: got.get(i) for i in range(4)} == {i: want[i % 2] for i in range(4)}
    finally:
        server.stop()
    # torchrun forwards SIGTERM to both ranks and reports the signal; the group must be gone
    assert server.proc.returncode is not None and not any("[rank1]" in line and "Error" in line for line in server.lines)
