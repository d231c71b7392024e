"""Drop policies: the queue alone, then streams against a real server kept busy (long answers
on a CPU engine) while a camera delivers chunks faster than they are answered."""

from __future__ import annotations

import threading
import time

import pytest
from apps_server import MODEL, WORLD, connector, serving

from apps.video_analytics import BoundedQueue, Closed, JsonlSink, StreamManager, read_jsonl, stream_from_dict


def test_drop_oldest_keeps_the_newest_items_in_order():
    q = BoundedQueue(2, "drop_oldest")
    for i in range(5):
        assert q.put(i)
    assert q.stats.dropped == 3 and list(q.dropped_items) == [0, 1, 2]
    assert [q.get(0), q.get(0), q.get(0)] == [3, 4, None]
    assert q.stats.to_dict() == {"put": 5, "taken": 2, "dropped": 3, "high_water": 2}


def test_latest_frame_hands_out_the_newest_and_drops_the_rest():
    q = BoundedQueue(4, "latest_frame")
    for i in range(3):
        q.put(i)
    assert q.get(0) == 2 and q.stats.dropped == 2 and len(q) == 0
    for i in range(3, 9):  # overflow drops the oldest too
        q.put(i)
    assert q.get(0) == 8 and q.stats.dropped == 2 + 5 and q.stats.taken == 2


def test_block_waits_for_room_and_drops_only_on_timeout():
    q = BoundedQueue(1, "block")
    q.put("a")
    assert q.put("b", timeout=0.05) is False and q.stats.dropped == 1
    threading.Timer(0.1, q.get).start()
    start = time.monotonic()
    assert q.put("c", timeout=5) is True and time.monotonic() - start >= 0.05
    assert q.get(0) == "c" and q.stats.dropped == 1


def test_close_drains_then_ends_and_bad_settings_are_named():
    q = BoundedQueue(3, "drop_oldest")
    q.put(1)
    q.close()
    with pytest.raises(Closed):
        q.put(2)
    assert q.get(0.1) == 1 and q.get(0.1) is None and q.drained
    with pytest.raises(ValueError, match="drop_oldest"):
        BoundedQueue(2, "fifo")
    with pytest.raises(ValueError, match="capacity"):
        BoundedQueue(0)


@pytest.fixture(scope="module")
def server(tiny_zoo):
    with serving(tiny_zoo[MODEL]) as s:
        yield s


# Each chunk's answer is 64 forced tokens (a few hundred ms on CPU); the camera makes 10 one-frame
# chunks a second, so the server is overloaded several times over.
SLOW_TASK = {"task": "count", "max_tokens": 64, "sampling": {"ignore_eos": True}}


def _stream(name: str, policy: str, **extra) -> dict:
    return {"name": name, "source": f"synthetic:{len(name)}", "world": WORLD, "chunk_frames": 1, "width": 56,
            "height": 56, "backpressure": policy, "queue_size": 2, "max_chunks": 16, "encoding": "raw",
            "tasks": [SLOW_TASK], **extra}


def test_drop_policies_under_an_overloaded_server(server, tmp_path):
    with JsonlSink(tmp_path / "results.jsonl") as sink, StreamManager(connector(server), sink=sink) as manager:
        manager.add(stream_from_dict(_stream("oldest", "drop_oldest")))
        manager.add(stream_from_dict(_stream("latest", "latest_frame")))
        assert manager.wait(timeout=60)
        snaps = manager.snapshot()
    records = [r for r in read_jsonl(tmp_path / "results.jsonl") if r["type"] == "result"]
    for name, snap in snaps.items():
        assert snap["status"] == "finished"
        assert snap["chunks_made"] == 16 and snap["frames_in"] == 16
        assert snap["chunks_dropped"] > 0, f"{name}: an overloaded stream must drop"
        assert snap["chunks_made"] == snap["chunks_processed"] + snap["chunks_dropped"] + snap["chunks_failed"]
        assert snap["queue"]["high_water"] <= 2
        done = [r["chunk"] for r in records if r["stream"] == name]
        assert done == sorted(done) and len(done) == snap["chunks_processed"]
        assert done[-1] == 15, "the newest chunk is never the one dropped"
        assert snap["latency_ms"]["p50"] > 0 and snap["tasks"]["count"]["requests"] == len(done)
    # latest_frame skips everything older than the newest chunk, drop_oldest keeps up to two behind:
    # at most one chunk a service time gets through with latest_frame
    assert snaps["latest"]["queue_ms"]["p50"] <= snaps["oldest"]["queue_ms"]["p50"] + 50


def test_block_policy_on_an_offline_file_drops_nothing(server, tmp_path):
    from world import WorldConfig, render_clip, write_video

    frames, _ = render_clip(WorldConfig(seed=9, **WORLD), 0)
    path = write_video(tmp_path / "clip.mp4", frames, WORLD["fps"])
    config = _stream("file", "block", source=str(path), realtime=False, max_chunks=None, chunk_frames=2,
                     tasks=[{**SLOW_TASK, "max_tokens": 8}])
    with StreamManager(connector(server)) as manager:
        manager.add(stream_from_dict(config))
        assert manager.wait(timeout=60)
        snap = manager.snapshot()["file"]
    assert snap["status"] == "finished" and snap["frames_in"] == len(frames)
    assert snap["chunks_made"] == snap["chunks_processed"] == len(frames) // 2 and snap["chunks_dropped"] == 0
