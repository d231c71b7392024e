"""bench.binary_misses: the geometry it reports per item (the class's largest instance, and how
much of it other objects overlap)."""

from __future__ import annotations

import pytest

from bench.binary_misses import _covered, item_view, threshold_accuracies
from world.scene import ImageTruth, ObjectTruth


def _truth(*objects):
    objs = [ObjectTruth(i, cls, "red", box) for i, (cls, box) in enumerate(objects)]
    return ImageTruth(0, 0, 64, 64, objs, {})


def test_overlap_counts_each_covered_pixel_once_and_ignores_boxes_beside():
    box = (10, 10, 20, 20)
    assert _covered(box, []) == 0.0
    assert _covered(box, [(0, 0, 10, 64), (20, 0, 64, 64), (0, 20, 64, 64)]) == 0.0  # touching, not over
    assert _covered(box, [(15, 0, 64, 64)]) == pytest.approx(0.5)
    assert _covered(box, [(15, 0, 64, 64), (15, 10, 20, 20)]) == pytest.approx(0.5)  # the same half twice
    assert _covered(box, [(0, 0, 64, 15), (0, 15, 15, 64)]) == pytest.approx(0.75)
    assert _covered((5, 5, 5, 9), [(0, 0, 64, 64)]) == 0.0  # an empty box


def test_item_view_takes_the_largest_instance_and_only_other_objects_cover_it():
    truth = _truth(("bus", (0, 0, 10, 10)), ("bus", (20, 20, 40, 30)), ("truck", (30, 20, 64, 64)),
                   ("car", (0, 0, 8, 8)))
    assert item_view(truth, "bus") == (200, pytest.approx(0.5))  # the truck covers half the big bus
    assert item_view(truth, "person") == (0, 0.0)
    assert item_view(_truth(("car", (0, 0, 4, 4))), "car") == (16, 0.0)


def test_threshold_accuracies_calibrate_on_train_and_bound_with_eval():
    # train: yes above 1.0; eval: yes above -1.0 (a shifted score), so the train threshold
    # transfers badly and only the eval split's own threshold is perfect
    train_scores, train_labels = [-2.0, 0.5, 0.8, 1.5, 2.0], [0, 0, 0, 1, 1]
    eval_scores, eval_labels = [-2.0, -0.5, 0.5, 1.5], [0, 1, 1, 1]
    r = threshold_accuracies(train_scores, train_labels, eval_scores, eval_labels)
    assert r["train_at_0"] == pytest.approx(0.6) and r["eval_at_0"] == pytest.approx(0.75)
    assert r["train_threshold"] == 0.8 and r["train_at_train_threshold"] == 1.0
    assert r["eval_at_train_threshold"] == pytest.approx(0.5)
    assert r["eval_threshold"] == -2.0 and r["eval_at_eval_threshold"] == 1.0
