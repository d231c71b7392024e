"""The check at a stream's start: does it show the model and its shadow teacher frames of the
size that the task's domain was distilled at?

An adapter learns from chunks of one size (what `vlora distill` wrote: `chunk_size` in the
domain's domain.json, the world's size for a world domain) and its teacher labelled frames of
one size (`frame_size`: the recording's own). A stream that resizes to another size asks the
adapter about frames it never saw, and a shadow teacher on a source of another size answers
another question (a detector at 448x336 counts 0-2 people where it counts 1-7 at 768x576), with
nothing in the numbers to say so. One line per task says so instead:

    stream door, task count: the model gets 448x336 frames, domain 'people' was distilled from
    768x576 chunks (set the stream's width/height to 768x576, or distil at 448x336)

The domain is the manifest's choice for the task; its dataset is the one the adapter's meta.json
records (`domains.<name>.dataset`), else `<datasets_dir>/<name>`. A domain with no recorded size
(images of many sizes, an older dataset), or a source whose size cannot be told before it opens
(a URL, a webcam), is not checked.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from adapters.manifest import select_adapter
from apps.common.routing import Route

from .config import StreamConfig
from .sources import source_kind

Size = tuple[int, int]


def _size(value: Any) -> Size | None:
    if isinstance(value, (list, tuple)) and len(value) == 2 and all(isinstance(v, int) and v > 0 for v in value):
        return int(value[0]), int(value[1])
    return None


def distilled_sizes(meta: dict[str, Any]) -> tuple[Size | None, Size | None]:
    """(the size of the chunks the adapter learnt from, the size of the frames the teacher labelled)
    as a domain.json records them: a recording's `source.chunk_size` / `source.frame_size`, a
    world domain's world size for both; None where nothing is recorded."""
    source = meta.get("source") or {}
    if source.get("kind") == "video":
        return _size(source.get("chunk_size")), _size(source.get("frame_size"))
    world = (meta.get("world") or {}).get("config") or {}
    size = _size([world.get("width"), world.get("height")])
    return size, size


def domain_meta(manifest: dict[str, Any], domain: str, datasets_dir: str | None = None) -> dict[str, Any] | None:
    """The domain.json of the dataset `domain` was trained on, or None when it cannot be found."""
    candidates = []
    adapter = manifest["tasks"].get(domain, {}).get("adapter")
    for entry in manifest["adapters"]:
        if entry["name"] == adapter:
            meta_file = Path(entry["path"]) / "meta.json"
            try:
                dataset = json.loads(meta_file.read_text())["domains"][domain]["dataset"]
            except (OSError, ValueError, KeyError, TypeError):  # no record: the datasets folder may still hold it
                continue
            candidates.append(Path(dataset))
    if datasets_dir:
        candidates.append(Path(datasets_dir) / domain)
    for folder in candidates:
        try:
            meta = json.loads((folder / "domain.json").read_text())
        except (OSError, ValueError):
            continue
        if isinstance(meta, dict):
            return meta
    return None


def source_size(config: StreamConfig) -> Size | None:
    """The source's frame size when it can be told before the stream opens: the synthetic
    camera's world, a video file's header; None for URLs and webcams."""
    kind = source_kind(config.source) if config.source_kind == "auto" else config.source_kind
    if kind == "synthetic":
        from world import WorldConfig

        try:
            world = WorldConfig(**config.world)
        except (TypeError, ValueError):  # the stream's reader reports a bad world when it opens the source
            return None
        return world.width, world.height
    if kind != "file" or not Path(str(config.source)).is_file():
        return None
    import cv2

    cap = cv2.VideoCapture(str(config.source))
    try:
        size = int(cap.get(cv2.CAP_PROP_FRAME_WIDTH)), int(cap.get(cv2.CAP_PROP_FRAME_HEIGHT))
    finally:
        cap.release()
    return size if size[0] > 0 and size[1] > 0 else None


def _wxh(size: Size) -> str:
    return f"{size[0]}x{size[1]}"


def resolution_warnings(config: StreamConfig, routes: dict[str, Route], manifest: dict[str, Any] | None,
                        datasets_dir: str | None = None) -> list[str]:
    """One line per task whose stream shows the model (or its shadow teacher, the source) frames of
    another size than its domain's distillation recorded; [] when every size matches or is unknown."""
    if manifest is None:
        return []
    source = source_size(config)
    model = (config.chunk.width, config.chunk.height) if config.chunk.width else source
    lines = []
    for spec in config.tasks:
        route = routes.get(spec.label)
        if route is None or route.selected is None:  # no domain chosen: nothing was distilled for it
            continue
        try:
            chosen = select_adapter(manifest, spec.key, spec.accuracy_target, spec.question())
        except KeyError:
            continue
        meta = None if chosen is None else domain_meta(manifest, chosen.domain, datasets_dir)
        if meta is None:
            continue
        chunks, frames = distilled_sizes(meta)
        problems = []
        if model is not None and chunks is not None and model != chunks:
            problems.append(f"the model gets {_wxh(model)} frames, domain {chosen.domain!r} was distilled from "
                            f"{_wxh(chunks)} chunks (set the stream's width/height to {_wxh(chunks)}, or distil at "
                            f"{_wxh(model)})")
        shadowed = spec.shadow if spec.shadow is not None else config.shadow
        if shadowed and source is not None and frames is not None and source != frames:
            problems.append(f"its shadow teacher sees the source's {_wxh(source)} frames, distillation's teacher "
                            f"labelled {_wxh(frames)} frames (agreement compares answers to different pictures)")
        if problems:
            lines.append(f"stream {config.name}, task {spec.label}: " + "; ".join(problems))
    return lines


__all__ = ["resolution_warnings", "distilled_sizes", "domain_meta", "source_size"]
