"""Pretraining data: synthetic world scenes with multi-turn conversations and region captions.

Each example is one rendered image (or one clip's frames) and a few question/answer turns drawn
from its exact truth: the caption (counts per class), the world's QA pairs (counts, existence,
colours, clip directions), referring expressions with their box, and an object list. Several
turns share one pass of the vision tower, which is the cost that dominates on a CPU. The
conversation is rendered with the model's own chat template and tokenised segment by segment,
so the answers (and their end-of-turn token) are exactly the supervised tokens.

Region captions (`dense_targets`): for every visual token, the class and colour of the object
covering its cell, whether an object's centre lies in it, and (clips) that object's motion.
Text answers alone supervise a few tokens per image, and a random-weight model learns the
language prior from them long before it learns to look; one label per visual token is what
makes the vision tower learn within a CPU budget of minutes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from world import DIRECTIONS, WorldConfig, caption, qa_pairs, referring_expressions, render_clip, render_image
from world.qa import plural
from world.scene import VEHICLES

KINDS = ("caption", "count", "vehicles", "exists", "color", "biggest", "direction", "motion", "where", "find",
         "objects")


def box_text(box, width: int, height: int) -> str:
    """A box as integer percentages of the frame: "(12, 30, 25, 41)" (x1, y1, x2, y2)."""
    x1, y1, x2, y2 = box
    return "({}, {}, {}, {})".format(*(int(round(100 * v)) for v in (x1 / width, y1 / height,
                                                                      x2 / width, y2 / height)))


def conversation(truth, rng: np.random.Generator, turns: int) -> list[tuple[str, str]]:
    """Up to `turns` (question, answer) pairs about one item, each of a different kind where possible."""
    video = truth.kind == "clip"
    pool: dict[str, list[tuple[str, str]]] = {k: [] for k in KINDS}
    pool["caption"].append((f"Describe the {'video' if video else 'image'}.", caption(truth)))
    for q in qa_pairs(truth, rng):
        pool[q.kind].append((q.question, q.answer))
    for expr, box in referring_expressions(truth):
        pool["where"].append((f"Where is {expr}?", box_text(box, truth.width, truth.height)))
    objs = sorted(truth.objects, key=lambda o: (o.box[0], o.box[1]))  # left to right
    listed = ", ".join(f"{o.color} {o.cls}" for o in objs) or "nothing"
    pool["objects"].append(("List the objects from left to right.", listed))
    for cls, n in truth.counts.items():  # every class, so absent ones (answer 0) are asked too
        pool["count"].append((f"How many {plural(cls)} are there?", str(n)))
        pool["exists"].append((f"Is there {'an' if cls[0] in 'aeiou' else 'a'} {cls}?", "yes" if n else "no"))
        found = sorted((o.box for o in truth.objects if o.cls == cls), key=lambda b: (b[0], b[1]))
        pool["find"].append((f"Where are the {plural(cls)}?",
                             "; ".join(box_text(b, truth.width, truth.height) for b in found) or "none"))
    pool["vehicles"].append(("How many vehicles are there?", str(sum(truth.counts.get(c, 0) for c in VEHICLES))))
    if truth.objects:
        big = max(truth.objects, key=lambda o: ((o.box[2] - o.box[0]) * (o.box[3] - o.box[1]), -o.track_id))
        pool["biggest"].append(("What is the biggest object?", f"{big.color} {big.cls}"))
        if video:
            pool["motion"].append(("Which way is the biggest object moving?", truth.directions[big.track_id]))
    kinds = [k for k in KINDS if pool[k]]
    picked = []
    for k in rng.permutation(kinds)[:turns]:
        options = pool[str(k)]
        picked.append(options[int(rng.integers(len(options)))])
    return picked


DIRECTION_LABELS = ("none",) + tuple(DIRECTIONS)


@dataclass
class Example:
    media: list[np.ndarray]  # one RGB image, or the clip's RGB frames
    video: bool
    turns: list[tuple[str, str]]
    frame_objects: list[list]  # ObjectTruth lists: [objects] for an image, one list per frame for a clip
    directions: dict[int, str] | None  # clips: track id -> direction
    size: tuple[int, int]  # (width, height) of the frames


def sample_example(world: WorldConfig, index: int, video: bool, turns: int, frames: int, seed: int) -> Example:
    """Item `index` of the pretraining stream (deterministic in world, index, video and seed).

    A clip is rendered with `frames` frames over the usual one-second motion, which is what
    picking that many evenly spaced frames of a longer clip shows, at a fraction of the cost.
    """
    rng = np.random.default_rng([seed, index, int(video)])
    if video:
        clip, truth = render_clip(dataclasses.replace(world, clip_frames=frames), index)
        media = [np.ascontiguousarray(f[:, :, ::-1]) for f in clip]
        objects, directions = [f.objects for f in truth.frames], truth.directions
    else:
        image, truth = render_image(world, index)
        media, objects, directions = [np.ascontiguousarray(image[:, :, ::-1])], [truth.objects], None
    return Example(media, video, conversation(truth, rng, turns), objects, directions, (truth.width, truth.height))


def dense_targets(ex: Example, grid: tuple[int, int, int], classes: tuple[str, ...],
                  colors: tuple[str, ...]) -> Tensor:
    """[t*h*w, 8] int64 per visual token (row-major over time, rows, columns): class (0 = none),
    colour (0 = none), 1 if an object's centre is in the cell, direction (0 = none; -100 for
    images), and the box (x1, y1, x2, y2) of the cell's object in thousandths of the frame (-1
    for none). Predicting an absolute box from one token makes the tokens aware of where they are.

    A cell belongs to the object covering most of it, if that covers at least a quarter of the
    cell or of the object. Temporal token k of a clip spans frames (2k, 2k+1); it is labelled
    from frame 2k.
    """
    t, h, w = grid
    width, height = ex.size
    cw, ch = width / w, height / h
    out = np.zeros((t, h, w, 8), dtype=np.int64)
    out[..., 4:] = -1
    cover = np.zeros((t, h, w))  # area of the object a cell is labelled with
    if not ex.video:
        out[..., 3] = -100
    per_token = max(1, len(ex.frame_objects) // t)
    for k in range(t):
        for o in ex.frame_objects[min(k * per_token, len(ex.frame_objects) - 1)]:
            x1, y1, x2, y2 = o.box
            area = max(1, (x2 - x1) * (y2 - y1))
            cx, cy = min(int((x1 + x2) / 2 / cw), w - 1), min(int((y1 + y2) / 2 / ch), h - 1)
            out[k, cy, cx, 2] = 1
            for i in range(int(y1 // ch), min(h, int(np.ceil(y2 / ch)))):
                for j in range(int(x1 // cw), min(w, int(np.ceil(x2 / cw)))):
                    inter = (min(x2, (j + 1) * cw) - max(x1, j * cw)) * (min(y2, (i + 1) * ch) - max(y1, i * ch))
                    if inter < 0.25 * min(cw * ch, area) or inter <= cover[k, i, j]:
                        continue
                    cover[k, i, j] = inter
                    out[k, i, j, 0] = 1 + classes.index(o.cls)
                    out[k, i, j, 1] = 1 + colors.index(o.color)
                    out[k, i, j, 4:] = [round(1000 * v) for v in (x1 / width, y1 / height, x2 / width, y2 / height)]
                    if ex.video:
                        out[k, i, j, 3] = DIRECTION_LABELS.index(ex.directions[o.track_id])
    return torch.from_numpy(out.reshape(-1, 8))


def encode_example(processor, ex: Example, classes: tuple[str, ...], colors: tuple[str, ...],
                   placeholder_ids: list[int]) -> dict[str, Tensor]:
    """input_ids [L], labels [L] (-100 off the answers), mm_token_type_ids [L] if the processor
    makes them, the pixel tensors of the item and `dense` [N_visual, 8] region targets."""
    kind = "video" if ex.video else "image"
    messages, texts = [], []
    for i, (q, a) in enumerate(ex.turns):
        content = ([{"type": kind}] if i == 0 else []) + [{"type": "text", "text": q}]
        messages.append({"role": "user", "content": content})
        texts.append(processor.apply_chat_template(messages, add_generation_prompt=True))
        messages.append({"role": "assistant", "content": [{"type": "text", "text": a}]})
        texts.append(processor.apply_chat_template(messages))
    media = {"videos": [ex.media]} if ex.video else {"images": ex.media}
    first = processor(text=[texts[0]], return_tensors="pt", **media)
    ids, labels = [first["input_ids"][0]], [torch.full_like(first["input_ids"][0], -100)]
    types = [first["mm_token_type_ids"][0]] if "mm_token_type_ids" in first else None
    tok = processor.tokenizer
    for k in range(1, len(texts)):
        prev, cur = texts[k - 1], texts[k]
        if not cur.startswith(prev):
            raise ValueError("the chat template does not render a conversation as a growing prefix; "
                             "pretraining needs that to find the answer tokens")
        seg = cur[len(prev):]
        # Answer turns: the answer and its end-of-turn token are supervised, trailing format is not.
        parts = [(seg.rstrip(), True), (seg[len(seg.rstrip()):], False)] if k % 2 == 1 else [(seg, False)]
        for text, supervised in parts:
            if not text:
                continue
            piece = torch.tensor(tok(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
            ids.append(piece)
            labels.append(piece if supervised else torch.full_like(piece, -100))
            if types is not None:
                types.append(torch.zeros_like(piece, dtype=types[0].dtype))
    out = {"input_ids": torch.cat(ids), "labels": torch.cat(labels)}
    n_visual = int(torch.isin(first["input_ids"][0], torch.tensor(placeholder_ids)).sum())
    grid = first.get("video_grid_thw" if ex.video else "image_grid_thw")
    if grid is not None:  # Qwen: patches (t, h, w), merged merge x merge in space
        merge = int(processor.image_processor.merge_size)
        t, h, w = (int(v) for v in grid[0])
        grid = (t, h // merge, w // merge)
    else:  # LLaVA: a square grid of patches
        side = int(round(n_visual ** 0.5))
        grid = (1, side, side)
    if grid[0] * grid[1] * grid[2] != n_visual:
        raise ValueError(f"visual grid {grid} does not match the {n_visual} visual tokens of the prompt")
    out["dense"] = dense_targets(ex, grid, classes, colors)
    if types is not None:
        out["mm_token_type_ids"] = torch.cat(types)
    for k, v in first.items():
        if k.startswith(("pixel_values", "image_grid", "video_grid", "second_per_grid")):
            out[k] = v
    return out


def encode_pixels(processor, ex: Example, classes: tuple[str, ...], colors: tuple[str, ...]) -> dict[str, Tensor]:
    """Only what the vision tower needs (pixels, grid) and the region targets: no text."""
    if ex.video:
        out = dict(processor.video_processor(videos=[ex.media], return_tensors="pt"))
        grid = out["video_grid_thw"]
    else:
        out = dict(processor.image_processor(images=ex.media, return_tensors="pt"))
        grid = out.get("image_grid_thw")
    if grid is not None:
        merge = int(processor.image_processor.merge_size)
        t, h, w = (int(v) for v in grid[0])
        shape = (t, h // merge, w // merge)
    else:  # LLaVA: one visual token per patch of the square crop
        side = out["pixel_values"].shape[-1] // processor.patch_size
        shape = (1, side, side)
    out = {k: v for k, v in out.items() if k.startswith(("pixel_values", "image_grid", "video_grid"))}
    out["dense"] = dense_targets(ex, shape, classes, colors)
    return out


def collate_examples(encoded: list[dict[str, Tensor]], pad_id: int) -> dict[str, Tensor]:
    """Right-padded batch in the model's own forward() format (labels included); items from
    `encode_pixels` (no text) give the pixel tensors and region targets only."""
    if "input_ids" not in encoded[0]:
        return {key: torch.cat([e[key] for e in encoded], dim=0) for key in encoded[0]}
    b, t = len(encoded), max(e["input_ids"].numel() for e in encoded)
    batch = {"input_ids": torch.full((b, t), pad_id, dtype=torch.long),
             "attention_mask": torch.zeros(b, t, dtype=torch.long),
             "labels": torch.full((b, t), -100, dtype=torch.long)}
    if "mm_token_type_ids" in encoded[0]:
        batch["mm_token_type_ids"] = torch.zeros(b, t, dtype=encoded[0]["mm_token_type_ids"].dtype)
    for i, e in enumerate(encoded):
        n = e["input_ids"].numel()
        batch["input_ids"][i, :n], batch["attention_mask"][i, :n], batch["labels"][i, :n] = \
            e["input_ids"], 1, e["labels"]
        if "mm_token_type_ids" in batch:
            batch["mm_token_type_ids"][i, :n] = e["mm_token_type_ids"]
    batch["dense"] = torch.cat([e["dense"] for e in encoded], dim=0)  # row-major, like hidden[visual_mask]
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts"):
        parts = [e[key] for e in encoded if key in e]
        if parts:
            batch[key] = torch.cat(parts, dim=0)
    return batch
