"""The engine's warm-up (serve/engine/warmup.py) and the server's `warming` state (serve/rpc/warming.py):
the waves run every adapter, head and batch size and leave nothing behind that changes an answer;
while warming, the server answers health with state "warming" and refuses work and engine calls
with the `warming` kind, then takes work once warm (Client.wait_ready)."""

from __future__ import annotations

import threading

import numpy as np
import torch
import pytest
from adapter_cases import make_adapter, make_head, one_thread, write_meta  # noqa: F401 - one_thread: fixture

from serve import Engine, EngineConfig
from serve.engine import Request, SamplingParams
from serve.engine.warmup import pack_sizes, wanted, wave_sizes
from serve.rpc import Client, RpcServer, ServerError

NAME = "qwen2_vl_tiny"
TOKEN = "warm-up-token"


@pytest.fixture(scope="module")
def adapter(tiny_zoo, tmp_path_factory):
    path = make_adapter(tiny_zoo[NAME], tmp_path_factory.mktemp("warm") / "counter", ["q_proj", "v_proj"], 8, 16, 5)
    make_head(path / "heads" / "vehicles", "count", 128, seed=3)
    write_meta(path, {"vehicles": "count"})
    return path


def _engine(tiny_zoo, adapter, warm_up: str = "on") -> Engine:
    return Engine(tiny_zoo[NAME], EngineConfig(device="cpu", num_kv_blocks=256, max_batch_size=4, warm_up=warm_up,
                                               adapters=(f"counter={adapter}",)))


def _requests() -> list[Request]:
    clip = np.random.default_rng(7).integers(0, 256, (4, 56, 56, 3), dtype=np.uint8)
    greedy = SamplingParams(max_tokens=5)
    return [Request(prompt="How many cars?", video=clip, adapter="counter", sampling=greedy),
            Request(prompt="How many cars?", video=clip, adapter="counter", output_mode="head", task="vehicles"),
            Request(prompt="Describe it.", images=[clip[0]], sampling=greedy)]


def _answers(engine: Engine) -> list:
    outs = engine.generate(_requests())
    return [(o.token_ids, o.head.to_dict() if o.head is not None else None) for o in outs]


def test_wave_sizes_and_when_it_runs():
    assert wave_sizes(1) == [1] and wave_sizes(4) == [1, 2, 4] and wave_sizes(48) == [1, 2, 4, 8, 16, 32, 48]
    assert pack_sizes(64) == list(range(1, 18)) + [31, 32, 33, 47, 48, 49, 63, 64] and pack_sizes(3) == [1, 2, 3]
    assert wanted("auto", "cuda") and not wanted("auto", "cpu") and wanted("on", "cpu") and not wanted("off", "cuda")
    with pytest.raises(ValueError, match="warm_up"):
        EngineConfig(warm_up="yes")


def test_the_warm_up_runs_every_wave_and_changes_no_answer(tiny_zoo, adapter):
    cold = _engine(tiny_zoo, adapter, warm_up="off")
    assert not cold.needs_warm_up
    want = _answers(cold)
    engine = _engine(tiny_zoo, adapter)
    assert engine.needs_warm_up
    packs, encode = [], engine.model.encode
    engine.model.encode = lambda items: packs.append(len(items)) or encode(items)
    report = engine.warm_up()
    engine.model.encode = encode
    # mixed waves (base + adapter), the tower on every pack size, the adapter alone, 1 + 2 + 4 requests each
    assert report.requests == 14 and set(report.phases) == {"mixed waves", "tower packs", "one-adapter waves"}
    assert set(pack_sizes(engine.config.max_vision_batch)) <= set(packs)
    assert report.steps >= 6 and engine.warm_up() is report and not engine.needs_warm_up  # once
    assert not engine.has_unfinished() and len(engine.runner.encoder_cache) == 0  # nothing made up stays
    assert engine.runner.counters["items_encoded"] >= 14  # every request's picture went through the tower
    assert _answers(engine) == want


class _HeldWarmUp(Engine):
    """The real engine, whose warm-up waits for the test to let it finish."""

    release = threading.Event()

    def warm_up(self):
        assert self.release.wait(60)
        return super().warm_up()


def test_a_warming_server_refuses_work_then_serves(tiny_zoo, adapter):
    engine = _HeldWarmUp(tiny_zoo[NAME], EngineConfig(device="cpu", num_kv_blocks=256, max_batch_size=2, warm_up="on",
                                                      adapters=(f"counter={adapter}",)))
    server = RpcServer(engine, TOKEN, "127.0.0.1", 0).start()
    try:
        with Client("127.0.0.1", server.port, TOKEN) as client:
            health = client.health()
            assert health["state"] == "warming" and health["healthy"] and "warming_s" in health
            clip = np.zeros((2, 56, 56, 3), dtype=np.uint8)
            with pytest.raises(ServerError) as refused:
                client.submit_video("How many cars?", clip, adapter="counter", sampling={"max_tokens": 2})
            assert refused.value.kind == "warming" and "Client.wait_ready" in str(refused.value)
            with pytest.raises(ServerError) as listing:
                client.list_adapters()
            assert listing.value.kind == "warming"
            _http_refuses_while_warming(server)
            seen = []
            _HeldWarmUp.release.set()
            ready = client.wait_ready(timeout_s=120, on_wait=seen.append)
            assert ready["state"] == "ready" and ready["warm_up_s"] > 0
            final = client.submit_video("How many cars?", clip, adapter="counter", sampling={"max_tokens": 2}).result(120)
            assert len(final["token_ids"]) == 2
            assert [a["name"] for a in client.list_adapters()] == ["counter"]
    finally:
        server.close()


def _http_refuses_while_warming(server) -> None:
    """The OpenAI-compatible front end over the same state: a warming server is 503 (retry), not 400."""
    pytest.importorskip("starlette")
    import json
    import urllib.error
    import urllib.request

    from serve.http import HttpConfig, HttpServer

    http = HttpServer(server.state, HttpConfig(port=0), "base").start()
    try:
        body = json.dumps({"model": "counter", "messages": [{"role": "user", "content": "Hi"}]}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{http.port}/v1/chat/completions", body,
                                         {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        text = refused.value.read().decode()
        assert refused.value.code == 503 and "warming" in text, text
    finally:
        http.close()


def warm_engine(checkpoint, adapter) -> Engine:
    """Built in the engine process (module-level, so the spawned interpreter finds it)."""
    return Engine(checkpoint, EngineConfig(device="cpu", num_kv_blocks=256, max_batch_size=2, warm_up="on",
                                           adapters=(f"counter={adapter}",)))


def test_the_engine_process_tells_its_front_end_when_warm(tiny_zoo, adapter):
    from functools import partial

    from serve.rpc import EngineProcess

    loop = EngineProcess(partial(warm_engine, str(tiny_zoo[NAME]), str(adapter))).start()
    told = []
    loop.when_warm(told.append)
    server = RpcServer(loop, TOKEN, "127.0.0.1", 0).start()
    try:
        with Client("127.0.0.1", server.port, TOKEN) as client:
            ready = client.wait_ready(timeout_s=120)
            assert ready["state"] == "ready" and ready["warm_up_s"] > 0
            assert told and told[0]["requests"] == 6  # waves of 1 and 2, mixed and one-adapter
            clip = np.zeros((2, 56, 56, 3), dtype=np.uint8)
            final = client.submit_video("How many?", clip, adapter="counter", output_mode="head").result(120)
            assert "count" in final["head"]
    finally:
        server.close()


def test_an_engine_that_decodes_jpeg_on_its_device_warms_up_on_jpeg_frames(tiny_zoo):
    from serve.engine.warmup import _picture

    rng = np.random.default_rng(0)
    host = Engine(tiny_zoo[NAME], EngineConfig(device="cpu", num_kv_blocks=64, max_batch_size=2, adapter_slots=0))
    device = Engine(tiny_zoo[NAME], EngineConfig(device="cpu", num_kv_blocks=64, max_batch_size=2, adapter_slots=0,
                                                  pixels="device", warm_up="on"))
    assert isinstance(_picture(host, rng, 56, 2)["video"], np.ndarray)
    frames = _picture(device, rng, 56, 2)["video"]
    assert len(frames) == 2 and all(isinstance(f, bytes) and f[:2] == b"\xff\xd8" for f in frames)  # JPEG
    report = device.warm_up(side=56, frames=2)
    assert report.requests == 3 and device.runner.counters["items_encoded"] >= 3 and not device.has_unfinished()


def test_the_warm_up_steps_share_tokens_between_requests_as_live_cameras_do(tiny_zoo):
    """Each made-up request is its own tenant, so a step's tokens are shared out between them as between
    live tenants: with prompts longer than a step, steps carry several partial prompts (one tenant
    would prefill one prompt at a time)."""
    engine = Engine(tiny_zoo[NAME], EngineConfig(device="cpu", num_kv_blocks=128, max_batch_size=4, adapter_slots=0,
                                                 max_tokens_per_step=32, chunked_prefill=True, warm_up="on"))
    engine.warm_up(side=112, frames=2)
    full = [seqs for seqs, tokens, _, _ in engine.step_log if tokens == 32]  # prefill steps of the whole budget
    # the wave of 4 shares every full step four ways (one tenant: 1, 2, 3, then 4 as prompts finish)
    assert full[-4:] == [4, 4, 4, 4], full


def test_the_heap_is_settled_after_a_gpu_warm_up():
    """What a GPU warm-up does last (a CPU one skips it): collect, then freeze the survivors, so that no
    later collection walks the compilers' objects during serving."""
    import gc

    from serve.engine.warmup import WarmReport, _settle_heap

    report = WarmReport()
    try:
        _settle_heap(report)
        assert gc.get_freeze_count() > 0 and report.heap_objects > 0 and report.phases["heap"] >= 0
    finally:
        gc.unfreeze()


def test_the_warm_up_takes_its_picture_shape_from_the_config(tiny_zoo, monkeypatch):
    """engine.warm_up_side / warm_up_frames: a server whose cameras send other chunks than 448-pixel
    6-frame ones warms up on theirs, also when the engine loop's thread starts the warm-up."""
    import serve.engine.warmup as warmup

    seen = []
    monkeypatch.setattr(warmup, "warm_up", lambda engine, **shape: seen.append(shape) or warmup.WarmReport())
    config = dict(device="cpu", num_kv_blocks=64, max_batch_size=2, adapter_slots=0, warm_up="on")
    Engine(tiny_zoo[NAME], EngineConfig(**config, warm_up_side=84, warm_up_frames=4)).warm_up()
    Engine(tiny_zoo[NAME], EngineConfig(**config, warm_up_side=84)).warm_up(frames=2)  # a caller's shape wins
    Engine(tiny_zoo[NAME], EngineConfig(**config)).warm_up()
    assert seen == [{"side": 84, "frames": 4, "sizes": ()}, {"side": 84, "frames": 2, "sizes": ()},
                    {"side": 448, "frames": 6, "sizes": ()}]
    with pytest.raises(ValueError, match="warm_up_side"):
        EngineConfig(warm_up_side=14)


def test_a_server_with_no_adapter_folds_a_made_up_one_in_and_out_before_ready(tiny_zoo):
    """Tenants load adapters at run time: with none at start, the one-adapter waves run a made-up adapter
    (zero B) that the policy folds in, so the first real fold compiles nothing; it is gone afterwards and
    the base model's answers are unchanged to the bit."""
    from serve.engine.warmup import MADE_UP_ADAPTER

    def engine(warm_up):
        return Engine(tiny_zoo[NAME], EngineConfig(device="cpu", num_kv_blocks=256, max_batch_size=4,
                                                   warm_up=warm_up, policy="v_lora", policy_params={}))

    clip = np.random.default_rng(7).integers(0, 256, (4, 56, 56, 3), dtype=np.uint8)
    ask = [Request(prompt="How many cars?", video=clip, sampling=SamplingParams(max_tokens=5))]
    cold = engine("off")
    want = cold.generate(ask)[0]
    warm = engine("on")
    weights = {n: p.detach().clone() for n, p in warm.model.language_model.named_parameters()}
    loaded = []
    load = warm.lora.load_made_up
    warm.lora.load_made_up = lambda *a, **k: loaded.append(a[0]) or load(*a, **k)
    report = warm.warm_up()
    assert loaded == [MADE_UP_ADAPTER] and "one-adapter waves" in report.phases
    assert warm.lora.switch_times_ms, "the policy never folded the made-up adapter in"
    assert warm.list_adapters() == [] and warm.lora.merged is None and warm.mode.kind == "unmerge"
    for n, p in warm.model.language_model.named_parameters():
        assert torch.equal(p, weights[n]), n
    got = warm.generate(ask)[0]
    assert got.token_ids == want.token_ids


def test_a_server_with_an_adapter_or_no_policy_makes_none_up(tiny_zoo, adapter):
    from serve.engine.warmup import may_merge

    fcfs = Engine(tiny_zoo[NAME], EngineConfig(device="cpu", num_kv_blocks=256, max_batch_size=4, warm_up="on"))
    assert not may_merge(fcfs)
    fcfs.lora.load_made_up = None  # would raise if called
    assert "one-adapter waves" not in fcfs.warm_up().phases
    with_adapter = _engine(tiny_zoo, adapter)
    with_adapter.lora.load_made_up = None
    with_adapter.warm_up()
    assert [a["name"] for a in with_adapter.list_adapters()] == ["counter"]


def test_the_decode_sizes_run_once_without_graphs_and_the_graphs_come_back(tiny_zoo):
    """Decode steps no graph takes (a context past the graphs' blocks) launch their own kernels: the warm-up
    runs each decode size once with the graphs set aside. On the CPU there are no graphs: a stand-in
    that takes no step shows the phase runs and puts them back."""

    class NoGraphs:
        calls = 0

        def can_run(self, inputs):
            NoGraphs.calls += 1
            return False

    engine = Engine(tiny_zoo[NAME], EngineConfig(device="cpu", num_kv_blocks=256, max_batch_size=4, warm_up="on"))
    stand_in = engine.runner.graphs = NoGraphs()
    eager = engine.runner.counters["eager_steps"]
    report = engine.warm_up()
    assert "eager decode" in report.phases and engine.runner.graphs is stand_in
    sizes = wave_sizes(4)
    assert report.requests >= 2 * sum(sizes) and engine.runner.counters["eager_steps"] - eager > NoGraphs.calls
    assert not engine.has_unfinished()
