"""The HTTP API of a real `vlora serve http.port=0`, through the official `openai` package unmodified:
chat with images, video frames and files, streaming, n, stop, model=<adapter>, the task-head
extension, the models a key may use, health and metrics, the docs' curl examples as written, and 64
concurrent clients without an error. The same requests over RPyC give the same tokens."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest
from rpc_server import ServerProcess

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from serve.rpc import Client, add_tenant  # noqa: E402

NAME = "qwen2_vl_tiny"
DOCS = Path(__file__).resolve().parents[3] / "docs" / "http.md"
SAMPLING = {"max_tokens": 6, "ignore_eos": True}


def _png(seed: int, h: int = 48, w: int = 64) -> tuple[np.ndarray, bytes]:
    import cv2

    image = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    return image, cv2.imencode(".png", image[:, :, ::-1])[1].tobytes()


def _url(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


@pytest.fixture(scope="module")
def setup(tiny_zoo, vlora_home, tmp_path_factory):
    from adapter_cases import make_adapter, make_head, write_meta

    from zoo import load_pretrained

    model = load_pretrained(tiny_zoo[NAME])[0]
    shared = make_adapter(model, tmp_path_factory.mktemp("shared") / "shared", ["q_proj", "v_proj"], 8, 16, seed=3)
    make_head(shared / "heads" / "vehicles", "count", model.config.get_text_config().hidden_size, seed=1, pooling="mean")
    write_meta(shared, {"vehicles": "count"})
    root = tmp_path_factory.mktemp("adapter_root")
    make_adapter(model, root / "a" / "mine", ["v_proj"], 4, 8, seed=4)
    media = tmp_path_factory.mktemp("media")
    tenants = tmp_path_factory.mktemp("tenants") / "tenants.yaml"
    # ops' 64 concurrent clients below: each HTTP request in progress counts against its connections quota
    tokens = {who: add_tenant(tenants, who, role, quotas={"connections": 64} if who == "ops" else None)
              for who, role in (("ops", "operator"), ("a", "tenant"), ("b", "tenant"))}
    proc = ServerProcess(tiny_zoo[NAME], vlora_home, f"rpc.tenants={tenants}", f"rpc.adapter_root={root}",
                         "adapters.manifest=null", f"adapters.extra=['shared={shared}']", "http.port=0",
                         f"http.media_root={media}", "engine.max_batch_size=16")
    port = int(next(re.search(r"HTTP \(OpenAI API\) on http://127\.0\.0\.1:(\d+)/v1", line)[1]
                    for line in proc.lines if "HTTP (OpenAI API)" in line))
    with Client("127.0.0.1", proc.port, tokens["a"]) as a:
        a.load_adapter("mine", "mine")  # tenant a's own, loaded over RPyC: HTTP sees the same engine
    yield {"proc": proc, "port": port, "tokens": tokens, "media": media, "url": f"http://127.0.0.1:{port}"}
    proc.stop()


def _openai(setup, who: str = "ops"):
    return openai.OpenAI(base_url=setup["url"] + "/v1", api_key=setup["tokens"][who], max_retries=0, timeout=60)


def _user(*parts, text: str = "How many cars?") -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def test_chat_with_images_video_frames_and_adapters_gives_rpyc_tokens(setup):
    client = _openai(setup)
    (img0, png0), (img1, png1) = _png(0), _png(1)
    with Client("127.0.0.1", setup["proc"].port, setup["tokens"]["ops"]) as rpc:
        for model, adapter in ((NAME, None), ("shared", "shared")):
            reply = client.chat.completions.create(
                model=model, messages=_user({"type": "image_url", "image_url": {"url": _url(png0)}}),
                extra_body={"ignore_eos": True}, max_tokens=6)
            want = rpc.submit_image("How many cars?", [img0], adapter=adapter, sampling=SAMPLING).result(60)
            assert reply.choices[0].message.content == want["text"] and reply.usage.completion_tokens == 6
            assert reply.usage.prompt_tokens == want["timing"]["prompt_tokens"]
            assert reply.model_extra["vlora"]["timing"]["prefill_ms"] >= 0  # the server's timing, as RPyC's
        frames = {"type": "video", "video": [_url(png0), _url(_png(2)[1]), _url(png1), _url(png1)]}
        reply = client.chat.completions.create(model=NAME, messages=_user(frames, text="Which way?"), max_tokens=6,
                                               extra_body={"ignore_eos": True})
        clip = np.stack([img0, _png(2)[0], img1, img1])
        assert reply.choices[0].message.content == rpc.submit_video("Which way?", clip, sampling=SAMPLING).result(60)["text"]


def test_streaming_n_seed_and_stop(setup):
    client = _openai(setup)
    ask = dict(model=NAME, messages=[{"role": "user", "content": "Describe a road."}], max_tokens=8,
               extra_body={"ignore_eos": True})
    whole = client.chat.completions.create(**ask).choices[0].message.content
    chunks = list(client.chat.completions.create(**ask, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert chunks[-1].usage.completion_tokens == 8 and chunks[-2].choices[0].finish_reason == "length"
    stop = whole[2:4]
    cut = client.chat.completions.create(**ask, stop=[stop]).choices[0]
    assert cut.message.content == whole[:whole.index(stop)] and cut.finish_reason == "stop"
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(**ask, stop=stop, stream=True))
    assert streamed == whole[:whole.index(stop)]
    sampled = client.chat.completions.create(**dict(ask, max_tokens=6), n=3, seed=11, temperature=1.5)
    again = client.chat.completions.create(**dict(ask, max_tokens=6), n=3, seed=11, temperature=1.5)
    texts = [c.message.content for c in sampled.choices]
    assert texts == [c.message.content for c in again.choices] and len(set(texts)) > 1  # seed + i per choice
    text = client.completions.create(model=NAME, prompt="Describe a road.", max_tokens=8, extra_body={"ignore_eos": True})
    assert text.choices[0].text == whole  # the same prompt, through the same chat template


def test_head_extension_answers_beside_choices(setup):
    client = _openai(setup, "a")
    frames = {"type": "video", "video": [_url(_png(5)[1])] * 2}
    reply = client.chat.completions.create(model="shared", messages=_user(frames),
                                           extra_body={"vlora": {"output": "head", "task": "count"}})
    head = reply.model_extra["vlora"]["head"]
    with Client("127.0.0.1", setup["proc"].port, setup["tokens"]["a"]) as rpc:
        want = rpc.submit_video("How many cars?", np.stack([_png(5)[0]] * 2), adapter="shared", output_mode="head",
                                task="count").result(60)["head"]
    assert head == want and head["type"] == "count" and reply.choices[0].message.content == str(want["count"])
    streamed = list(client.chat.completions.create(model="shared", messages=_user(frames), stream=True,
                                                   extra_body={"vlora": {"output": "head", "task": "vehicles"}}))
    assert streamed[-1].model_extra["vlora"]["head"] == want
    with pytest.raises(openai.BadRequestError, match="no head for task"):
        client.chat.completions.create(model="shared", messages=_user(frames), extra_body={"vlora": {"output": "head",
                                                                                                    "task": "plates"}})


def test_each_key_sees_and_uses_its_own_adapters(setup):
    seen = {who: sorted(m.id for m in _openai(setup, who).models.list()) for who in ("ops", "a", "b")}
    assert seen == {"ops": sorted([NAME, "mine@a", "shared"]), "a": sorted([NAME, "mine", "shared"]),
                    "b": sorted([NAME, "shared"])}
    listed = {m.id: m for m in _openai(setup, "a").models.list()}
    assert listed["shared"].model_extra["vlora"]["heads"] == {"vehicles": "count"}
    assert _openai(setup, "a").models.retrieve("mine").owned_by == "a"
    with pytest.raises(openai.NotFoundError):
        _openai(setup, "b").models.retrieve("mine")
    assert _openai(setup, "a").chat.completions.create(model="mine", messages=_user(), max_tokens=2).choices
    with pytest.raises(openai.NotFoundError, match="no model 'mine'"):  # a's adapter is not b's
        _openai(setup, "b").chat.completions.create(model="mine", messages=_user(), max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=setup["url"] + "/v1", api_key="not-a-token-at-all", max_retries=0).models.list()


def test_files_under_the_media_root_only(setup, tmp_path):
    import cv2

    media, client = setup["media"], _openai(setup)
    image, png = _png(7)
    (media / "cam").mkdir(exist_ok=True)
    (media / "cam" / "1.png").write_bytes(png)
    writer = cv2.VideoWriter(str(media / "clip.avi"), cv2.VideoWriter_fourcc(*"MJPG"), 10, (64, 48))
    for i in range(12):
        writer.write(_png(10 + i)[0])
    writer.release()
    by_file = client.chat.completions.create(model=NAME, max_tokens=4, extra_body={"ignore_eos": True},
                                             messages=_user({"type": "image_url", "image_url": {"url": f"file://{media}/cam/1.png"}}))
    by_data = client.chat.completions.create(model=NAME, max_tokens=4, extra_body={"ignore_eos": True},
                                             messages=_user({"type": "image_url", "image_url": {"url": _url(png)}}))
    assert by_file.choices[0].message.content == by_data.choices[0].message.content
    video = client.chat.completions.create(model=NAME, max_tokens=2, messages=_user(
        {"type": "video_url", "video_url": {"url": "clip.avi"}}), extra_body={"vlora": {"video_frames": 4}})
    assert video.usage.prompt_tokens > by_file.usage.prompt_tokens
    (tmp_path / "secret.png").write_bytes(png)
    for url in (f"file://{tmp_path}/secret.png", "../secret.png", f"file://{tmp_path}/missing.png"):
        with pytest.raises(openai.PermissionDeniedError, match="only under the server's media root") as e:
            client.chat.completions.create(model=NAME, messages=_user({"type": "image_url", "image_url": {"url": url}}))
        assert str(tmp_path) not in str(e.value)


def test_health_and_metrics(setup):
    plain = httpx.get(setup["url"] + "/health")
    assert plain.status_code == 200 and plain.json() == {"healthy": True}
    full = httpx.get(setup["url"] + "/health", headers={"Authorization": f"Bearer {setup['tokens']['b']}"}).json()
    assert full["healthy"] and "in_flight" in full
    text = httpx.get(setup["url"] + "/metrics", headers={"Authorization": f"Bearer {setup['tokens']['b']}"}).text
    assert "vlora_engine_num_blocks" in text and re.search(r"vlora_server_http_chat_completions \d+", text)
    assert httpx.get(setup["url"] + "/metrics").status_code == 401


def test_the_docs_curl_examples_run_as_written(setup, tmp_path):
    (tmp_path / "frame.png").write_bytes(_png(3)[1])
    blocks = [b for b in re.findall(r"```bash\n(.*?)```", DOCS.read_text(), re.S) if "curl " in b and "vlora serve" not in b]
    assert len(blocks) == 4
    env = {"PATH": "/usr/bin:/bin", "VLORA_URL": setup["url"], "VLORA_TOKEN": setup["tokens"]["a"], "MODEL": NAME,
           "ADAPTER": "shared"}
    outputs = [subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=60) for block in blocks]
    assert all(o.returncode == 0 and o.stdout for o in outputs), [(o.returncode, o.stderr[-300:]) for o in outputs]
    assert json.loads(outputs[0].stdout)["object"] == "list"
    assert json.loads(outputs[1].stdout)["choices"][0]["message"]["content"] is not None
    assert json.loads(outputs[2].stdout)["vlora"]["head"]["type"] == "count"
    assert outputs[3].stdout.rstrip().endswith("data: [DONE]")


@pytest.mark.alone
def test_64_concurrent_clients_without_an_error(setup):
    async def one(i: int, http) -> int:
        body = {"model": NAME if i % 2 else "shared", "max_tokens": 2, "stream": bool(i % 3 == 0),
                "messages": [{"role": "user", "content": f"Client {i}: describe a road."}]}
        try:
            r = await http.post("/v1/chat/completions", json=body,
                                headers={"Authorization": f"Bearer {setup['tokens']['ops']}"})
            await r.aread()
        except httpx.TransportError as e:
            return repr(e)
        return r.status_code

    async def run() -> list[int]:
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
        async with httpx.AsyncClient(base_url=setup["url"], limits=limits, timeout=120) as http:
            return await asyncio.gather(*(one(i, http) for i in range(128)))

    statuses = asyncio.run(run())
    # a connection the door closed reads as an httpx error here: its counters say which deadline or bound did it
    metrics = httpx.get(setup["url"] + "/metrics", headers={"Authorization": f"Bearer {setup['tokens']['ops']}"}).text
    door = re.findall(r"vlora_server_http_door\w+ \d+", metrics)
    assert statuses == [200] * 128, (statuses, door)
    assert setup["proc"].alive()
