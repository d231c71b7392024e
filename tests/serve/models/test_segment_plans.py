"""The towers' batched-attention shapes: what the warm-up records and sweeps is what live steps look up."""

from __future__ import annotations

import threading

import numpy as np
import torch
from serve_cases import hf_model

from serve.forward import segment_plans
from serve.models.qwen_vision import QwenVisionTower


def _on_fresh_thread(fn):
    """fn() on a new thread (its own record, as the serving thread has); returns its result."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
            box["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _tower(tiny_zoo, name):
    hf, _ = hf_model(str(tiny_zoo[name]))
    arch = "qwen2_vl" if name == "qwen2_vl_tiny" else "qwen2_5_vl"
    tower = QwenVisionTower(hf.config.vision_config, arch)
    tower.load_state_dict(hf.model.visual.state_dict())
    return tower


def _pixels(tower, grids, seed=0):
    width = tower.patch_embed.proj.weight[0].numel()
    rows = sum(t * h * w for t, h, w in grids)
    return torch.tensor(np.random.default_rng(seed).standard_normal((rows, width)), dtype=torch.float32)


def _recorded(tower, grids_list, sweep: bool):
    """The shapes known after recording the tower's calls on each grid list (then sweeping, or not)."""
    segment_plans.forget()
    with torch.no_grad(), segment_plans.recording():
        for grids in grids_list:
            tower(_pixels(tower, grids), tower.layout(grids))
    built = segment_plans.sweep() if sweep else 0
    return set(segment_plans._state()["known"]), built


def test_sweep_builds_every_count_a_live_call_meets(tiny_zoo):
    """Qwen2.5-VL: frame groups (full-attention layers) and windows (the others) of one picture size.
    The warm-up runs 1 and 4 pictures; a live call of 2 or 3 meets shapes the sweep has built, with the
    live call's own strides."""
    tower = _tower(tiny_zoo, "qwen2_5_vl_tiny")
    grid = (1, 8, 8)  # 4 x 4 merge units, windows of 2 x 2: 4 windows of 16 rows each per picture
    known, built = _on_fresh_thread(lambda: _recorded(tower, [[grid], [grid] * 4], sweep=True))
    for n in (2, 3):
        live, _ = _on_fresh_thread(lambda n=n: _recorded(tower, [[grid] * n], sweep=False))
        assert live and live <= known, f"{n} pictures: {sorted(k[:2] for k in live - known)} not swept"
    counts = sorted({key[:2] for key in known})
    # frames: 1..4 of 64 rows; windows: 4, 8, 12, 16 of 16 rows (a picture's windows come together)
    assert counts == [(1, 64), (2, 64), (3, 64), (4, 16), (4, 64), (8, 16), (12, 16), (16, 16)]
    assert built == 4  # 2 and 3 frames, 8 and 12 windows: the recorded ones are not built again


def test_record_is_per_thread_and_off_outside_recording(tiny_zoo):
    tower = _tower(tiny_zoo, "qwen2_vl_tiny")
    grid = [(2, 4, 4)]
    known, _ = _on_fresh_thread(lambda: _recorded(tower, [grid], sweep=False))
    assert {key[:2] for key in known} == {(2, 16)}  # one clip of two frame groups, 16 rows each
    # another thread has recorded nothing, and a call outside recording records nothing
    segment_plans.forget()
    with torch.no_grad():
        tower(_pixels(tower, grid), tower.layout(grid))
    assert not segment_plans._state()["known"] and not segment_plans.is_recording()
    assert not segment_plans.known(next(iter(known)))


def test_sweep_caps_its_builds():
    segment_plans.forget()
    q = torch.zeros(6 * 8, 2, 4)
    with segment_plans.recording():
        for count in (1, 6):
            rows = q[: count * 8]
            assert segment_plans.known(segment_plans.shape_key(rows, rows, rows, 8, count))
    assert segment_plans.sweep(max_builds=3) == 3  # of counts 2..5
    assert {k[0] for k in segment_plans._state()["known"]} == {1, 2, 3, 4, 6}
    assert segment_plans.sweep() == 1
    segment_plans.forget()


def test_a_live_call_at_an_unwarmed_length_is_counted_and_said_once(caplog):
    """After a warm-up, a count it did not plan is merely unplanned; a segment length it never met is a
    picture size it never ran, which the log names once (with the setting that fixes it)."""
    segment_plans.forget()
    q = torch.zeros(4 * 24, 2, 4)

    def key(length, count):
        rows = q[: length * count]
        return segment_plans.shape_key(rows, rows, rows, length, count)

    assert not segment_plans.known(key(8, 1))  # before any warm-up: unplanned, nothing to say
    with segment_plans.recording():
        segment_plans.known(key(8, 1))
    with caplog.at_level("WARNING", logger="vlora.serve.forward"):
        assert segment_plans.known(key(8, 1)) and not segment_plans.known(key(8, 3))
        assert not caplog.records  # a count the sweep would make, not a new picture size
        for _ in range(3):
            assert not segment_plans.known(key(24, 2))
    assert len(caplog.records) == 1 and "24 rows" in caplog.text and "warm_up_sizes" in caplog.text
    assert segment_plans.stats() == {"plans": 1, "planned_calls": 1, "unplanned_calls": 5, "unwarmed_lengths": [24]}
    segment_plans.forget()
