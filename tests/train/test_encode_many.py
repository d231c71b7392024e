"""Encoding a batch at once: the cache misses share one tower call and get the features each
would get alone (images of two sizes, clips, LLaVA's fixed-size images)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from PIL import Image
from train_fixtures import tiny_domain

import train.data as data_module
from train import LoraSpec, ModelRef, VisionLM, load_domain


@pytest.mark.parametrize("model,domain", [("qwen2_vl_tiny", "color_largest"), ("qwen2_vl_tiny", "direction"),
                                          ("qwen2_5_vl_tiny", "color_largest"), ("llava_1_5_tiny", "color_largest")])
def test_encode_many_matches_one_by_one_with_one_tower_call(model, domain, tiny_zoo, vlora_home, monkeypatch):
    vlm = VisionLM(ModelRef(model, str(tiny_zoo[model])), LoraSpec(rank=4, alpha=8), device="cpu")
    data = load_domain(tiny_domain(vlora_home, domain, tiny_zoo[model], limit=12))
    rows = [dict(data.splits["train"][i]) for i in range(4)]
    if rows[0]["media"] == "image":  # a photo of another, odd size in the same batch
        rows[1]["image"] = rows[1]["image"].convert("RGB").resize((97, 61), Image.BILINEAR)
    alone = []
    for r in rows:
        vlm.encoder.cache.clear()
        alone.append(vlm.encoder.encode(r, data.info))
    vlm.encoder.cache.clear()
    calls = []
    real = data_module.visual_features
    monkeypatch.setattr(data_module, "visual_features", lambda *a, **k: calls.append(1) or real(*a, **k))
    together = vlm.encoder.encode_many(rows + rows[:1], data.info)  # a repeated row is encoded once
    assert len(calls) == 1 and len(together) == 5 and together[4] is together[0]
    for a, b in zip(alone, together):
        assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.position_ids, b.position_ids)
        assert torch.equal(a.visual_mask, b.visual_mask)
        torch.testing.assert_close(a.visual, b.visual, rtol=1e-4, atol=1e-5)
    assert vlm.encoder.encode_many(rows, data.info)[2] is together[2] and len(calls) == 1, "hits use the cache"


def test_rows_read_pictures_only_for_items_not_encoded(tiny_zoo, vlora_home, monkeypatch):
    """`DomainData.rows` with the encoder: every column as the dataset has it, but the picture
    (decoded by `datasets` on each access) only for rows the encoder has not cached."""
    vlm = VisionLM(ModelRef("qwen2_vl_tiny", str(tiny_zoo["qwen2_vl_tiny"])), LoraSpec(rank=4, alpha=8), device="cpu")
    data = load_domain(tiny_domain(vlora_home, "color_largest", tiny_zoo["qwen2_vl_tiny"], limit=12))
    full = [data.splits["train"][i] for i in (3, 0, 5)]
    first = data.rows("train", [3, 0, 5], vlm.encoder)
    assert first == full, "nothing encoded yet: whole rows, pictures included"
    vlm.encoder.encode_many(first[:2], data.info)
    decoded = []
    real = Image.open
    monkeypatch.setattr(Image, "open", lambda *a, **k: decoded.append(1) or real(*a, **k))
    again = data.rows("train", [3, 0, 5], vlm.encoder)
    assert len(decoded) == 1, "only the item not yet encoded had its picture read"
    assert [("image" in r) for r in again] == [False, False, True]
    assert [{k: v for k, v in r.items() if k != "image"} for r in again] == \
        [{k: v for k, v in r.items() if k != "image"} for r in full]
    assert again[2]["image"] == full[2]["image"]
    items = vlm.encoder.encode_many(again, data.info)  # the encoded rows are served from the cache
    assert all(torch.equal(a.input_ids, b.input_ids) for a, b in zip(items, vlm.encoder.encode_many(full, data.info)))
    assert data.rows("train", [3]) == full[:1], "without an encoder: the dataset's rows as they are"
    swapped = dataclasses.replace(data, splits={"train": data.splits["eval"], "eval": data.splits["train"]})
    assert swapped.rows("train", [0], vlm.encoder)[0]["id"] == data.splits["eval"][0]["id"], \
        "a copy with other splits reads them, not the original's cached view"
