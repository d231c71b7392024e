"""Where a domain's frames come from: the synthetic world (default), a user's video or images, or
labelled data read as truth. A domain's `source` (conf/dataset/*.yaml) is one of:

    {kind: world}                                   the synthetic world of the domain's seed (default)
    {kind: video, path: cam.mp4, sample_fps: 2, chunk_seconds: 1 (or chunk_frames: 2),
     frames_per_chunk: 2, width: 112, height: 112}  a recording, cut into chunks as the video app does
    {kind: images, path: folder}                    unlabelled images (every image under the folder)
    {kind: image_folder, path: folder}              labelled: one sub-folder per class
    {kind: coco, path: annotations.json, images: dir}          labelled boxes (COCO json)
    {kind: yolo, path: dir, names: [car, person]}   labelled boxes: images/ and labels/ (YOLO txt);
                                                    names may come from <dir>/data.yaml instead
    {kind: hf, path: dir, image_column: image, label_column: label, split: train}
                                                    a datasets.Dataset / DatasetDict saved with save_to_disk

Each source lists its `Item`s (id, what the model reads: an image or a clip file, the truth of
labelled data) and yields the teacher's view of them as `Sample`s. Video chunks are written once
as small clip files under the distillation world dir (see distill_video).
"""
from __future__ import annotations

import dataclasses
import hashlib
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from .teachers import DataObject, DataTruth, Sample

KINDS = ("world", "video", "images", "image_folder", "coco", "yolo", "hf")
LABELLED = frozenset({"image_folder", "coco", "yolo", "hf"})
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".tif", ".tiff")
VIDEO_KEYS = ("sample_fps", "chunk_seconds", "chunk_frames", "frames_per_chunk", "width", "height", "fps")
KEYS = {"world": (), "video": ("path",) + VIDEO_KEYS, "images": ("path",), "image_folder": ("path",),
        "coco": ("path", "images"), "yolo": ("path", "names"),
        "hf": ("path", "image_column", "label_column", "split")}


class SourceError(ValueError):
    """A data source that is configured wrongly or cannot be read; the message says what would do."""


@dataclass(frozen=True)
class SourceSpec:
    kind: str = "world"
    path: str | None = None
    images: str | None = None            # coco: the image directory (default: next to the json)
    names: tuple[str, ...] | None = None  # yolo: class names by index
    image_column: str = "image"          # hf
    label_column: str | None = "label"   # hf (null: unlabelled)
    split: str = "train"                 # hf: the split of a DatasetDict
    sample_fps: float | None = None      # video: as the app's stream config
    chunk_seconds: float = 1.0
    chunk_frames: int | None = None
    frames_per_chunk: int | None = None  # video: frames of a chunk the model sees (null: all, as the app sends)
    width: int | None = None
    height: int | None = None
    fps: float | None = None             # video: the file's frame rate when it reports none

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None, where: str) -> "SourceSpec":
        d = dict(d or {})
        kind = d.get("kind", "world")
        if kind not in KINDS:
            raise SourceError(f"{where}: source kind {kind!r} is not one of {list(KINDS)}")
        unknown = sorted(set(d) - {"kind"} - set(KEYS[kind]))
        if unknown:
            raise SourceError(f"{where}: source kind {kind!r} takes {sorted(KEYS[kind])}, not {unknown}")
        if kind != "world" and not d.get("path"):
            raise SourceError(f"{where}: source kind {kind!r} needs path")
        if d.get("names") is not None:
            d["names"] = tuple(str(n) for n in d["names"])
        spec = cls(**d)
        if kind == "video":
            spec.chunk_config(where)  # checks the chunking fields
            for key in ("width", "height"):
                v = getattr(spec, key)
                if v is not None and v % 2:
                    raise SourceError(f"{where}: source {key} must be even (video encoders need it), got {v}")
            fpc = spec.frames_per_chunk
            if fpc is not None and (isinstance(fpc, bool) or not isinstance(fpc, int) or fpc < 1):
                raise SourceError(f"{where}: source frames_per_chunk must be an int >= 1 or null, got {fpc!r}")
        return spec

    def chunk_config(self, where: str = "source"):
        from world.sampling import ChunkConfig

        try:
            return ChunkConfig(self.sample_fps, self.chunk_seconds, self.chunk_frames, self.width, self.height)
        except ValueError as e:
            raise SourceError(f"{where}: source {e}") from None

    @property
    def media(self) -> str:
        return "clip" if self.kind == "video" else "image"

    @property
    def labelled(self) -> bool:
        return self.kind in LABELLED

    def to_dict(self) -> dict[str, Any]:
        """The given fields only (defaults left out), as the config wrote them."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) != f.default or f.name == "kind"}


@dataclass
class Item:
    """One thing the model is asked about: an image, or a video chunk written as a clip file."""
    id: str
    media: str
    truth: Any = None
    image_file: Path | None = None   # images: the file (its bytes go into the dataset as they are)
    image_bytes: bytes | None = None  # hf images: PNG bytes
    video: str = ""                   # clips: the clip file the model reads
    n_frames: int = 0                 # clips: frames in that file
    time: float | None = None         # video: source time of the chunk's first frame (the split's order)
    extra: dict = field(default_factory=dict)

    def media_fields(self) -> dict[str, Any]:
        if self.media == "clip":
            return {"image": None, "video": self.video}
        data = self.image_bytes if self.image_bytes is not None else self.image_file.read_bytes()
        return {"image": {"bytes": data, "path": None}, "video": ""}


def file_identity(path: Path, edge: int = 1 << 20) -> str:
    """A cheap identity of a (possibly large) file: its size and its first and last MiB."""
    h = hashlib.sha256(str(path.stat().st_size).encode())
    with open(path, "rb") as f:
        h.update(f.read(edge))
        f.seek(max(0, path.stat().st_size - edge))
        h.update(f.read(edge))
    return h.hexdigest()[:16]


def _rgb_file(path: Path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as im:
        return np.ascontiguousarray(np.asarray(im.convert("RGB")))


def _image_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())


class ImageSource:
    """Images from files or a saved Hugging Face dataset, with labels when the kind has them."""

    media = "image"

    def __init__(self, spec: SourceSpec, where: str):
        self.spec, self.where = spec, where
        self.classes: tuple[str, ...] | None = None  # object classes the labels use
        self.labels: tuple[str, ...] | None = None   # image-level labels (class folders, a label column)
        root = Path(spec.path)
        if not root.exists():
            raise SourceError(f"{where}: source path {root} does not exist")
        self.items: list[Item] = getattr(self, f"_read_{spec.kind}")(root)
        if not self.items:
            raise SourceError(f"{where}: source {spec.kind} at {root} holds no images "
                              f"(image files end in {', '.join(IMAGE_SUFFIXES)})")

    def _read_images(self, root: Path) -> list[Item]:
        return [Item(f"image-{i:06d}", "image", None, p) for i, p in enumerate(_image_files(root))]

    def _read_image_folder(self, root: Path) -> list[Item]:
        folders = sorted(p for p in root.iterdir() if p.is_dir())
        if len(folders) < 2:
            raise SourceError(f"{self.where}: an image_folder source has one sub-folder per class (at least 2); "
                              f"{root} has {[p.name for p in folders]}")
        self.labels = tuple(p.name for p in folders)
        files = [(d.name, p) for d in folders for p in _image_files(d)]
        return [Item(f"image-{i:06d}", "image", DataTruth(label=label), p) for i, (label, p) in enumerate(files)]

    def _read_coco(self, root: Path) -> list[Item]:
        data = json.loads(root.read_text())
        cats = {c["id"]: c["name"] for c in data.get("categories", [])}
        self.classes = tuple(cats[k] for k in sorted(cats))
        image_dir = Path(self.spec.images) if self.spec.images else root.parent
        objects: dict[int, list[DataObject]] = {}
        for n, a in enumerate(data.get("annotations", [])):
            x, y, w, h = a["bbox"]
            objects.setdefault(a["image_id"], []).append(DataObject(cats[a["category_id"]], (x, y, x + w, y + h), n))
        items = []
        for i, im in enumerate(sorted(data.get("images", []), key=lambda im: im["id"])):
            file = image_dir / im["file_name"]
            if not file.is_file():
                raise SourceError(f"{self.where}: COCO image {file} is missing (set source.images to the image dir)")
            items.append(Item(f"image-{i:06d}", "image", DataTruth(objects.get(im["id"], [])), file))
        return items

    def _read_yolo(self, root: Path) -> list[Item]:
        names = self.spec.names
        if names is None and (root / "data.yaml").is_file():
            import yaml

            raw = yaml.safe_load((root / "data.yaml").read_text()).get("names")
            names = tuple(raw[k] for k in sorted(raw)) if isinstance(raw, dict) else tuple(raw or ())
        if not names:
            raise SourceError(f"{self.where}: a yolo source needs names (class names by index), or {root}/data.yaml")
        self.classes = tuple(names)
        items = []
        for i, file in enumerate(_image_files(root / "images")):
            rel = file.relative_to(root / "images").with_suffix(".txt")
            label = root / "labels" / rel
            w, h = _image_size(file)
            objs = []
            for n, line in enumerate(label.read_text().splitlines() if label.is_file() else []):
                if not line.strip():
                    continue
                c, cx, cy, bw, bh = line.split()[:5]
                if not 0 <= int(c) < len(names):
                    raise SourceError(f"{self.where}: {label} uses class {c}; names has {len(names)} entries")
                cx, cy, bw, bh = float(cx) * w, float(cy) * h, float(bw) * w, float(bh) * h
                objs.append(DataObject(names[int(c)], (cx - bw / 2, cy - bh / 2, cx + bw / 2, cy + bh / 2), n))
            items.append(Item(f"image-{i:06d}", "image", DataTruth(objs), file))
        return items

    def _read_hf(self, root: Path) -> list[Item]:
        from datasets import DatasetDict, load_from_disk

        ds = load_from_disk(str(root))
        if isinstance(ds, DatasetDict):
            if self.spec.split not in ds:
                raise SourceError(f"{self.where}: dataset {root} has splits {list(ds)}, not {self.spec.split!r}")
            ds = ds[self.spec.split]
        col, lab = self.spec.image_column, self.spec.label_column
        for c in (col, lab):
            if c is not None and c not in ds.column_names:
                raise SourceError(f"{self.where}: dataset {root} has no column {c!r}; columns: {ds.column_names}")
        names = getattr(ds.features.get(lab), "names", None) if lab else None
        values = ds[lab] if lab else [None] * len(ds)
        labels = [None if v is None else names[v] if names else str(v) for v in values]
        if lab:
            self.labels = tuple(names) if names else tuple(sorted(set(labels)))
        items = []
        for i, (im, label) in enumerate(zip(ds[col], labels)):
            buf = io.BytesIO()
            im.convert("RGB").save(buf, format="PNG")
            items.append(Item(f"image-{i:06d}", "image", None if label is None else DataTruth(label=label),
                              image_bytes=buf.getvalue()))
        return items

    def samples(self, items: list[Item]) -> Iterator[Sample]:
        from PIL import Image

        for it in items:
            frame = (_rgb_file(it.image_file) if it.image_file is not None
                     else np.asarray(Image.open(io.BytesIO(it.image_bytes)).convert("RGB")))
            yield Sample(it.id, "image", [frame], it.truth)

    def fingerprint(self) -> str:
        h = hashlib.sha256()
        root = Path(self.spec.path)
        for p in ([root] if root.is_file() else sorted(root.rglob("*"))):
            if p.is_file():
                h.update(f"{p.relative_to(root) if p != root else p.name}:{p.stat().st_size}".encode())
                if p.suffix.lower() in (".json", ".txt", ".yaml"):  # labels; a saved dataset's state.json
                    h.update(p.read_bytes())
        return h.hexdigest()[:16]

    def record(self) -> dict[str, Any]:
        return {**self.spec.to_dict(), "path": str(Path(self.spec.path).resolve()), "items": len(self.items),
                "classes": list(self.classes) if self.classes else None,
                "labels": list(self.labels) if self.labels else None}


def _image_size(path: Path) -> tuple[int, int]:
    from PIL import Image

    with Image.open(path) as im:
        return im.size


def pick(items: list[Item], size: int | None) -> list[Item]:
    """At most `size` items, evenly spread over the source in its order (all when size is None)."""
    if size is None or size >= len(items):
        return list(items)
    idx = np.linspace(0, len(items) - 1, size).round().astype(int)
    return [items[i] for i in sorted(set(idx.tolist()))]


__all__ = ["SourceSpec", "SourceError", "Item", "ImageSource", "KINDS", "LABELLED", "pick", "file_identity"]
