"""Head behaviour apart from learning: config, padding, dtypes, decoding, targets, save / load."""

from __future__ import annotations

import json

import pytest
import torch

from heads import HeadConfig, HeadResult, build_head, load_head, save_head

D = 16
LABELS = ["cat", "dog", "bird"]


def make(type_: str, **kw):
    if type_ == "classify":
        kw.setdefault("labels", LABELS)
    if type_ == "detect":
        kw.setdefault("pooling", "slots")  # the set head; the dense head (needs token_xy) has test_dense.py
    torch.manual_seed(0)
    head = build_head(HeadConfig(type=type_, hidden_size=D, max_boxes=3, max_count=4, **kw))
    if hasattr(head, "query"):
        with torch.no_grad():  # a trained-looking query, so attention is not plain mean pooling
            head.query.normal_(0, 3.0)
    return head.eval()


TYPES = ["classify", "count", "detect", "binary"]


@pytest.mark.parametrize("kwargs, field", [
    (dict(type="segment"), "type"),
    (dict(hidden_size=0), "hidden_size"),
    (dict(pooling="max"), "pooling"),
    (dict(dropout=1.0), "dropout"),
    (dict(labels=None), "labels"),
    (dict(labels=["a", "a", "b"]), "labels"),
    (dict(labels=["only"]), "labels"),
    (dict(type="count", max_count=0), "max_count"),
    (dict(type="detect", max_boxes=0), "max_boxes"),
    (dict(type="binary", labels=["x", "y"]), "labels"),
    (dict(type="detect", score_threshold=1.0), "score_threshold"),
])
def test_config_errors_name_the_field(kwargs, field):
    args = dict(type="classify", hidden_size=D, labels=LABELS) | kwargs
    if args["type"] != "classify" and "labels" not in kwargs:
        args["labels"] = None
    with pytest.raises(ValueError, match=f"HeadConfig.{field}"):
        HeadConfig(**args)


def test_config_errors_list_valid_values_and_round_trip():
    with pytest.raises(ValueError, match=r"'classify', 'count', 'detect', 'binary'"):
        HeadConfig(type="segment", hidden_size=D)
    with pytest.raises(ValueError, match=r"'last', 'mean', 'attention'"):
        HeadConfig(type="binary", hidden_size=D, pooling="max")
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['num_classes'\]"):
        HeadConfig.from_dict({"type": "binary", "hidden_size": D, "num_classes": 2})
    config = HeadConfig(type="detect", hidden_size=D, labels=("person",), max_boxes=5, pooling="last")
    assert config.labels == ["person"]
    assert HeadConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


@pytest.mark.parametrize("type_", TYPES)
@pytest.mark.parametrize("pooling", ["last", "mean", "attention"])
def test_padding_does_not_change_outputs(type_, pooling):
    head = make(type_, pooling=pooling)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, D, generator=gen)  # x: [B, T, D], all real
    base = head(x)
    assert all(torch.equal(v, head(x, torch.ones(2, 5))[k]) for k, v in base.items())
    pad = torch.full((2, 3, D), float("inf"))  # padded positions may hold anything
    pad[0, 1] = float("nan")
    for padded, mask in [
        (torch.cat([x, pad], 1), torch.tensor([[1] * 5 + [0] * 3] * 2)),  # right padding
        (torch.cat([pad, x], 1), torch.tensor([[0] * 3 + [1] * 5] * 2, dtype=torch.bool)),  # left
    ]:
        out = head(padded, mask)
        for k, v in base.items():
            torch.testing.assert_close(out[k], v, rtol=1e-6, atol=1e-6)
    # Rows of different lengths in one batch match each row run alone.
    mixed = torch.cat([x, torch.randn(2, 2, D, generator=gen)], 1)
    out = head(mixed, torch.tensor([[1] * 5 + [0, 0], [1] * 7]))
    alone = head(mixed[1:])
    for k, v in base.items():
        torch.testing.assert_close(out[k][0], v[0], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out[k][1], alone[k][0], rtol=1e-6, atol=1e-6)


def test_pooling_modes_differ():
    """Each mode really looks at what it claims (guards against all three collapsing to one)."""
    x = torch.randn(1, 4, D)
    pooled = {p: make("binary", pooling=p).pool(x) for p in ("last", "mean", "attention")}
    assert torch.equal(pooled["last"], x[:, -1])
    torch.testing.assert_close(pooled["mean"], x.mean(1))
    assert not torch.allclose(pooled["attention"], pooled["mean"], atol=1e-3)


@pytest.mark.parametrize("type_", TYPES)
def test_half_precision_inputs_and_weights(type_):
    head = make(type_)
    x = torch.randn(3, 4, D).bfloat16()
    ref = head(x.float())
    out = head(x)
    for k, v in out.items():
        assert v.dtype == torch.float32
        torch.testing.assert_close(v, ref[k])  # same values: only the input's rounding differs
    targets = head.targets_from({"classify": ["cat", 1, "bird"], "count": [0, 2, 9], "binary": [True, "no", "YES"],
                                 "detect": [[], [(0.1, 0.1, 0.4, 0.6)], [(0, 0, 1, 1), (0.5, 0.5, 0.7, 0.9)]]}[type_])
    head.train()
    head.loss(head(x.requires_grad_()), targets).backward()
    assert x.grad is not None and x.grad.dtype == torch.bfloat16 and torch.isfinite(x.grad.float()).all()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in head.parameters())
    head.eval().to(torch.bfloat16)  # bf16 storage, as load_head(dtype=torch.bfloat16) gives
    for k, v in head(x).items():
        assert v.dtype == torch.float32
        torch.testing.assert_close(v, ref[k], rtol=0.05, atol=0.05)


@pytest.mark.parametrize("type_", TYPES)
def test_save_load_round_trip(tmp_path, type_):
    head = make(type_, **({"labels": ["person"]} if type_ == "detect" else {}))
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p))  # not the init: loading must restore these values
    x, mask = torch.randn(4, 6, D), torch.tensor([[1] * 6, [1] * 3 + [0] * 3, [0, 1, 1, 1, 1, 1], [1] + [0] * 5])
    save_head(head, tmp_path / "adapter", name="task")
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == ["task.json", "task.safetensors"]
    loaded = load_head(tmp_path / "adapter", name="task")
    assert type(loaded) is type(head) and loaded.config == head.config and not loaded.training
    expected, got = head(x, mask), loaded(x, mask)
    assert expected.keys() == got.keys() and all(torch.equal(got[k], expected[k]) for k in expected)
    assert head.decode(expected) == loaded.decode(got)
    half = load_head(tmp_path / "adapter", name="task", dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in half.parameters())


def test_load_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="head.json"):
        load_head(tmp_path)
    save_head(make("binary"), tmp_path)
    (tmp_path / "head.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="head.safetensors"):
        load_head(tmp_path)
    save_head(make("binary"), tmp_path)
    config = json.loads((tmp_path / "head.json").read_text()) | {"hidden_size": D * 2}
    (tmp_path / "head.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="wrong shape"):
        load_head(tmp_path)


def test_input_errors():
    head = make("binary")
    with pytest.raises(ValueError, match="hidden_size 16"):
        head(torch.randn(2, 3, D + 1))
    with pytest.raises(ValueError, match="attention_mask: expected shape"):
        head(torch.randn(2, 3, D), torch.ones(2, 4))
    with pytest.raises(ValueError, match=r"rows \[1\] have no real token"):
        head(torch.randn(2, 3, D), torch.tensor([[1, 1, 0], [0, 0, 0]]))
    with pytest.raises(ValueError, match="3-D"):
        head(torch.randn(3, D))


def test_decode_formats():
    classify, count, binary = make("classify"), make("count"), make("binary")
    [r] = classify.decode({"logits": torch.tensor([[0.0, 2.0, 0.0]])})
    assert (r.type, r.label, r.count, r.answer) == ("classify", "dog", None, None)
    assert r.confidence == pytest.approx(torch.tensor([0.0, 2.0, 0.0]).softmax(0)[1].item())
    [r] = count.decode({"logits": torch.tensor([[0.0, 0.0, 0.0, 5.0, 0.0]])})
    assert r.count == 3 and isinstance(r.count, int) and r.label is None
    yes, no = binary.decode({"logits": torch.tensor([2.0, -1.0])})
    assert (yes.answer, no.answer) == ("yes", "no")
    assert yes.confidence == pytest.approx(torch.sigmoid(torch.tensor(2.0)).item())
    assert no.confidence == pytest.approx(1 - torch.sigmoid(torch.tensor(-1.0)).item())
    assert json.loads(json.dumps(yes.to_dict()))["answer"] == "yes"


def test_detect_decode_keeps_confident_boxes_best_first():
    detect = make("detect", labels=["person"])
    logits = torch.tensor([[1.0, 3.0, -2.0], [-1.0, -3.0, -2.0]])  # scores ~0.73, 0.95, 0.12
    boxes = torch.tensor([[[0.5, 0.5, 0.2, 0.4], [0.1, 0.2, 0.4, 0.2], [0.5, 0.5, 0.1, 0.1]]] * 2)  # cxcywh
    first, empty = detect.decode({"logits": logits, "boxes": boxes})
    assert first.label == "person" and len(first.boxes) == 2
    assert first.scores == pytest.approx(torch.sigmoid(torch.tensor([3.0, 1.0])).tolist())
    assert first.boxes[0] == pytest.approx((0.0, 0.1, 0.3, 0.3))  # clipped at the left edge
    assert first.boxes[1] == pytest.approx((0.4, 0.3, 0.6, 0.7))
    assert first.confidence == pytest.approx(first.scores[0])
    assert empty.boxes == [] and empty.scores == []
    assert empty.confidence == pytest.approx(1 - torch.sigmoid(torch.tensor(-1.0)).item())
    [loose] = detect.decode({"logits": logits[:1], "boxes": boxes[:1]}, threshold=0.1)
    assert len(loose.boxes) == 3
    assert HeadResult(**first.to_dict() | {"boxes": [tuple(b) for b in first.to_dict()["boxes"]]}) == first


def test_targets_from():
    classify, count, binary, detect = make("classify"), make("count"), make("binary"), make("detect")
    assert classify.targets_from(["bird", 0])["labels"].tolist() == [2, 0]
    with pytest.raises(ValueError, match=r"targets\[1\]='fish'.*\['cat', 'dog', 'bird'\]"):
        classify.targets_from(["cat", "fish"])
    assert count.targets_from([0, 4, 17, 3.0])["labels"].tolist() == [0, 4, 4, 3]  # 17 clamps to max_count
    with pytest.raises(ValueError, match="non-negative"):
        count.targets_from([-1])
    assert binary.targets_from([True, "No", " yes ", 0])["labels"].tolist() == [1.0, 0.0, 1.0, 0.0]
    with pytest.raises(ValueError, match="'maybe'"):
        binary.targets_from(["maybe"])
    t = detect.targets_from([[], [(0.1, 0.2, 0.3, 0.4), [0.5, 0.5, 1.0, 1.0]]])
    assert t["boxes"].shape == (2, 2, 4) and t["box_mask"].tolist() == [[False, False], [True, True]]
    with pytest.raises(ValueError, match="max_boxes=3"):
        detect.targets_from([[(0, 0, 0.5, 0.5)] * 4])
    with pytest.raises(ValueError, match="x1 < x2"):
        detect.targets_from([[(0.5, 0.5, 0.1, 0.9)]])
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        detect.targets_from([[(10, 20, 30, 40)]])


def test_detect_matching_and_loss():
    detect = make("detect")
    # Slots (cxcywh): slot 2 sits exactly on target 0, slot 0 exactly on target 1.
    boxes = torch.tensor([[[0.7, 0.7, 0.2, 0.2], [0.5, 0.5, 0.9, 0.9], [0.2, 0.2, 0.2, 0.2]]])
    targets = detect.targets_from([[(0.1, 0.1, 0.3, 0.3), (0.6, 0.6, 0.8, 0.8)]])
    good = {"logits": torch.tensor([[6.0, -6.0, 6.0]]), "boxes": boxes}
    assert detect.match(good, targets) == [[(0, 1), (2, 0)]]
    # Equal L1 and objectness: the slot with the better GIoU (A, 0.67 vs 0.33) is matched.
    tie = {"logits": torch.zeros(1, 3), "boxes": torch.tensor([[[0.6, 0.5, 0.2, 0.2], [0.9, 0.9, 0.1, 0.1],
                                                                 [0.5, 0.5, 0.3, 0.2]]])}
    assert detect.match(tie, detect.targets_from([[(0.4, 0.4, 0.6, 0.6)]])) == [[(2, 0)]]
    swapped = {"logits": torch.tensor([[-6.0, 6.0, -6.0]]), "boxes": boxes}
    assert detect.loss(good, targets) < 0.01 < detect.loss(swapped, targets)
    # The loss is objectness BCE + 5 * L1 (cxcywh) + 2 * (1 - GIoU), box terms per target box.
    off = {"logits": torch.tensor([[0.0, -1.0, 2.0]]), "boxes": boxes + torch.tensor([0.05, 0.0, 0.1, 0.0])}
    one = detect.targets_from([[(0.1, 0.1, 0.3, 0.3)]])
    assert detect.match(off, one) == [[(2, 0)]]
    pred, wanted = off["boxes"][0, 2], torch.tensor([0.2, 0.2, 0.2, 0.2])
    x1, x2 = pred[0] - pred[2] / 2, pred[0] + pred[2] / 2  # same y-extent as the target
    inter, union, enclose = (0.3 - x1) * 0.2, (x2 - x1) * 0.2 + 0.04 - (0.3 - x1) * 0.2, (x2 - 0.1) * 0.2
    giou = inter / union - (enclose - union) / enclose
    expected = (torch.nn.functional.binary_cross_entropy_with_logits(off["logits"], torch.tensor([[0.0, 0.0, 1.0]]))
                + 5 * (pred - wanted).abs().sum() + 2 * (1 - giou))
    assert detect.loss(off, one).item() == pytest.approx(expected.item(), rel=1e-5)
    # No targets anywhere: only the objectness term, pushing every slot toward "empty".
    none = detect.targets_from([[]])
    assert detect.match(good, none) == [[]]
    assert detect.loss(good, none).item() == pytest.approx(
        torch.nn.functional.binary_cross_entropy_with_logits(good["logits"], torch.zeros(1, 3)).item())
