"""Distilled domain datasets (the schema of `train/distill`) turned into model inputs.

`load_domain(dir)` reads `domain.json` and the `DatasetDict`; `Encoder` turns one row into an
`Encoded` item (token ids, M-RoPE positions, and the vision tower's output, computed once and
cached by `<domain>/<id>` because the tower is frozen); `collate` pads a list of them into a
batch. Clips are read with OpenCV (`world.read_video`) and fed to Qwen models as video.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from heads import NOT_VISUAL

from .model import arch_of, rope_positions, visual_features
from .token_grid import visual_token_xy

TASKS = ("classify", "count", "detect", "binary", "lm")
DOMAIN_FILE = "domain.json"
MEDIA_COLUMN = "image"  # the one column that costs a decode per access (clips are paths)
COLUMNS = ("id", "domain", "task", "media", "image", "video", "frames", "question", "prompt", "label", "count",
           "boxes", "answer", "teacher")


@dataclass
class DomainInfo:
    """domain.json: what a domain dataset holds (see the distiller's schema)."""

    name: str
    task: str
    labels: list[str] | None = None
    max_count: int | None = None
    max_boxes: int | None = None
    teacher: dict = field(default_factory=dict)
    model: str | None = None
    media: str = "image"
    sizes: dict = field(default_factory=dict)
    question: str | None = None  # the one question every item asks (its head answers only it); None: per item
    augment: dict = field(default_factory=dict)  # {"transforms", "items", "copies_per_item"} when the train split holds copies
    created_by: str = ""
    version: int = 1

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"domain {self.name!r}: task {self.task!r} is not one of {list(TASKS)}")
        if self.media not in ("image", "clip"):
            raise ValueError(f"domain {self.name!r}: media {self.media!r} must be 'image' or 'clip'")
        if self.task == "classify" and not self.labels:
            raise ValueError(f"domain {self.name!r}: a classify domain needs its label set in domain.json 'labels'")


@dataclass
class DomainData:
    info: DomainInfo
    splits: Any  # datasets.DatasetDict with "train" and "eval"
    path: Path
    # split -> the same split without pictures; built on first use, never copied by `replace`
    _light: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def name(self) -> str:
        return self.info.name

    def size(self, split: str) -> int:
        return len(self.splits[split])

    @property
    def distinct_train(self) -> int:
        """Training items the teacher labelled: the train split less its mirrored / reversed copies."""
        return int(self.info.augment.get("items", self.size("train")))

    def rows(self, split: str, indices, encoder: Encoder | None = None) -> list[dict]:
        """Rows `indices` of `split` as dicts. With an `encoder`, a row's picture is read only when
        the encoder has not encoded that item yet: `datasets` decodes the image column on every
        access, and once an item's features are cached a training step never looks at it."""
        indices = [int(i) for i in indices]
        data = self.splits[split]
        if encoder is None or MEDIA_COLUMN not in data.column_names:
            return [data[i] for i in indices]
        if split not in self._light:
            self._light[split] = data.remove_columns([MEDIA_COLUMN])
        columns = self._light[split][indices]
        rows = [dict(zip(columns, values)) for values in zip(*columns.values())]
        for i, row in zip(indices, rows):
            if not encoder.has(row, self.info):  # to be encoded: it needs its picture
                row[MEDIA_COLUMN] = data[i][MEDIA_COLUMN]
        return rows


def load_domain(path: str | Path) -> DomainData:
    """The domain dataset at `path` (a directory with domain.json and a saved DatasetDict)."""
    from datasets import load_from_disk

    path = Path(path)
    if not (path / DOMAIN_FILE).is_file():
        raise FileNotFoundError(f"{path} is not a domain dataset: no {DOMAIN_FILE} "
                                "(`vlora distill` writes one directory per knowledge domain)")
    raw = json.loads((path / DOMAIN_FILE).read_text())
    known = set(DomainInfo.__dataclass_fields__)
    info = DomainInfo(**{k: v for k, v in raw.items() if k in known})
    splits = load_from_disk(str(path))
    for split in ("train", "eval"):
        if split not in splits:
            raise ValueError(f"{path}: the dataset has splits {list(splits)}; 'train' and 'eval' are required")
        missing = sorted(set(COLUMNS) - set(splits[split].column_names))
        if missing:
            raise ValueError(f"{path}: split {split!r} lacks the column(s) {missing}")
    return DomainData(info, splits, path)


def teacher_agreement(path: str | Path) -> float | None:
    """The teacher's agreement with the truth that the domain dataset at `path` records in its
    domain.json (None: no record, or no ground truth); read without loading the dataset."""
    file = Path(path) / DOMAIN_FILE
    agreement = json.loads(file.read_text()).get("teacher_vs_truth") if file.is_file() else None
    return agreement.get("value") if isinstance(agreement, dict) else agreement


def head_target(info: DomainInfo, row: dict) -> Any:
    """What the domain's head is trained towards for one row."""
    if info.task == "count":
        return int(row["count"])
    if info.task == "detect":
        return [list(b) for b in row["boxes"]]
    return row["label"]  # classify label, "yes"/"no" for binary


@dataclass
class Encoded:
    """One item ready for the language model. L = prompt tokens (placeholders expanded)."""

    input_ids: Tensor  # [L]
    position_ids: Tensor  # [3, L] (Qwen M-RoPE) or [L]
    visual_mask: Tensor  # [L] bool, True at the vision placeholders
    visual: Tensor | None  # [N, D] cached vision tower output (N = visual_mask.sum()); None if it trains
    pixels: dict[str, Tensor] | None = None  # processor output for the tower, when it trains
    token_xy: Tensor | None = None  # [L, 2] each visual token's cell centre, -1 on text (heads.grid)

    def extend(self, tokens: Tensor) -> Encoded:
        """The item with text tokens [K] appended (an answer; generated tokens); positions continue."""
        k = tokens.numel()
        step = torch.arange(1, k + 1, device=self.position_ids.device)
        if self.position_ids.dim() == 2:  # text after the vision block advances all three axes alike
            more = self.position_ids[:, -1:].amax(dim=0, keepdim=True) + step[None, :]
            more = more.expand(self.position_ids.shape[0], k)
        else:
            more = self.position_ids[-1] + step
        xy = self.token_xy
        if xy is not None:
            xy = torch.cat([xy, xy.new_full((k, 2), NOT_VISUAL)])
        return Encoded(torch.cat([self.input_ids, tokens.to(self.input_ids)]),
                       torch.cat([self.position_ids, more], dim=-1),
                       torch.cat([self.visual_mask, torch.zeros(k, dtype=torch.bool, device=self.visual_mask.device)]),
                       self.visual, self.pixels, xy)


class Encoder:
    """Row -> `Encoded`, cached per item (`<domain>/<id>`): tokens and positions always, the
    vision tower's output while the tower is frozen (it is the main CPU cost of a step). With a
    training tower the processor's pixels are kept instead and the tower runs every step."""

    def __init__(self, model: torch.nn.Module, processor: Any, cache_visual: bool = True, frames_default: int = 4):
        self.model, self.processor = model, processor
        self.arch = arch_of(model)
        self.cache_visual = cache_visual
        self.cache: dict[str, Encoded] = {}
        self.frames_default = frames_default
        cfg = model.config
        self.placeholder_ids = [i for i in (getattr(cfg, "image_token_id", None),
                                            getattr(cfg, "image_token_index", None),
                                            getattr(cfg, "video_token_id", None)) if i is not None]
        tok = processor.tokenizer
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
        eos = model.generation_config.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, (list, tuple)) else [eos])
        self.answer_end = tok.convert_ids_to_tokens(eos[0] if isinstance(eos, (list, tuple)) else eos)

    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def encode(self, row: dict, info: DomainInfo) -> Encoded:
        return self.encode_many([row], info)[0]

    def has(self, row: dict, info: DomainInfo) -> bool:
        """Whether the item is encoded already (its picture is not needed again)."""
        return _key(info, row) in self.cache

    def encode_many(self, rows: list[dict], info: DomainInfo) -> list[Encoded]:
        """`encode` of a batch: the items not cached yet go through the frozen tower together, one
        call per media kind, instead of one small call each (host-bound on a GPU)."""
        keys = [_key(info, r) for r in rows]
        todo = {k: r for k, r in zip(keys, rows) if k not in self.cache}
        prepared = {k: self._prepare(r, info) for k, r in todo.items()}
        device = self.device()
        groups: dict[tuple, list[str]] = {}
        for k, (_, _, _, pixels, _) in prepared.items():
            groups.setdefault(tuple(sorted(pixels)), []).append(k)
        for group in groups.values():
            visual = [None] * len(group)
            if self.cache_visual:
                merged = {name: torch.cat([prepared[k][3][name] for k in group]).to(device)
                          for name in prepared[group[0]][3]}  # one copy to the device per tensor
                counts = [int(prepared[k][2].sum()) for k in group]  # CPU masks: no wait on the device
                with torch.no_grad():
                    out = visual_features(self.model, merged)
                if out.shape[0] != sum(counts):
                    raise ValueError(f"items {group[:3]}...: {out.shape[0]} visual features for {sum(counts)} "
                                     "placeholders (does the prompt's image/video placeholder match the media?)")
                visual = list(out.split(counts))
            for k, v in zip(group, visual):
                input_ids, positions, mask, pixels, xy = prepared[k]
                pixels = None if self.cache_visual else {n: t.to(device) for n, t in pixels.items()}
                self.cache[k] = Encoded(input_ids.to(device), positions.to(device), mask.to(device), v, pixels,
                                        xy.to(device))
        return [self.cache[k] for k in keys]

    def _prepare(self, row: dict, info: DomainInfo) -> tuple[Tensor, Tensor, Tensor, dict[str, Tensor], Tensor]:
        """One row through the processor: token ids, positions, placeholder mask, pixels and the
        visual tokens' cell centres, all on the CPU (`encode_many` moves them to the device)."""
        prompt = row["prompt"]
        if self._placeholder_text(row["media"]) not in prompt:  # rendered for another chat format
            prompt = self.render_prompt(row["question"], row["media"])
        media = self._media(row)
        kind = "videos" if row["media"] == "clip" else "images"
        # Positions and the placeholder mask are computed on the CPU tensors the processor made:
        # on a GPU, get_rope_index's many small ops and host reads would each wait for the device.
        inputs = self.processor(text=[prompt], return_tensors="pt", **{kind: [media]})
        input_ids = inputs["input_ids"][0]
        positions = rope_positions(self.model, inputs)
        if positions is None:
            positions = torch.arange(input_ids.numel())
        mask = torch.isin(input_ids, torch.tensor(self.placeholder_ids))
        pixels = {k: v for k, v in inputs.items() if k.startswith(("pixel_values", "image_grid", "video_grid"))}
        size = media.size if row["media"] == "image" else (media[0].shape[1], media[0].shape[0])
        xy = visual_token_xy(self.model, self.processor, inputs, mask, [size])
        return input_ids, positions, mask, pixels, xy

    def _placeholder_text(self, media: str) -> str:
        """The token this model's prompts carry for an image or a video (before expansion)."""
        cfg = self.model.config
        if media == "clip":
            token_id = getattr(cfg, "video_token_id", None)
        else:
            token_id = getattr(cfg, "image_token_id", getattr(cfg, "image_token_index", None))
        return self.processor.tokenizer.convert_ids_to_tokens(token_id) if token_id is not None else ""

    def render_prompt(self, question: str, media: str) -> str:
        kind = "video" if media == "clip" else "image"
        messages = [{"role": "user", "content": [{"type": kind}, {"type": "text", "text": question}]}]
        return self.processor.apply_chat_template(messages, add_generation_prompt=True)

    def answer_ids(self, answer: str) -> Tensor:
        """Target tokens of an `lm` answer: the text and the end-of-turn token."""
        text = (" " if self.arch == "llava" else "") + answer + self.answer_end
        ids = self.processor.tokenizer(text, add_special_tokens=False)["input_ids"]
        return torch.tensor(ids, dtype=torch.long, device=self.device())

    def _media(self, row: dict) -> Any:
        if row["media"] == "image":
            if row["image"] is None:
                raise ValueError(f"item {row['id']}: media='image' but the image column is empty")
            return row["image"].convert("RGB")
        if self.arch == "llava":
            raise ValueError(f"item {row['id']}: LLaVA-1.5 takes no video input; train clip domains "
                             "(media='clip') on a Qwen2-VL or Qwen2.5-VL model")
        from world import read_video

        frames = read_video(row["video"])  # BGR uint8
        picks = list(row["frames"]) or np.linspace(0, len(frames) - 1, self.frames_default).round().astype(int)
        bad = [i for i in picks if not 0 <= int(i) < len(frames)]
        if bad:
            raise ValueError(f"item {row['id']}: frame indices {bad} outside the clip's {len(frames)} frames")
        return [np.ascontiguousarray(frames[int(i)][:, :, ::-1]) for i in picks]  # RGB


def _key(info: DomainInfo, row: dict) -> str:
    return f"{info.name}/{row['id']}"


def collate(items: list[Encoded], pad_id: int, answers: list[Tensor] | None = None) -> dict[str, Any]:
    """Right-padded batch. With `answers`, each item gets its answer appended and `labels`
    ([B, T], -100 except on answer tokens) marks what the LM loss is taken on."""
    if answers is not None:
        n_prompt = [it.input_ids.numel() for it in items]
        items = [it.extend(a) for it, a in zip(items, answers)]
    b, t = len(items), max(it.input_ids.numel() for it in items)
    dev = items[0].input_ids.device
    input_ids = torch.full((b, t), pad_id, dtype=torch.long, device=dev)
    mask = torch.zeros(b, t, dtype=torch.long, device=dev)
    vmask = torch.zeros(b, t, dtype=torch.bool, device=dev)
    mrope = items[0].position_ids.dim() == 2
    positions = torch.zeros((3, b, t) if mrope else (b, t), dtype=torch.long, device=dev)
    for i, it in enumerate(items):
        n = it.input_ids.numel()
        input_ids[i, :n], mask[i, :n], vmask[i, :n] = it.input_ids, 1, it.visual_mask
        positions[..., i, :n] = it.position_ids
    batch: dict[str, Any] = {"input_ids": input_ids, "attention_mask": mask, "position_ids": positions,
                             "visual_mask": vmask}
    xy = batch_token_xy(items, t)
    if xy is not None:
        batch["token_xy"] = xy
    if all(it.visual is not None for it in items):
        batch["visual"] = torch.cat([it.visual for it in items], dim=0)  # row-major, as masked_scatter fills
    else:
        batch["pixels"] = [it.pixels for it in items]
    if answers is not None:
        labels = torch.full((b, t), -100, dtype=torch.long, device=dev)
        for i, (it, n0) in enumerate(zip(items, n_prompt)):
            labels[i, n0:it.input_ids.numel()] = it.input_ids[n0:]
        batch["labels"] = labels
    return batch


def batch_token_xy(items: list[Encoded], length: int | None = None) -> Tensor | None:
    """[B, T, 2] cell centres of a right-padded batch (padding NOT_VISUAL); None when an item has none."""
    if any(it.token_xy is None for it in items):
        return None
    length = length or max(it.token_xy.shape[0] for it in items)
    out = items[0].token_xy.new_full((len(items), length, 2), NOT_VISUAL)
    for i, it in enumerate(items):
        out[i, :it.token_xy.shape[0]] = it.token_xy
    return out
