"""The dense detection head and the token grid it reads: geometry, assignment, loss, decoding,
learning a picture's objects off its own tokens, save / load."""

from __future__ import annotations

import pytest
import torch

from heads import (DenseDetectHead, HeadConfig, NOT_VISUAL, build_head, center_crop_window, f1_at_iou, grid_xy,
                   load_head, prompt_token_xy, save_head)

D, G = 24, 4  # hidden width; a 4 x 4 token grid


def make(**kw) -> DenseDetectHead:
    torch.manual_seed(0)
    kw.setdefault("max_boxes", 4)
    return build_head(HeadConfig(type="detect", hidden_size=D, **kw))


def prompt_xy(batch: int, text_before: int = 2, text_after: int = 1) -> torch.Tensor:
    """[B, T, 2]: text, a G x G picture, text."""
    t = text_before + G * G + text_after
    row = prompt_token_xy(t, [(text_before, grid_xy(G, G))])
    return row.expand(batch, t, 2).clone()


def test_grid_xy_cell_centres_in_token_order():
    cells = grid_xy(2, 3)
    assert cells.shape == (6, 2)
    torch.testing.assert_close(cells[0], torch.tensor([1 / 6, 0.25]))  # row 0, column 0
    torch.testing.assert_close(cells[2], torch.tensor([5 / 6, 0.25]))  # row 0, last column
    torch.testing.assert_close(cells[3], torch.tensor([1 / 6, 0.75]))  # row 1 starts
    assert grid_xy(2, 3, frames=2).shape == (12, 2) and torch.equal(grid_xy(2, 3, frames=2)[6:], cells)
    window = grid_xy(1, 1, window=(0.25, 0.0, 0.75, 1.0))
    torch.testing.assert_close(window, torch.tensor([[0.5, 0.5]]))
    with pytest.raises(ValueError, match="rows=0"):
        grid_xy(0, 3)


def test_center_crop_window_of_a_wide_and_a_tall_picture():
    # 640 x 480 -> shortest side 336: 448 x 336, the centre 336 x 336 is x in [56, 392] of 448
    x1, y1, x2, y2 = center_crop_window(640, 480, 336, 336, 336)
    assert (x1, y1, x2, y2) == pytest.approx((56 / 448, 0.0, 392 / 448, 1.0))
    assert center_crop_window(300, 900, 336, 336, 336) == pytest.approx((0.0, 1 / 3, 1.0, 2 / 3))
    assert center_crop_window(500, 500, 336, 336, 336) == pytest.approx((0.0, 0.0, 1.0, 1.0))


def test_square_cells_leave_a_class_token_out_and_windows_follow_the_processor():
    from types import SimpleNamespace

    from heads import FULL, processor_window, square_cells

    cells = square_cells(5)  # a class token, then a 2 x 2 grid
    assert (cells[0] == NOT_VISUAL).all() and torch.equal(cells[1:], grid_xy(2, 2))
    crop = SimpleNamespace(do_resize=True, do_center_crop=True, size={"shortest_edge": 336},
                           crop_size={"height": 336, "width": 336})
    assert processor_window(crop, 640, 480) == pytest.approx((56 / 448, 0.0, 392 / 448, 1.0))
    assert processor_window(SimpleNamespace(do_center_crop=False), 640, 480) == FULL  # resized whole
    assert processor_window(None, 640, 480) == FULL


def test_prompt_token_xy_places_spans_and_marks_text():
    xy = prompt_token_xy(7, [(1, grid_xy(1, 2)), (4, grid_xy(1, 3))])
    assert (xy[[0, 3], 0] == NOT_VISUAL).all() and (xy[[1, 2, 4, 5, 6], 0] >= 0).all()
    with pytest.raises(ValueError, match="does not fit"):
        prompt_token_xy(4, [(3, grid_xy(1, 2))])


def test_forward_scores_only_visual_tokens_and_names_bad_xy():
    head = make().eval()
    xy = prompt_xy(2)
    hidden = torch.randn(2, xy.shape[1], D)
    out = head(hidden, None, xy)
    assert out["logits"].shape == (2, xy.shape[1]) and out["boxes"].shape == (2, xy.shape[1], 4)
    assert (out["logits"][:, :2] < -1e3).all() and (out["logits"][:, 2:2 + G * G] > -1e3).all()
    # an untrained head puts each box centre on its own token's cell
    torch.testing.assert_close(out["boxes"][0, 2:2 + G * G, :2], grid_xy(G, G), atol=1e-4, rtol=0)
    with pytest.raises(ValueError, match="needs token_xy"):
        head(hidden)
    with pytest.raises(ValueError, match="expected shape"):
        head(hidden, None, xy[:, :-1])
    with pytest.raises(ValueError, match="no visual token"):
        head(hidden, None, torch.full_like(xy, NOT_VISUAL))
    mask = torch.ones(2, xy.shape[1], dtype=torch.long)
    mask[1, 2:] = 0  # the second prompt's picture is all padding
    with pytest.raises(ValueError, match="no visual token"):
        head(hidden, mask, xy)


def test_assign_owner_is_the_cell_of_the_centre_and_collisions_move_on():
    head = make()
    xy = prompt_xy(1)
    out = head(torch.zeros(1, xy.shape[1], D), None, xy)
    # centre (0.3, 0.6): column 1, row 2 -> token 2 + 2 * 4 + 1 = 11; the second box has the same centre
    box = (0.2, 0.5, 0.4, 0.7)
    targets = head.targets_from([[box, box, (0.8, 0.0, 1.0, 0.2)]])
    b_idx, t_idx, m_idx, ignore = head.assign(out, targets)
    assert b_idx == [0, 0, 0] and m_idx == [0, 1, 2]
    assert t_idx[0] == 11 and t_idx[1] != 11 and t_idx[2] == 2 + 0 * 4 + 3
    assert not ignore[0, t_idx].any()  # owners are always counted


def test_ignore_covers_the_core_of_a_big_box_but_not_its_edge():
    head = make()
    xy = prompt_xy(1)
    out = head(torch.zeros(1, xy.shape[1], D), None, xy)
    _, t_idx, _, ignore = head.assign(out, head.targets_from([[(0.0, 0.0, 1.0, 1.0)]]))
    core = [2 + r * 4 + c for r in (1, 2) for c in (1, 2)]  # cell centres within 0.25 of (0.5, 0.5)
    assert set(ignore[0].nonzero().flatten().tolist()) == set(core) - set(t_idx)
    assert not ignore[0, 2].item()  # the corner cell is a negative


def perfect_outputs(head, xy, boxes_per_prompt, logit=12.0):
    """Outputs a perfect head would give: each owner token sure and exactly on its box."""
    out = head(torch.zeros(len(boxes_per_prompt), xy.shape[1], D), None, xy)
    out = {k: v.detach().clone() for k, v in out.items()}
    targets = head.targets_from(boxes_per_prompt)
    b_idx, t_idx, m_idx, _ = head.assign(out, targets)
    out["logits"] = torch.where(out["visual"], torch.full_like(out["logits"], -logit), out["logits"])
    for b, t, m in zip(b_idx, t_idx, m_idx):
        x1, y1, x2, y2 = targets["boxes"][b, m].tolist()
        out["logits"][b, t] = logit
        out["boxes"][b, t] = torch.tensor([(x1 + x2) / 2, (y1 + y2) / 2, x2 - x1, y2 - y1])
    return out, targets


def test_loss_is_small_for_perfect_outputs_and_large_for_shifted_ones():
    head = make()
    xy = prompt_xy(2)
    boxes = [[(0.1, 0.1, 0.3, 0.4)], [(0.5, 0.5, 0.9, 0.8), (0.05, 0.6, 0.2, 0.9)]]
    good, targets = perfect_outputs(head, xy, boxes)
    assert head.loss(good, targets) < 0.01
    shifted = dict(good, boxes=good["boxes"].roll(1, dims=1))  # every box one token off
    assert head.loss(shifted, targets) > 1.0
    silent = dict(good, logits=torch.where(good["visual"], -12.0, good["logits"]))  # sees nothing
    assert head.loss(silent, targets) > 1.0
    empty = head.targets_from([[], []])
    assert head.loss(silent, empty) < 0.01 < head.loss(good, empty)


def test_decode_suppresses_duplicates_and_caps_at_max_boxes():
    head = make(max_boxes=2, labels=["car"])
    xy = prompt_xy(1)
    out, _ = perfect_outputs(head, xy, [[(0.1, 0.1, 0.4, 0.4), (0.6, 0.6, 0.9, 0.9), (0.6, 0.1, 0.9, 0.3)]])
    owners = (out["logits"][0] > 0).nonzero().flatten().tolist()
    # a neighbour repeats the first box a little less surely: NMS drops it
    first = out["boxes"][0, owners[0]].clone()
    dup = next(t for t in range(2, 2 + G * G) if t not in owners)
    out["boxes"][0, dup], out["logits"][0, dup] = first + 0.01, 11.0
    [result] = head.decode(out)
    assert len(result.boxes) == 2 and result.label == "car"
    assert result.scores == sorted(result.scores, reverse=True)
    [loose] = make(max_boxes=8).decode(out)
    assert len(loose.boxes) == 3  # three objects, the duplicate suppressed
    nothing = dict(out, logits=torch.where(out["visual"], -5.0, out["logits"]))
    [empty] = head.decode(nothing)
    assert empty.boxes == [] and empty.confidence == pytest.approx(1 - torch.sigmoid(torch.tensor(-5.0)).item())


def grid_scenes(n: int, gen: torch.Generator, noise: float = 0.3):
    """Pictures as G x G tokens behind text: an object puts its offset and size on the token of the
    cell holding its centre (what a picture's visual tokens carry); other tokens hold noise."""
    proj = torch.randn(5, D, generator=gen) / 5 ** 0.5
    xy = prompt_xy(n)
    hidden = noise * torch.randn(n, xy.shape[1], D, generator=gen)
    boxes = []
    for i in range(n):
        cells = torch.randperm(G * G, generator=gen)[: 1 + int(torch.randint(0, 3, (), generator=gen))].tolist()
        rows = []
        for c in cells:
            r, col = divmod(c, G)
            dx, dy = (torch.rand(2, generator=gen) - 0.5).tolist()
            w, h = (0.1 + 0.15 * torch.rand(2, generator=gen)).tolist()
            cx, cy = (col + 0.5 + 0.6 * dx) / G, (r + 0.5 + 0.6 * dy) / G
            hidden[i, 2 + c] += 3.0 * torch.tensor([dx, dy, 4 * (w - 0.17), 4 * (h - 0.17), 1.0]) @ proj
            rows.append((max(cx - w / 2, 0.0), max(cy - h / 2, 0.0), min(cx + w / 2, 1.0), min(cy + h / 2, 1.0)))
        boxes.append(rows)
    return hidden, xy, boxes


def test_dense_head_learns_objects_off_their_own_tokens():
    gen = torch.Generator().manual_seed(3)
    hidden, xy, boxes = grid_scenes(384, gen)
    n = 256
    head = make()
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    targets = head.targets_from(boxes[:n])
    head.train()
    first = None
    for step in range(250):
        idx = torch.randint(0, n, (64,), generator=gen)
        loss = head.loss(head(hidden[idx], None, xy[idx]), {k: v[idx] for k, v in targets.items()})
        first = first if first is not None else loss.item()
        opt.zero_grad(), loss.backward(), opt.step()
    head.eval()
    assert loss.item() < 0.3 * first
    predicted = [r.boxes for r in head.predict(hidden[n:], None, xy[n:])]
    assert f1_at_iou(predicted, boxes[n:], iou=0.5) > 0.85
    untrained = [r.boxes for r in make().predict(hidden[n:], None, xy[n:])]
    assert f1_at_iou(untrained, boxes[n:], iou=0.5) < 0.2  # the bar is not trivial


def test_padding_side_and_half_precision_do_not_change_answers():
    head = make()
    gen = torch.Generator().manual_seed(4)
    hidden, xy, _ = grid_scenes(2, gen)
    t = xy.shape[1]
    mask = torch.ones(2, t + 3, dtype=torch.long)
    right_h = torch.cat([hidden, 50 * torch.randn(2, 3, D)], dim=1)
    right_xy = torch.cat([xy, torch.rand(2, 3, 2)], dim=1)  # padding's xy is junk: the mask rules
    mask[:, t:] = 0
    left_h, left_xy, left_mask = right_h.roll(3, 1), right_xy.roll(3, 1), mask.roll(3, 1)
    a = head.predict(right_h, mask, right_xy)
    b = head.predict(left_h, left_mask, left_xy)
    c = head.predict(hidden.bfloat16(), None, xy)
    for x, y in zip(a, b):
        assert x.boxes == pytest.approx(y.boxes) and x.scores == pytest.approx(y.scores)
    for x, y in zip(a, c):
        assert x.scores == pytest.approx(y.scores, abs=0.02)


def test_save_load_round_trip_keeps_the_dense_head(tmp_path):
    head = make(dense_width=8)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p))
    save_head(head, tmp_path / "adapter")
    loaded = load_head(tmp_path / "adapter")
    assert isinstance(loaded, DenseDetectHead) and loaded.config == head.config
    xy = prompt_xy(2)
    x = torch.randn(2, xy.shape[1], D)
    torch.testing.assert_close(loaded(x, None, xy)["logits"], head.eval()(x, None, xy)["logits"])
    linear = make(dense_width=0)
    assert linear.hidden is None and linear(x, None, xy)["boxes"].shape == (2, xy.shape[1], 4)


@pytest.mark.parametrize("kwargs, message", [
    (dict(type="count", pooling="dense"), "pooling='dense' is for type='detect'"),
    (dict(type="detect", dense_width=-1), "dense_width"),
])
def test_bad_configs_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        HeadConfig(hidden_size=D, **kwargs)
