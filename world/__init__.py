"""Synthetic vision world: seeded road scenes and short clips with exact ground truth.

Item i of a world depends only on (config, kind, i): `render_image(cfg, i)` and
`render_clip(cfg, i)` always give the same pixels and truth. Truth records carry boxes, classes,
colours, per-class counts and, for clips, per-frame boxes and each track's direction; `qa.py`
turns them into questions, captions and referring expressions; `write_world` stores a world on
disk (resumably) and `load_world` reads it back. `sampling` holds how any video (a world clip or a
camera recording) is sampled and cut into chunks, shared by the video app and the distiller.
"""
from .io import WorldIndex, WorldItem, load_world, read_video, write_video, write_world
from .qa import QAPair, caption, qa_pairs, referring_expressions
from .render import draw_truth, render_clip, render_image
from .config import CLASS_SIZES, COLORS, DIRECTIONS, WorldConfig
from .sampling import ChunkConfig, FrameSampler, resize_frame
from .scene import ClipTruth, FrameTruth, ImageTruth, ObjectTruth, truth_from_dict

__all__ = [
    "WorldConfig", "ObjectTruth", "FrameTruth", "ImageTruth", "ClipTruth", "truth_from_dict",
    "COLORS", "CLASS_SIZES", "DIRECTIONS",
    "render_image", "render_clip", "draw_truth",
    "QAPair", "qa_pairs", "caption", "referring_expressions",
    "write_video", "read_video", "write_world", "load_world", "WorldIndex", "WorldItem",
    "ChunkConfig", "FrameSampler", "resize_frame",
]
