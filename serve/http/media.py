"""Pictures of a chat request -> the frame specs and blobs the RPyC wire takes (serve.rpc.wire).

An image is an `image_url` part: a data URL (`data:image/jpeg;base64,...`, PNG or JPEG) or a file
under the operator's `http.media_root` (`file:///root/cam/1.jpg`, or a path relative to the root).
A video is either a list of frames, `{"type": "video", "video": [<image URL>, ...]}` (the form of
Qwen2-VL's own tools), or a `video_url` file under the root, from which at most rpc.max_frames
frames are taken evenly (`vlora.video_frames` asks for fewer). Only sizes are checked here, before
any pixel is decoded; the frames' formats, pixels and budgets are the wire's own checks. The server
fetches no http(s) URL.
"""

from __future__ import annotations

import base64
import binascii
import re
import time
from pathlib import Path

from serve.rpc.wire import Limits

from .errors import HttpError

DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*?);base64,", re.ASCII)
IMAGE_TYPES = ("image/jpeg", "image/jpg", "image/png")
VIDEO_SUFFIXES = (".mp4", ".avi", ".mkv", ".mov", ".webm", ".m4v")


class Media:
    """The pictures of one request, in order, with their bytes counted against the wire's limit."""

    def __init__(self, limits: Limits, media_root: str, max_video_file_bytes: int):
        self.limits, self.max_video_file_bytes = limits, max_video_file_bytes
        self.root = Path(media_root).expanduser().resolve() if media_root else None
        self.kind = "image"
        self.specs: list[dict] = []
        self.blobs: list[bytes] = []
        self._bytes = 0
        self._videos = 0

    # ---- parts ---------------------------------------------------------------------------------
    def image(self, url, where: str) -> None:
        if self.kind == "video":
            raise HttpError("bad_argument", f"{where}: a request holds images or one video, not both")
        self._encoded(self._image_bytes(url, where))

    def video_frames(self, urls, where: str) -> None:
        self._one_video(where)
        if not isinstance(urls, list) or not urls:
            raise HttpError("bad_argument", f"{where}: video must be a non-empty list of image URLs (one per frame)")
        if len(urls) > self.limits.max_frames:
            raise HttpError("too_large", f"{where}: {len(urls)} frames exceed the limit of {self.limits.max_frames}")
        for i, url in enumerate(urls):
            self._encoded(self._image_bytes(url, f"{where}[{i}]"))

    def video_file(self, url, where: str, frames: int | None) -> None:
        self._one_video(where)
        path = self._file(url, where)
        if path.suffix.lower() not in VIDEO_SUFFIXES:
            raise HttpError("bad_frame", f"{where}: a video file is one of {', '.join(VIDEO_SUFFIXES)}")
        if path.stat().st_size > self.max_video_file_bytes:
            raise HttpError("too_large", f"{where}: the file holds {path.stat().st_size} bytes, over "
                                         f"http.max_video_file_bytes={self.max_video_file_bytes}")
        for frame in _read_video(path, where, self.limits, frames):
            self.specs.append({"format": "raw", "shape": list(frame.shape), "dtype": "uint8"})
            self.blobs.append(frame.tobytes())

    # ---- helpers -------------------------------------------------------------------------------
    def _one_video(self, where: str) -> None:
        if self.blobs and self.kind == "image":
            raise HttpError("bad_argument", f"{where}: a request holds images or one video, not both")
        if self._videos:
            raise HttpError("bad_argument", f"{where}: a request holds one video")
        self.kind, self._videos = "video", 1

    def _encoded(self, blob: bytes) -> None:
        self.specs.append({"format": "encoded"})
        self.blobs.append(blob)

    def _count(self, size: int, where: str) -> None:
        self._bytes += size
        if self._bytes > self.limits.max_message_bytes:
            raise HttpError("too_large", f"{where}: the pictures hold more than {self.limits.max_message_bytes} bytes "
                                         "(rpc.max_message_bytes)")

    def _image_bytes(self, url, where: str) -> bytes:
        if isinstance(url, dict):  # {"url": ..., "detail": ...}, as the image_url part carries it
            url = url.get("url")
        if not isinstance(url, str) or not url:
            raise HttpError("bad_argument", f"{where}: an image is a data URL or a file under the server's media root")
        match = DATA_URL.match(url, 0, 256)
        if match is not None:
            if match["mime"] not in IMAGE_TYPES:
                raise HttpError("bad_frame", f"{where}: {str(match['mime'])[:40]!r} images are not taken; send "
                                             "image/jpeg or image/png")
            text = url[match.end():]
            self._count(len(text) // 4 * 3, where)  # before decoding: base64 holds 3 bytes in 4 characters
            try:
                return base64.b64decode(text, validate=True)
            except (binascii.Error, ValueError):
                raise HttpError("bad_frame", f"{where}: the data URL is not valid base64") from None
        if url.startswith("data:"):
            raise HttpError("bad_frame", f"{where}: a data URL must be base64 (data:image/png;base64,...)")
        path = self._file(url, where)
        self._count(path.stat().st_size, where)
        return path.read_bytes()

    def _file(self, url: str, where: str) -> Path:
        """The file `url` names under the media root; one refusal whether a path outside exists or not."""
        if re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*://", url) and not url.startswith("file://"):
            raise HttpError("bad_argument", f"{where}: the server fetches no URLs; send a data URL, or a file "
                                            "under its media root (file:///...)")
        if self.root is None:
            raise HttpError("forbidden", f"{where}: this server reads no files; send a data URL (its operator can "
                                         "allow files under one folder with http.media_root=<dir>)")
        raw = url[len("file://"):] if url.startswith("file://") else url
        if "\0" in raw or len(raw) > 4096:
            raise HttpError("bad_argument", f"{where}: a file path is a plain path of at most 4096 characters")
        path = (self.root / raw).resolve()
        if path != self.root and self.root not in path.parents:
            raise HttpError("forbidden", f"{where}: files are read only under the server's media root")
        if not path.is_file():
            raise HttpError("not_found", f"{where}: no such file under the media root")
        return path


def _read_video(path: Path, where: str, limits: Limits, wanted: int | None) -> list:
    """Up to `wanted` (else rpc.max_frames) frames of the file, evenly spaced, RGB uint8 [H, W, 3];
    sizes checked from the container before a frame is decoded, and decoding bounded in CPU time."""
    import cv2

    capture = cv2.VideoCapture(str(path))
    try:
        if not capture.isOpened():
            raise HttpError("bad_frame", f"{where}: not a video file OpenCV can read")
        width, height = int(capture.get(cv2.CAP_PROP_FRAME_WIDTH)), int(capture.get(cv2.CAP_PROP_FRAME_HEIGHT))
        count = int(capture.get(cv2.CAP_PROP_FRAME_COUNT))
        if width < 1 or height < 1 or count < 1:
            raise HttpError("bad_frame", f"{where}: the video's size or frame count cannot be read")
        if width * height > limits.max_frame_pixels:
            raise HttpError("too_large", f"{where}: {width}x{height} exceeds {limits.max_frame_pixels} pixels")
        take = min(count, limits.max_frames, wanted or limits.max_frames)
        if take * width * height > limits.max_request_pixels:
            take = max(1, limits.max_request_pixels // (width * height))
        picks = sorted({round(i * (count - 1) / max(1, take - 1)) for i in range(take)}) if take > 1 else [0]
        until = time.thread_time() + limits.max_decode_cpu_s * len(picks)
        frames, index = [], 0
        for pick in picks:
            while index <= pick:
                ok = capture.grab()
                if not ok:
                    break
                index += 1
                if time.thread_time() > until:
                    raise HttpError("too_large", f"{where}: decoding took more than "
                                                 f"{limits.max_decode_cpu_s:g} s of CPU time a frame (rpc.max_decode_cpu_s)")
            ok, bgr = capture.retrieve() if ok else (False, None)
            if not ok or bgr is None or bgr.shape[:2] != (height, width):
                break
            frames.append(bgr[:, :, ::-1].copy())
        if not frames:
            raise HttpError("bad_frame", f"{where}: no frame could be decoded")
        return frames
    finally:
        capture.release()
