"""Sources (video files through OpenCV, the live-URL path, the synthetic camera), sampling,
resizing and chunking, with real video files written and read by OpenCV."""

from __future__ import annotations

import time

import numpy as np
import pytest
from apps_server import WORLD, http_server

from apps.video_analytics import (CaptureSource, ChunkConfig, Chunker, Frame, Pacer, SourceError, SyntheticCamera,
                                  open_source, source_kind)
from world import WorldConfig, render_clip, write_video


@pytest.fixture(scope="module")
def clip_file(tmp_path_factory):
    frames, truth = render_clip(WorldConfig(seed=2, **WORLD), 0)
    path = write_video(tmp_path_factory.mktemp("video") / "clip.mp4", frames, WORLD["fps"])
    return path, frames


def _drain(source) -> list[Frame]:
    out = []
    while (frame := source.read()) is not None:
        out.append(frame)
    return out


def test_file_source_reads_every_frame_then_ends_and_loops(clip_file):
    path, frames = clip_file
    source = open_source(str(path))
    assert isinstance(source, CaptureSource) and not source.live
    source.open()
    got = _drain(source)
    assert len(got) == len(frames) and source.fps == WORLD["fps"]
    assert [f.index for f in got] == list(range(len(frames)))
    assert got[3].timestamp == pytest.approx(3 / WORLD["fps"])
    for f, original in zip(got, frames):
        assert f.image.shape == original.shape and f.image.dtype == np.uint8
        assert np.abs(f.image.astype(int) - original).mean() < 12, "a lossy codec, but the same picture"
    source.close()

    looping = open_source(str(path), loop=True)
    looping.open()
    assert len([looping.read() for _ in range(2 * len(frames) + 3)]) == 2 * len(frames) + 3
    looping.close()


def test_live_source_breaks_at_the_end_and_reopens_and_a_missing_one_fails_to_open(clip_file, tmp_path):
    path, frames = clip_file
    live = open_source(str(path), kind="url")  # a file through the URL / camera code path
    assert live.live
    live.open()
    assert len([live.read() for _ in frames]) == len(frames)
    with pytest.raises(SourceError, match="stopped delivering"):
        live.read()
    live.open()  # reconnect
    assert live.read().index == 0
    live.close()
    with pytest.raises(SourceError, match="does not exist"):
        open_source(str(tmp_path / "gone.mp4")).open()


def test_http_url_source_reads_a_stream_served_over_http(clip_file):
    path, frames = clip_file
    with http_server(path.parent) as server:
        url = f"http://127.0.0.1:{server.server_address[1]}/{path.name}"
        source = open_source(url)
        assert source_kind(url) == "url" and source.live
        source.open()
        got = [source.read() for _ in frames]
        assert all(f.image.shape == frames[0].shape for f in got)
        with pytest.raises(SourceError):
            source.read()
        source.close()


def test_source_strings_name_their_kind():
    assert source_kind("synthetic:3") == "synthetic"
    assert source_kind("0") == source_kind(1) == "webcam"
    assert source_kind("rtsp://cam.local/stream") == source_kind("HTTP://x/y.mjpg") == "url"
    assert source_kind("videos/a.mp4") == "file"
    cam = open_source("synthetic:7:2", world=WORLD)
    assert isinstance(cam, SyntheticCamera) and cam.world.seed == 7 and cam.start == 2
    with pytest.raises(ValueError, match="synthetic:<seed>"):
        open_source("synthetic:x")
    with pytest.raises(ValueError, match="source kind"):
        open_source("a.mp4", kind="ftp")


def test_synthetic_camera_plays_the_world_clips_back_to_back_with_their_truth():
    world = WorldConfig(seed=4, **WORLD)
    cam = SyntheticCamera(world, start=1, n_clips=2)
    cam.open()
    got = _drain(cam)
    n = WORLD["clip_frames"]
    assert len(got) == 2 * n
    for clip in (1, 2):
        frames, truth = render_clip(world, clip)
        for t in range(n):
            f = got[(clip - 1) * n + t]
            assert np.array_equal(f.image, frames[t]), "the pixels of render_clip, unchanged"
            assert f.truth.clip.index == clip and f.truth.frame == t
            assert f.truth.clip.frames[t].objects == truth.frames[t].objects
    assert [f.timestamp for f in got[:3]] == pytest.approx([0, 0.1, 0.2])


def _frames(n: int, fps: float, size=(40, 30)) -> list[Frame]:
    rng = np.random.default_rng(0)
    return [Frame(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8), i, i / fps) for i in range(n)]


def _chunks(config: ChunkConfig, frames: list[Frame], fps: float):
    chunker = Chunker("s", config, fps)
    chunks = [c for f in frames if (c := chunker.push(f)) is not None]
    return chunker, chunks


def test_chunking_defaults_to_one_second_of_thirty_frames():
    chunker, chunks = _chunks(ChunkConfig(), _frames(95, 30), 30)
    assert chunker.frames_per_chunk == 30 and len(chunks) == 3
    assert [c.frame_indices[0] for c in chunks] == [0, 30, 60]
    assert chunks[1].t_start == pytest.approx(1.0) and chunks[1].t_end == pytest.approx(59 / 30)
    # frames 90-94 make no whole chunk: left out, as distillation leaves them out
    assert chunker.finish() == 5 and chunker.finish() == 0


@pytest.mark.parametrize("fps,sample_fps,kept", [(30, 15, [0, 2, 4, 6]), (30, 4, [0, 7, 15, 22]),
                                                 (25, 5, [0, 5, 10, 15]), (10, 30, [0, 1, 2, 3])])
def test_sampling_follows_source_time(fps, sample_fps, kept):
    chunker, chunks = _chunks(ChunkConfig(sample_fps=sample_fps, chunk_seconds=1.0), _frames(3 * fps, fps), fps)
    assert chunks[0].frame_indices[:4] == kept
    assert chunker.frames_per_chunk == min(sample_fps, fps) and len(chunks) == 3


def test_chunks_are_resized_and_carry_their_middle_frames_truth():
    cam = SyntheticCamera(WorldConfig(seed=5, **WORLD), n_clips=1)
    cam.open()
    config = ChunkConfig(sample_fps=5, chunk_frames=2, width=48, height=40)
    chunker, chunks = _chunks(config, _drain(cam), cam.fps)
    assert [c.frame_indices for c in chunks] == [[0, 2], [4, 6]] and chunker.finish() == 1  # frame 8: no whole chunk
    for c in chunks:
        assert c.size == (48, 40) and c.source_size == (64, 64)
        assert all(f.shape == (40, 48, 3) for f in c.frames)
        assert c.truth.frame == c.frame_indices[1], "the middle of two sampled frames is the second"
        rgb = c.rgb()[0]
        assert np.array_equal(rgb, c.frames[0][:, :, ::-1])
    assert chunker.reset() == 0


def test_chunk_config_and_pacer_check_their_input_and_pace_in_real_time():
    with pytest.raises(ValueError, match="sample_fps"):
        ChunkConfig(sample_fps=0)
    with pytest.raises(ValueError, match="both width and height"):
        ChunkConfig(width=64)
    with pytest.raises(ValueError, match="chunk_frames"):
        ChunkConfig(chunk_frames=0)
    pacer = Pacer(50)
    start = time.perf_counter()
    for _ in range(11):
        pacer.wait()
    assert time.perf_counter() - start >= 0.19, "frame 10 is due 0.2 s after frame 0"
