"""Metrics, box geometry and the assignment solver on hand-computed cases."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from heads import (accuracy, box_iou, cxcywh_to_xyxy, detection_counts, exact_match, f1_at_iou,
                   generalized_iou, linear_sum_assignment, xyxy_to_cxcywh)


def test_box_iou_known_values():
    unit = (0.0, 0.0, 1.0, 1.0)
    assert box_iou(unit, unit).item() == pytest.approx(1.0)
    assert box_iou(unit, (0.5, 0.0, 1.0, 1.0)).item() == pytest.approx(0.5)  # half inside
    # Two 0.2 x 0.2 boxes overlapping in a 0.1 x 0.1 corner: 0.01 / (0.04 + 0.04 - 0.01).
    assert box_iou((0.0, 0.0, 0.2, 0.2), (0.1, 0.1, 0.3, 0.3)).item() == pytest.approx(1 / 7)
    assert box_iou((0.0, 0.0, 0.1, 0.1), (0.5, 0.5, 0.6, 0.6)).item() == 0.0
    matrix = box_iou([unit, (0.0, 0.0, 0.5, 0.5)], [(0.0, 0.0, 0.5, 0.5), (0.5, 0.5, 1.0, 1.0), unit])
    assert matrix.shape == (2, 3)
    torch.testing.assert_close(matrix, torch.tensor([[0.25, 0.25, 1.0], [1.0, 0.0, 0.25]], dtype=torch.float64))
    assert box_iou([], [unit]).shape == (0, 1)


def test_generalized_iou_and_conversions():
    a = torch.tensor([0.0, 0.0, 0.2, 0.2])
    b = torch.tensor([0.4, 0.0, 0.6, 0.2])  # disjoint: IoU 0, enclosing box 0.6 x 0.2, union 0.08
    assert generalized_iou(a, b).item() == pytest.approx(0 - (0.12 - 0.08) / 0.12)
    assert generalized_iou(a, a).item() == pytest.approx(1.0)
    boxes = torch.rand(5, 4)
    torch.testing.assert_close(xyxy_to_cxcywh(cxcywh_to_xyxy(boxes)), boxes)
    assert cxcywh_to_xyxy(torch.tensor([0.5, 0.5, 0.2, 0.4])).tolist() == pytest.approx([0.4, 0.3, 0.6, 0.7])


def _brute_force(cost):
    n, m = len(cost), len(cost[0])
    if n <= m:
        return min(sum(cost[i][p[i]] for i in range(n)) for p in itertools.permutations(range(m), n))
    return min(sum(cost[p[j]][j] for j in range(m)) for p in itertools.permutations(range(n), m))


def test_assignment_is_optimal():
    rng = random.Random(0)
    for _ in range(300):
        n, m = rng.randint(1, 6), rng.randint(1, 6)
        # Small integers give ties; floats give unique optima; negatives must work too.
        cost = [[rng.choice([rng.uniform(-5, 5), float(rng.randint(-2, 2))]) for _ in range(m)] for _ in range(n)]
        pairs = linear_sum_assignment(cost)
        assert len(pairs) == min(n, m)
        assert len({i for i, _ in pairs}) == len({j for _, j in pairs}) == len(pairs)
        assert sum(cost[i][j] for i, j in pairs) == pytest.approx(_brute_force(cost))


def test_assignment_small_cases():
    # Greedy would take (0, 0) = 1 and then pay 100; the optimum crosses over.
    assert linear_sum_assignment([[1.0, 2.0], [3.0, 100.0]]) == [(0, 1), (1, 0)]
    assert linear_sum_assignment(torch.tensor([[5.0, 1.0, 3.0]])) == [(0, 1)]
    assert linear_sum_assignment([[4.0], [2.0], [3.0]]) == [(1, 0)]
    assert linear_sum_assignment([]) == []
    with pytest.raises(ValueError, match="finite"):
        linear_sum_assignment([[1.0, float("nan")]])


def test_accuracy_and_exact_match():
    assert accuracy(["a", "b", "c", "d"], ["a", "x", "c", "y"]) == 0.5
    assert accuracy(torch.tensor([1, 2, 3]), [1, 2, 0]) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="pred has 2 items but target has 3"):
        accuracy([1, 2], [1, 2, 3])
    with pytest.raises(ValueError, match="empty"):
        accuracy([], [])
    assert exact_match(" Yes.", "yes") == 1.0
    assert exact_match("two  dogs", "Two dogs") == 1.0
    assert exact_match("yes", "no") == 0.0
    assert exact_match(["Red car", "blue", "a cat"], ["red car.", "Blue", "cat"]) == pytest.approx(2 / 3)


def test_f1_with_one_false_positive_and_one_miss():
    target = [[(0.0, 0.0, 0.5, 0.5), (0.5, 0.5, 1.0, 1.0)], [(0.1, 0.1, 0.2, 0.2)]]
    pred = [
        [(0.0, 0.0, 0.5, 0.45), (0.5, 0.5, 1.0, 1.0), (0.0, 0.6, 0.2, 0.9)],  # 2 hits (IoU 0.9, 1.0) + 1 FP
        [(0.15, 0.15, 0.25, 0.25)],  # IoU 1/7 < 0.5: a FP and a miss
    ]
    counts = detection_counts(pred, target, iou=0.5)
    assert (counts["tp"], counts["fp"], counts["fn"]) == (2, 2, 1)
    assert counts["precision"] == pytest.approx(0.5) and counts["recall"] == pytest.approx(2 / 3)
    assert f1_at_iou(pred, target) == pytest.approx(2 * 2 / (2 * 2 + 2 + 1))
    assert f1_at_iou(pred, target, iou=0.1) == pytest.approx(2 * 3 / (2 * 3 + 1 + 0))


def test_f1_matching_is_one_to_one_and_by_best_iou():
    target = [[(0.0, 0.0, 0.4, 1.0), (0.2, 0.0, 0.6, 1.0)]]  # full-height boxes: IoU is 1-D overlap
    # Two predictions on the same target count once; the duplicate is a false positive.
    assert detection_counts([[(0.0, 0.0, 0.4, 1.0), (0.0, 0.0, 0.4, 1.0)]], [target[0][:1]])["fp"] == 1
    # p0 overlaps both targets (IoU 0.31/0.49 with g1, 0.29/0.51 with g0); p1 fits only g1
    # (0.28/0.52). Greedy by best IoU gives g1 to p0, leaving p1 and g0 unmatched, whatever the
    # order the predictions are listed in.
    pred = [(0.11, 0.0, 0.51, 1.0), (0.32, 0.0, 0.72, 1.0)]
    ious = box_iou(pred, target[0])
    assert ious[0, 1] > ious[0, 0] > 0.5 and ious[1, 1] > 0.5 > ious[1, 0]
    for order in (pred, pred[::-1]):
        counts = detection_counts([order], target)
        assert (counts["tp"], counts["fp"], counts["fn"]) == (1, 1, 1)


def test_f1_edge_cases():
    assert f1_at_iou([[], []], [[], []]) == 1.0  # nothing to find, nothing found
    assert f1_at_iou([[]], [[(0.0, 0.0, 1.0, 1.0)]]) == 0.0
    assert f1_at_iou([[(0.0, 0.0, 1.0, 1.0)]], [[]]) == 0.0
    assert f1_at_iou([torch.tensor([[0.0, 0.0, 1.0, 1.0]])], [[(0.0, 0.0, 1.0, 1.0)]]) == 1.0
    with pytest.raises(ValueError, match="2 images"):
        f1_at_iou([[], []], [[]])
    with pytest.raises(ValueError, match="iou"):
        f1_at_iou([[]], [[]], iou=0.0)
