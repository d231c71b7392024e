"""The engine in a process of its own (serve/rpc/engine_process.py, engine_host.py): the front end's
own preparation equals the engine's, requests are answered as by an engine on a thread, a step
failure's culprit is refused by the front end before it is prepared, an engine process that dies
fails what was in flight without taking the server down, and a `vlora serve` killed outright takes
its engine process with it."""

from __future__ import annotations

import os
import signal
import time
from functools import partial

import numpy as np
import pytest
import torch
from rpc_server import TOKEN as SERVER_TOKEN
from rpc_server import ServerProcess

from serve import Engine, EngineConfig
from serve.engine import Request, SamplingParams
from serve.engine.preparer import Preparer
from serve.rpc import Client, EngineProcess, RpcServer, ServerError

NAME = "qwen2_vl_tiny"
TOKEN = "engine-process-token"
FAULT_TOP_P = 0.625  # a sampling value only the faulty request uses


def _image(seed: int, h: int = 48, w: int = 72) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _engine(checkpoint) -> Engine:
    return Engine(checkpoint, EngineConfig(device="cpu", num_kv_blocks=96))


def faulty_engine(checkpoint) -> Engine:
    """An engine whose sampler raises for sequences sampled with top_p == FAULT_TOP_P (built in the
    engine process: module-level, so the spawned interpreter finds it)."""
    import serve.engine.model_runner as runner

    real = runner.sample

    def sample(logits, params, *args, **kwargs):
        if any(p.top_p == FAULT_TOP_P for p in params):
            raise RuntimeError("injected fault")
        return real(logits, params, *args, **kwargs)

    runner.sample = sample
    return _engine(checkpoint)


def refused_build() -> Engine:
    raise SystemExit("vlora serve: model.path /nowhere does not exist")


@pytest.mark.parametrize("pixels", ["host", "device"])
def test_the_front_ends_preparation_equals_the_engines(tiny_zoo, pixels):
    """Requests are prepared by the front end's Preparer (processor and config, no weights); the engine
    must get exactly what its own prepare() would build: token ids, vision rows, grids, positions."""
    engine = Engine(tiny_zoo[NAME], EngineConfig(device="cpu", num_kv_blocks=32, pixels=pixels))
    front = Preparer.from_checkpoint(tiny_zoo[NAME], engine.pixels)
    clip = np.stack([_image(s, 56, 84) for s in range(3)])  # an odd frame count
    for request in (Request(prompt="What is in the picture?", images=[_image(1, 37, 91)]),
                    Request(prompt="What happens?", video=clip), Request(prompt="Just text.")):
        (want, want_pos, want_delta), (got, got_pos, got_delta) = engine.prepare(request), front.prepare(request)
        assert got.token_ids == want.token_ids and got_delta == want_delta
        assert (got_pos is None) == (want_pos is None) and (got_pos is None or torch.equal(got_pos, want_pos))
        assert [(v.kind, v.grid_thw, v.offset, v.num_tokens, v.content_hash) for v in got.vision] == \
               [(v.kind, v.grid_thw, v.offset, v.num_tokens, v.content_hash) for v in want.vision]
        for g, w in zip(got.vision, want.vision):
            assert (g.pixel_values is None) == (w.pixel_values is None)
            if w.pixel_values is not None:
                assert torch.equal(g.pixel_values, w.pixel_values)


def _greedy(client: Client, seed: int, video: bool = False) -> dict:
    sampling = {"max_tokens": 5, "temperature": 0.0}
    if video:
        return client.submit_video("What happens?", np.stack([_image(seed + i) for i in range(4)]),
                                   sampling=sampling).result(60)
    return client.submit_image("Describe it.", [_image(seed)], sampling=sampling).result(60)


def test_answers_equal_an_engine_on_a_thread(tiny_zoo):
    """The same greedy requests through an engine process and through an engine on a thread of the
    server's process give the same tokens; health and metrics read the engine over there."""
    answers = {}
    for where in ("thread", "process"):
        engine = (EngineProcess(partial(_engine, tiny_zoo[NAME])).start() if where == "process"
                  else _engine(tiny_zoo[NAME]))
        with RpcServer(engine, TOKEN, port=0) as server, Client("127.0.0.1", server.port, TOKEN) as client:
            answers[where] = [_greedy(client, 3)["token_ids"], _greedy(client, 7, video=True)["token_ids"]]
            assert client.health()["healthy"]
            metrics = client.metrics()
            assert metrics["server"]["engine_finished"] == 2 and metrics["engine"]["num_steps"] > 0
    assert answers["process"] == answers["thread"]


def test_a_step_failure_in_the_engine_process_is_refused_by_the_front_end(tiny_zoo):
    """The engine process charges the failure to its request; the front end learns the culprit's kind
    and refuses the next such request itself (before preparing it), while other requests are served."""
    loop = EngineProcess(partial(faulty_engine, tiny_zoo[NAME])).start()
    with RpcServer(loop, TOKEN, port=0) as server, Client("127.0.0.1", server.port, TOKEN) as client:
        bad = {"max_tokens": 3, "temperature": 0.8, "top_p": FAULT_TOP_P}
        first = client.submit_image("Describe it.", [_image(1)], sampling=bad)
        with pytest.raises(ServerError) as failed:
            first.result(60)
        assert failed.value.kind == "engine_error"
        deadline = time.monotonic() + 10
        while not loop.culprits and time.monotonic() < deadline:  # the culprit crosses asynchronously
            time.sleep(0.05)
        assert loop.refuses(Request(prompt="x", images=[_image(2)], sampling=SamplingParams(**bad))) is not None
        with pytest.raises(ServerError) as refused:
            client.submit_image("Describe it again.", [_image(2)], sampling=bad).result(60)
        assert refused.value.kind == "rejected" and "refuses" in str(refused.value)
        assert _greedy(client, 5)["finish_reason"] == "length"


def test_a_dead_engine_process_fails_what_was_in_flight_and_the_server_says_so(tiny_zoo):
    loop = EngineProcess(partial(_engine, tiny_zoo[NAME])).start()
    with RpcServer(loop, TOKEN, port=0) as server, Client("127.0.0.1", server.port, TOKEN) as client:
        long = client.submit_image("Describe it.", [_image(1)], sampling={"max_tokens": 1000, "ignore_eos": True,
                                                                          "temperature": 0.0})
        time.sleep(0.5)
        os.kill(loop._process.pid, signal.SIGKILL)
        with pytest.raises(ServerError) as failed:
            long.result(30)
        assert failed.value.kind == "engine_error" and "engine process exited" in str(failed.value)
        assert client.health()["healthy"] is False  # the front end still answers
        with pytest.raises(ServerError) as refused:
            client.submit_image("Again.", [_image(2)], sampling={"max_tokens": 2}).result(30)
        assert "engine process exited" in str(refused.value)


def test_a_build_that_refuses_is_one_line():
    with pytest.raises(SystemExit, match=r"^vlora serve: model.path /nowhere does not exist$"):
        EngineProcess(refused_build).start()


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(p) for p in f.read().split()]


def test_vlora_serve_killed_outright_takes_its_engine_process_along(tiny_zoo, vlora_home):
    """`vlora serve` runs the engine in a child process by default; a SIGKILL of the server (no clean
    shutdown) leaves no engine process holding the GPU: it sees the pipe close and exits."""
    server = ServerProcess(tiny_zoo[NAME], vlora_home)
    try:
        with Client("127.0.0.1", server.port, SERVER_TOKEN) as client:
            assert client.health()["healthy"]
        engines = _children(server.proc.pid)
        assert engines, "the engine runs in a child process of vlora serve"
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(10)
        deadline = time.monotonic() + 15
        while any(os.path.exists(f"/proc/{p}") and not _zombie(p) for p in engines) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in engines if os.path.exists(f"/proc/{p}") and not _zombie(p)]
    finally:
        server.stop()


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False

