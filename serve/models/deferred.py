"""Qwen vision inputs whose pixels are prepared where the tower runs (`pixels="device"`).

On the host, a request costs only what the prompt needs: each image's and clip's size (from the
array, or from a JPEG/PNG header without decoding), its patch grid, the placeholder count and a
content hash. The frames stay uint8 (or still encoded JPEG bytes) in a `Deferred` and become
pixel rows at encode time, one batched call per shape on the engine's device
(`materialize`): decoded there (nvJPEG through torchvision when the device is a GPU, OpenCV
otherwise), resized, normalised and patchified by `pixels.qwen_pixels`. Items the encoder
cache already holds are never decoded at all.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import numpy as np
import torch

from .pixels import QwenPixelSpec, qwen_pixels


@dataclass
class Deferred:
    """Raw frames of one image (T = 1) or clip: uint8 [T, H, W, 3], or T encoded JPEG frames."""

    frames: np.ndarray | torch.Tensor | list[bytes]
    source: tuple[int, int]  # (height, width) of the frames as sent
    size: tuple[int, int]  # target (height, width) after the processor's resize
    spec: QwenPixelSpec

    @property
    def encoded(self) -> bool:
        return isinstance(self.frames, list)

    def slice(self, start: int, stop: int) -> "Deferred":
        return Deferred(self.frames[start:stop], self.source, self.size, self.spec)


def jpeg_size(data: bytes) -> tuple[int, int] | None:
    """(height, width) of JPEG bytes from the header, or None when the bytes are not a JPEG."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as im:
            if im.format != "JPEG" or im.mode not in ("RGB", "L", "YCbCr"):
                return None
            return im.height, im.width
    except Exception:  # noqa: BLE001 - anything PIL cannot parse is decoded (and refused) the usual way
        return None


def _decode_cpu(frames: list[bytes]) -> np.ndarray:
    import cv2

    out = []
    for data in frames:
        image = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
        if image is None:
            raise ValueError("a JPEG frame could not be decoded")
        out.append(image[..., ::-1])  # BGR -> RGB
    return np.ascontiguousarray(np.stack(out))


_DECODE_STREAMS: dict = {}  # device -> the stream nvJPEG's outputs are allocated on


def _decode(frames: list[bytes], device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        try:
            from torchvision.io import ImageReadMode, decode_jpeg
        except ImportError:
            decode_jpeg = None
        if decode_jpeg is not None:
            data = [torch.frombuffer(bytearray(f), dtype=torch.uint8) for f in frames]
            # torchvision allocates the outputs on the current stream but nvJPEG writes them on a stream
            # of its own that waits for nothing: on the compute stream, a block freed by a kernel still
            # queued there is handed out and overwritten under it (illegal memory accesses under many
            # cameras, none with CUDA_LAUNCH_BLOCKING=1). On a stream of their own the outputs come from
            # blocks no queued compute kernel holds; the compute stream then waits for the decode.
            main = torch.cuda.current_stream(device)
            side = _DECODE_STREAMS.get(device)
            if side is None:
                side = _DECODE_STREAMS[device] = torch.cuda.Stream(device)
            with torch.cuda.stream(side):
                decoded = decode_jpeg(data, mode=ImageReadMode.RGB, device=device)  # ends with side waiting for it
            main.wait_stream(side)
            for image in decoded:
                image.record_stream(main)  # freed later from main: not reused on side before main is done
            return torch.stack(decoded).permute(0, 2, 3, 1)
    return torch.from_numpy(_decode_cpu(frames)).to(device, non_blocking=True)


def _frames(d: Deferred, device: torch.device) -> torch.Tensor:
    if d.encoded:
        return _decode(d.frames, device)
    frames = d.frames
    if not isinstance(frames, torch.Tensor):  # torch wants a writable, contiguous array
        frames = torch.from_numpy(np.ascontiguousarray(frames) if frames.flags.writeable else frames.copy())
    if device.type == "cuda" and not frames.is_cuda:
        frames = frames.pin_memory()
    return frames.to(device, non_blocking=True)


def materialize(deferred: list[Deferred], device, dtype: torch.dtype) -> list[torch.Tensor]:
    """Pixel rows [rows, width] of each deferred item, in order: items of one shape and target
    size are stacked into one preprocessing call."""
    device = torch.device(device)
    groups: dict[tuple, list[int]] = {}
    for i, d in enumerate(deferred):
        groups.setdefault((len(d.frames), d.source, d.size, d.spec), []).append(i)
    out: list[torch.Tensor | None] = [None] * len(deferred)
    for (_, _, size, spec), members in groups.items():
        stacked = torch.stack([_frames(deferred[i], device) for i in members])
        for i, rows in zip(members, qwen_pixels(stacked, size, spec, dtype)):
            out[i] = rows
    return out
