"""Tests of the synthetic world: determinism, ground truth, QA, video and on-disk worlds."""
import json
import re
import time

import numpy as np
import pytest

import world.io as wio
from world import (DIRECTIONS, ClipTruth, ImageTruth, QAPair, WorldConfig, caption, draw_truth,
                         load_world, qa_pairs, read_video, referring_expressions, render_clip,
                         render_image, truth_from_dict, write_video, write_world)
from world.config import IMAGE_KIND, item_rng
from world.qa import PLURALS
from world.render import render_background
from world.scene import sample_scene

CFG = WorldConfig()
SINGULAR = {v: k for k, v in PLURALS.items()}


def _centre(box):
    return (box[0] + box[2]) / 2, (box[1] + box[3]) / 2


def test_render_is_deterministic_and_seeded():
    a, ta = render_image(CFG, 5)
    b, tb = render_image(CFG, 5)
    assert a.shape == (CFG.height, CFG.width, 3) and a.dtype == np.uint8
    assert a.tobytes() == b.tobytes() and ta.to_dict() == tb.to_dict()
    c, _ = render_image(WorldConfig(seed=1), 5)
    assert c.tobytes() != a.tobytes()
    assert render_image(CFG, 6)[0].tobytes() != a.tobytes()
    f1, t1 = render_clip(CFG, 2)
    f2, t2 = render_clip(CFG, 2)
    assert len(f1) == CFG.clip_frames
    assert all(x.tobytes() == y.tobytes() for x, y in zip(f1, f2)) and t1.to_dict() == t2.to_dict()
    assert render_clip(WorldConfig(seed=3), 2)[0][0].tobytes() != f1[0].tobytes()


def test_boxes_are_tight_and_inside_the_frame():
    cfg = WorldConfig(noise=0.0)
    seen = 0
    for i in range(12):
        frame, truth = render_image(cfg, i)
        # replay the renderer's steps without objects: every changed pixel must lie in some box
        rng = item_rng(cfg, IMAGE_KIND, i)
        bg = render_background(cfg, sample_scene(cfg, rng, 1).layout, rng)
        changed = np.abs(frame.astype(int) - bg).max(axis=2) > 8
        covered = np.zeros_like(changed)
        for o in truth.objects:
            x1, y1, x2, y2 = o.box
            assert 0 <= x1 < x2 <= cfg.width and 0 <= y1 < y2 <= cfg.height
            covered[y1:y2, x1:x2] = True
        assert not (changed & ~covered).any()
        for o in truth.objects:  # the drawn object reaches (nearly) every side of its box
            x1, y1, x2, y2 = o.box
            ys, xs = np.nonzero(changed[y1:y2, x1:x2])
            assert xs.min() <= 2 and ys.min() <= 2
            assert xs.max() >= x2 - x1 - 3 and ys.max() >= y2 - y1 - 3
        assert list(truth.counts) == list(cfg.classes)
        assert truth.counts == {c: sum(o.cls == c for o in truth.objects) for c in cfg.classes}
        assert len(truth.objects) <= cfg.max_objects
        seen += len(truth.objects)
    assert seen > 0


def test_clip_truth_counts_middle_frame():
    for i in range(3):
        _, t = render_clip(CFG, i)
        assert [f.frame for f in t.frames] == list(range(CFG.clip_frames))
        mid = t.frames[CFG.clip_frames // 2].objects
        assert t.objects == mid
        assert t.counts == {c: len({o.track_id for o in mid if o.cls == c}) for c in CFG.classes}
        assert set(t.directions) == {o.track_id for f in t.frames for o in f.objects}


def test_direction_matches_box_displacement():
    kinds = set()
    for i in range(8):
        _, t = render_clip(CFG, i)
        first = {o.track_id: o for o in t.frames[0].objects}
        last = {o.track_id: o for o in t.frames[-1].objects}
        for tid, d in t.directions.items():
            assert d in DIRECTIONS
            kinds.add(d)
            (ax, ay), (bx, by) = _centre(first[tid].box), _centre(last[tid].box)
            dx, dy = bx - ax, by - ay
            if d == "stationary":
                assert dx == 0 and dy == 0
                continue
            expect = {"left": -dx, "right": dx, "up": -dy, "down": dy}[d]
            other = abs(dy) if d in ("left", "right") else abs(dx)
            assert expect >= 2 and expect > other, (i, tid, d, dx, dy)
    assert len(kinds) >= 4  # the generator really produces varied motion


def test_video_round_trip(tmp_path):
    frames, _ = render_clip(CFG, 1)
    path = write_video(tmp_path / "clip.mp4", frames, CFG.fps)
    assert path.exists() and path.suffix in (".mp4", ".avi")
    back = read_video(path)
    assert len(back) == CFG.clip_frames
    assert all(f.shape == (CFG.height, CFG.width, 3) for f in back)
    err = np.mean([np.abs(a.astype(int) - b).mean() for a, b in zip(back, frames)])
    other = render_clip(CFG, 2)[0]
    err_other = np.mean([np.abs(a.astype(int) - b).mean() for a, b in zip(back, other)])
    assert err < 8 and err < err_other / 2


def test_video_fallback_and_errors(tmp_path, monkeypatch):
    frames = render_clip(WorldConfig(clip_frames=4), 0)[0]
    monkeypatch.setattr(wio, "CODECS", ((".mp4", "ZZZZ"), (".avi", "MJPG")))
    path = write_video(tmp_path / "x.mp4", frames, 30)
    assert path.suffix == ".avi" and len(read_video(path)) == 4
    monkeypatch.setattr(wio, "CODECS", ((".mp4", "ZZZZ"),))
    with pytest.raises(RuntimeError, match="y.mp4"):
        write_video(tmp_path / "y.mp4", frames, 30)
    with pytest.raises(ValueError, match="even"):
        write_video(tmp_path / "odd.mp4", [f[:, :-1] for f in frames], 30)
    with pytest.raises(FileNotFoundError, match="missing.mp4"):
        read_video(tmp_path / "missing.mp4")
    (tmp_path / "junk.mp4").write_bytes(b"not a video")
    with pytest.raises(IOError, match="junk.mp4"):
        read_video(tmp_path / "junk.mp4")


def test_truth_json_round_trip():
    _, it = render_image(CFG, 0)
    _, ct = render_clip(CFG, 1)
    for t in (it, ct):
        back = truth_from_dict(json.loads(json.dumps(t.to_dict())))
        assert type(back) is type(t) and back == t
    assert isinstance(truth_from_dict(it.to_dict()), ImageTruth)
    assert isinstance(truth_from_dict(ct.to_dict()), ClipTruth)
    assert WorldConfig.from_dict(json.loads(json.dumps(CFG.to_dict()))) == CFG
    pairs = qa_pairs(ct, 0)
    assert [QAPair.from_dict(json.loads(json.dumps(p.to_dict()))) for p in pairs] == pairs
    with pytest.raises(ValueError, match="kind"):
        truth_from_dict({"kind": "audio"})


def _check_qa(truth, pairs):
    objs = truth.objects
    for p in pairs:
        if p.kind == "count":
            cls = SINGULAR[re.match(r"How many (\w+) are there\?", p.question).group(1)]
            assert p.answer == str(sum(o.cls == cls for o in objs)) == str(truth.counts[cls])
        elif p.kind == "exists":
            color, cls = re.match(r"Is there an? (\w+) (\w+)\?", p.question).groups()
            assert p.answer == ("yes" if any((o.color, o.cls) == (color, cls) for o in objs) else "no")
        elif p.kind == "color":
            cls = re.match(r"What color is the (\w+)\?", p.question).group(1)
            (only,) = [o for o in objs if o.cls == cls]
            assert p.answer == only.color
        elif p.kind == "direction":
            color, cls = re.match(r"Which way is the (\w+) (\w+) moving\?", p.question).groups()
            (only,) = [o for o in objs if (o.color, o.cls) == (color, cls)]
            assert p.answer == truth.directions[only.track_id] and p.answer in DIRECTIONS
        else:
            raise AssertionError(p)


def test_qa_caption_and_references_agree_with_truth():
    kinds = set()
    for truth in [render_image(CFG, i)[1] for i in range(6)] + [render_clip(CFG, i)[1] for i in range(3)]:
        pairs = qa_pairs(truth, np.random.default_rng(7))
        assert pairs == qa_pairs(truth, np.random.default_rng(7))
        _check_qa(truth, pairs)
        kinds |= {p.kind for p in pairs}
        cap = caption(truth)
        said = {SINGULAR.get(w, w): int(n) for n, w in re.findall(r"(\d+) (\w+)", cap)}
        assert said == {c: n for c, n in truth.counts.items() if n > 0}
        for expr, box in referring_expressions(truth):
            words = expr.split()[1:]
            match = [o for o in truth.objects if [o.color, o.cls][-len(words):] == words]
            assert len(match) == 1 and match[0].box == box
    assert kinds == {"count", "exists", "color", "direction"}


def test_empty_scene_texts():
    cfg = WorldConfig(max_objects=0)
    _, t = render_image(cfg, 0)
    assert t.objects == [] and set(t.counts.values()) == {0}
    assert caption(t) == "An empty road."
    pairs = qa_pairs(t, 0)
    assert [p.kind for p in pairs].count("count") == 1 and pairs[0].answer == "0"
    assert all(p.answer in ("0", "no") for p in pairs) and referring_expressions(t) == []


def test_draw_truth_draws_on_a_copy():
    frame, t = render_image(CFG, 1)
    assert t.objects
    before = frame.copy()
    out = draw_truth(frame, t.objects)
    assert np.array_equal(frame, before) and not np.array_equal(out, frame)
    x1, y1, x2, y2 = t.objects[0].box
    assert not np.array_equal(out[y1:y2, x1], frame[y1:y2, x1])


def test_write_and_load_world(tmp_path, capsys):
    start = time.perf_counter()
    idx = write_world(CFG, tmp_path / "w", 8, 4, progress=True)
    assert time.perf_counter() - start < 5
    assert "12/12" in capsys.readouterr().err
    world = load_world(tmp_path / "w")
    assert world.config == CFG and len(world) == 12 and len(world.images) == 8
    assert [(it.kind, it.index, it.file) for it in world] == [(it.kind, it.index, it.file) for it in idx]
    img3 = world.images[3]
    frame, truth = render_image(CFG, 3)  # index 3 alone equals index 3 of the whole world
    assert img3.file == "images/image_00003.png"
    assert np.array_equal(img3.load(), frame) and img3.truth == truth
    assert img3.caption == caption(truth) and img3.qa
    clip = world.clips[2]
    assert clip.truth == render_clip(CFG, 2)[1] and len(clip.load()) == CFG.clip_frames
    meta = json.loads((tmp_path / "w" / "world.json").read_text())
    assert meta["counts"]["images"] == 8 and meta["counts"]["clips"] == 4
    write_world(CFG, tmp_path / "q", 1, 0, progress=False)
    assert capsys.readouterr().err == ""


def _snapshot(root):
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    keep = [f for f in files if not f.startswith("clips/")]  # mp4 bytes may carry encoder details
    return files, {f: (root / f).read_bytes() for f in keep}


class Interrupted(Exception):
    pass


def test_resume_matches_clean_run(tmp_path, monkeypatch):
    cfg = WorldConfig(clip_frames=6)
    write_world(cfg, tmp_path / "clean", 6, 2, progress=False)
    part = tmp_path / "part"
    write_world(cfg, part, 3, 1, progress=False)  # a smaller earlier run
    (part / "images" / "image_00001.png").unlink()
    real, calls, stop = wio._render_item, [], [True]

    def flaky(cfg_, root, kind, index):
        calls.append((kind, index))
        if stop[0] and len(calls) == 3:
            raise Interrupted  # the second run stops part-way
        return real(cfg_, root, kind, index)

    monkeypatch.setattr(wio, "_render_item", flaky)
    with pytest.raises(Interrupted):
        write_world(cfg, part, 6, 2, progress=False)
    with pytest.raises(ValueError, match="unfinished"):
        load_world(part)
    with open(part / "truth.partial.jsonl", "a") as f:
        f.write('{"kind": "image", "ind')  # a record cut short
    calls.clear()
    stop[0] = False
    write_world(cfg, part, 6, 2, progress=False)
    assert calls == [("image", 4), ("image", 5), ("clip", 1)]  # only what was still missing
    assert _snapshot(part) == _snapshot(tmp_path / "clean")
    assert [it.truth for it in load_world(part)] == [it.truth for it in load_world(tmp_path / "clean")]


def test_resume_refuses_other_config(tmp_path):
    write_world(CFG, tmp_path, 1, 0, progress=False)
    with pytest.raises(ValueError, match="seed"):
        write_world(WorldConfig(seed=9), tmp_path, 1, 0, progress=False)
    with pytest.raises(FileNotFoundError, match="world.json"):
        load_world(tmp_path / "nothing")


@pytest.mark.parametrize("kwargs, field", [
    ({"classes": ("car", "plane")}, "classes"), ({"classes": ()}, "classes"),
    ({"colors": ("red", "grey")}, "colors"), ({"width": 0}, "width"), ({"width": 225}, "width"),
    ({"height": -5}, "height"),
    ({"fps": 0}, "fps"), ({"clip_frames": 1}, "clip_frames"), ({"max_objects": -1}, "max_objects"),
    ({"noise": -1.0}, "noise"), ({"stationary_prob": 2.0}, "stationary_prob"), ({"seed": 1.5}, "seed"),
])
def test_config_validation_names_the_field(kwargs, field):
    with pytest.raises((ValueError, TypeError), match=field):
        WorldConfig(**kwargs)


def test_config_error_lists_valid_names():
    with pytest.raises(ValueError, match="plane") as e:
        WorldConfig(classes=("plane",))
    assert "bicycle" in str(e.value)


def test_rendering_in_worker_processes_writes_the_same_world(tmp_path):
    cfg = WorldConfig(clip_frames=6)
    write_world(cfg, tmp_path / "one", 6, 2, progress=False)
    write_world(cfg, tmp_path / "part", 2, 0, progress=False)  # some items kept, the rest rendered by workers
    index = write_world(cfg, tmp_path / "part", 6, 2, progress=False, workers=2)
    assert _snapshot(tmp_path / "part") == _snapshot(tmp_path / "one")
    assert [it.truth for it in index] == [it.truth for it in load_world(tmp_path / "one")]
    with pytest.raises(ValueError, match="workers must be a non-negative int"):
        write_world(cfg, tmp_path / "bad", 1, 0, progress=False, workers=-1)
