"""Every head learns a simple synthetic task from hidden-state sequences.

Hidden states are random projections of a small latent vector (the answer, or what the answer
is a simple function of) on every real token, plus noise; padded positions hold large garbage.
A head that trains must drive its loss down and beat chance by a wide margin on held-out data.
"""

from __future__ import annotations

import pytest
import torch

from heads import HeadConfig, accuracy, build_head, f1_at_iou

D, T, N_TRAIN, N_TEST = 32, 6, 256, 256


def sequences(latent: torch.Tensor, gen: torch.Generator, noise: float = 0.3):
    """latent: [N, K] -> hidden [N, T, D] (latent on every real token) and mask [N, T]."""
    n, k = latent.shape
    proj = torch.randn(k, D, generator=gen) / k ** 0.5
    hidden = (latent @ proj)[:, None, :] + noise * torch.randn(n, T, D, generator=gen)  # [N, T, D]
    lengths = torch.randint(2, T + 1, (n,), generator=gen)
    mask = torch.arange(T)[None, :] < lengths[:, None]  # [N, T], right padding
    hidden = torch.where(mask[..., None], hidden, 50.0 * torch.randn(n, T, D, generator=gen))
    return hidden, mask.long()


def train(head, hidden, mask, targets, steps: int, lr: float = 1e-2) -> tuple[float, float]:
    """Full-batch Adam; returns (first loss, mean of the last ten losses)."""
    opt = torch.optim.Adam(head.parameters(), lr=lr)
    head.train()
    losses = []
    for _ in range(steps):
        loss = head.loss(head(hidden, mask), targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    head.eval()
    return losses[0], sum(losses[-10:]) / 10


def split(x):
    return x[:N_TRAIN], x[N_TRAIN:]


@pytest.mark.parametrize("pooling", ["attention", "last", "mean"])
def test_classify_learns(pooling):
    gen = torch.Generator().manual_seed(1)
    labels = ["walk", "run", "sit", "wave"]
    y = torch.randint(0, 4, (N_TRAIN + N_TEST,), generator=gen)
    hidden, mask = sequences(3.0 * torch.eye(4)[y], gen)
    head = build_head(HeadConfig(type="classify", hidden_size=D, labels=labels, pooling=pooling))
    (h_tr, h_te), (m_tr, m_te), (y_tr, y_te) = split(hidden), split(mask), split(y)
    first, last = train(head, h_tr, m_tr, head.targets_from([labels[i] for i in y_tr]), steps=150)
    assert last < 0.2 * first
    predicted = [r.label for r in head.predict(h_te, m_te)]
    assert accuracy(predicted, [labels[i] for i in y_te]) > 0.95  # chance is 0.25


def test_attention_pooling_finds_the_marked_token():
    """Only one token (marked by a direction) carries the class; the others carry other classes.

    Mean pooling sees a blend of classes; the learned query must attend to the marked token.
    """
    gen = torch.Generator().manual_seed(2)
    n, k = N_TRAIN + N_TEST, 4
    classes = torch.randint(0, k, (n, T), generator=gen)  # a class per token
    where = torch.randint(0, T, (n,), generator=gen)  # the marked token
    embed = torch.randn(k + 1, D, generator=gen)  # k class directions + the marker
    hidden = 2.0 * embed[classes] + 0.2 * torch.randn(n, T, D, generator=gen)
    hidden[torch.arange(n), where] += 4.0 * embed[k]
    y = classes[torch.arange(n), where]
    labels = [str(i) for i in range(k)]
    results = {}
    for pooling in ("attention", "mean"):
        torch.manual_seed(0)
        head = build_head(HeadConfig(type="classify", hidden_size=D, labels=labels, pooling=pooling))
        train(head, hidden[:N_TRAIN], None, head.targets_from(y[:N_TRAIN].tolist()), steps=300, lr=3e-2)
        pred = [int(r.label) for r in head.predict(hidden[N_TRAIN:])]
        results[pooling] = accuracy(pred, y[N_TRAIN:])
    assert results["attention"] > 0.9, results
    assert results["attention"] > results["mean"] + 0.2, results


def test_count_learns():
    gen = torch.Generator().manual_seed(3)
    max_count = 5
    y = torch.randint(0, max_count + 3, (N_TRAIN + N_TEST,), generator=gen)  # some above max_count
    # "At least k objects" features (a thermometer code), one direction per k.
    latent = 2.0 * (y[:, None] > torch.arange(max_count + 2)[None]).float()
    hidden, mask = sequences(latent, gen)
    head = build_head(HeadConfig(type="count", hidden_size=D, max_count=max_count))
    (h_tr, h_te), (m_tr, m_te), (y_tr, y_te) = split(hidden), split(mask), split(y)
    first, last = train(head, h_tr, m_tr, head.targets_from(y_tr.tolist()), steps=200, lr=3e-2)
    assert last < 0.1 * first
    counts = [r.count for r in head.predict(h_te, m_te)]
    assert max(counts) == max_count  # larger counts were clamped into the last class
    assert accuracy(counts, y_te.clamp(max=max_count)) > 0.95  # chance 1/6


def test_binary_learns():
    gen = torch.Generator().manual_seed(4)
    z = torch.randn(N_TRAIN + N_TEST, 8, generator=gen)
    y = (z @ torch.randn(8, generator=gen)) > 0  # yes iff the latent is on one side of a plane
    hidden, mask = sequences(2.0 * z, gen)
    head = build_head(HeadConfig(type="binary", hidden_size=D, pooling="mean"))
    (h_tr, h_te), (m_tr, m_te), (y_tr, y_te) = split(hidden), split(mask), split(y)
    first, last = train(head, h_tr, m_tr, head.targets_from(["yes" if v else "no" for v in y_tr]), steps=200)
    assert last < 0.3 * first
    answers = [r.answer for r in head.predict(h_te, m_te)]
    assert accuracy(answers, ["yes" if v else "no" for v in y_te]) > 0.9  # chance 0.5


def synthetic_boxes(n: int, gen: torch.Generator):
    """One box in the left half of every image, a second in the right half of about half of them."""
    def uniform(lo, hi, size):
        return lo + (hi - lo) * torch.rand(size, generator=gen)
    left = torch.stack([uniform(0.15, 0.35, n), uniform(0.3, 0.7, n), uniform(0.15, 0.3, n), uniform(0.2, 0.4, n)], 1)
    right = torch.stack([uniform(0.65, 0.85, n), uniform(0.3, 0.7, n), uniform(0.15, 0.3, n), uniform(0.2, 0.4, n)], 1)
    has_right = torch.rand(n, generator=gen) < 0.5
    latent = torch.cat([left, right * has_right[:, None], has_right[:, None].float()], dim=1)  # [N, 9]

    def xyxy(b):
        cx, cy, w, h = b.tolist()
        return (cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2)
    boxes = [[xyxy(left[i])] + ([xyxy(right[i])] if has_right[i] else []) for i in range(n)]
    return 4.0 * (latent - latent.mean(0)), boxes


def test_detect_learns():
    gen = torch.Generator().manual_seed(5)
    latent, boxes = synthetic_boxes(N_TRAIN + N_TEST, gen)
    hidden, mask = sequences(latent, gen, noise=0.1)
    torch.manual_seed(0)
    head = build_head(HeadConfig(type="detect", hidden_size=D, max_boxes=4, labels=["person"], pooling="slots"))
    (h_tr, h_te), (m_tr, m_te) = split(hidden), split(mask)
    first, last = train(head, h_tr, m_tr, head.targets_from(boxes[:N_TRAIN]), steps=300, lr=2e-2)
    assert last < 0.3 * first
    predicted = [r.boxes for r in head.predict(h_te, m_te)]
    assert f1_at_iou(predicted, boxes[N_TRAIN:], iou=0.5) > 0.8
    assert f1_at_iou([[] for _ in predicted], boxes[N_TRAIN:]) == 0.0  # the bar is not trivial


def per_token_boxes(n: int, gen: torch.Generator):
    """Each object on a token of its own, at a random position among noise tokens: a box's
    coordinates are read off one token, as the visual tokens of a picture carry the objects."""
    def uniform(lo, hi, size):
        return lo + (hi - lo) * torch.rand(size, generator=gen)
    proj = torch.randn(5, D, generator=gen) / 5 ** 0.5
    hidden = 0.1 * torch.randn(n, T, D, generator=gen)
    boxes = []
    for i in range(n):
        k = 1 + int(torch.rand((), generator=gen) < 0.5)
        where = torch.randperm(T, generator=gen)[:k].tolist()
        rows = []
        for side, t in zip((0.25, 0.75), where):
            cx, cy = side + uniform(-0.1, 0.1, ()).item(), uniform(0.3, 0.7, ()).item()
            w, h = uniform(0.15, 0.3, ()).item(), uniform(0.2, 0.4, ()).item()
            hidden[i, t] += 4.0 * torch.tensor([cx - 0.5, cy - 0.5, w - 0.2, h - 0.3, 1.0]) @ proj
            rows.append((cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2))
        boxes.append(rows)
    return hidden, torch.ones(n, T, dtype=torch.long), boxes


def test_detect_slots_read_each_object_off_its_own_token():
    """Two objects on two tokens: one pooled vector mixes them, a query per slot reads each."""
    gen = torch.Generator().manual_seed(7)
    hidden, mask, boxes = per_token_boxes(N_TRAIN + N_TEST, gen)
    (h_tr, h_te), (m_tr, m_te) = split(hidden), split(mask)
    f1 = {}
    for pooling in ("slots", "attention"):
        torch.manual_seed(0)
        head = build_head(HeadConfig(type="detect", hidden_size=D, max_boxes=4, pooling=pooling))
        train(head, h_tr, m_tr, head.targets_from(boxes[:N_TRAIN]), steps=400, lr=2e-2)
        f1[pooling] = f1_at_iou([r.boxes for r in head.predict(h_te, m_te)], boxes[N_TRAIN:], iou=0.5)
    assert f1["slots"] > 0.8 and f1["slots"] > f1["attention"] + 0.1, f1
    assert HeadConfig(type="detect", hidden_size=D).pooling == "dense"  # detect's default reads tokens
