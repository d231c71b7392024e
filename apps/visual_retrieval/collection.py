"""An image collection: the image files under a directory, named by their path relative to it,
with ground truth when the directory is (part of) a synthetic world written by `vlora world`."""

from __future__ import annotations

import io
import os
from pathlib import Path

import cv2
import numpy as np
from PIL import Image

from world import WorldItem, load_world

SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp")


class BadImage(IOError):
    """An image file of the collection that cannot be read whole: an input error, never sent."""


class ImageCollection:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        if not self.root.is_dir():
            raise FileNotFoundError(f"image collection {self.root} is not a directory")
        self.names = sorted(p.relative_to(self.root).as_posix() for p in self.root.rglob("*")
                            if p.suffix.lower() in SUFFIXES and ".part." not in p.name)
        if not self.names:
            raise ValueError(f"image collection {self.root} holds no images ({', '.join(SUFFIXES)})")
        self._truth: dict[str, WorldItem] = {}
        world = next((d for d in (self.root, self.root.parent) if (d / "world.json").exists()), None)
        if world is not None:
            for item in load_world(world).images:
                name = os.path.relpath(item.path, self.root).replace(os.sep, "/")
                if name in self.names:
                    self._truth[name] = item

    def __len__(self) -> int:
        return len(self.names)

    @property
    def has_truth(self) -> bool:
        return bool(self._truth)

    def path(self, name: str) -> Path:
        if name not in self.names:
            shown = ", ".join(self.names[:5]) + (" ..." if len(self.names) > 5 else "")
            raise KeyError(f"no image {name!r} in {self.root} (have {len(self.names)}: {shown})")
        return self.root / name

    def load(self, name: str) -> np.ndarray:
        """The image as BGR uint8 [H, W, 3]. A truncated or corrupt file raises BadImage: OpenCV
        decodes what it can of a truncated JPEG and fills the rest grey, so the whole file is first
        decoded by PIL, which refuses one that ends early or does not decode."""
        path = self.path(name)
        data = path.read_bytes()
        try:
            with Image.open(io.BytesIO(data)) as probe:
                probe.load()
        except Exception as e:  # PIL raises OSError, SyntaxError, ValueError... for a bad file
            raise BadImage(f"image {name!r} is truncated or corrupt ({type(e).__name__}: {e})") from None
        image = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
        if image is None:
            raise BadImage(f"image {name!r}: OpenCV cannot decode {path}")
        return image

    def truth(self, name: str) -> WorldItem | None:
        return self._truth.get(name)
