"""An encoded frame's structure, read from its bytes without decoding any pixel.

Decoding cost is not set by the pixel count alone: a progressive JPEG's decoder walks every
block of the image once per scan, so 100,000 empty scans (1.45 MB) keep a 4K frame decoding for
~43 s. The structure tells the cost before any of it is paid: these walkers count a JPEG's
segments and scans and a PNG's chunks, and refuse a frame whose structure no encoder writes.
Each walk stops at its bound, so reading the structure costs at most that many steps (entropy-coded
data is skipped by a regular expression, at C speed).

    check_jpeg(blob, name, max_scans) -> JpegInfo     check_png(blob, name, max_chunks)
"""

from __future__ import annotations

import re
import struct
from dataclasses import dataclass

from .errors import RequestError

# baseline, extended and progressive Huffman-coded: what cameras, browsers, PIL and OpenCV write.
# Lossless, hierarchical and arithmetic-coded frames are refused (rare, and each a decoder path of its own)
JPEG_FRAMES = {0xC0: "baseline", 0xC1: "extended", 0xC2: "progressive"}
# segments of any kind before the end: a real file has ~10 (one scan) to ~40 (progressive, with
# EXIF/ICC/XMP); the walk itself costs one Python step per segment, so it too is bounded
MAX_JPEG_SEGMENTS = 512
# the first marker after entropy-coded data: 0xFF followed by neither 0x00 (a stuffed byte),
# a restart marker 0xD0-0xD7 (inside the data) nor 0xFF (fill)
_NEXT_MARKER = re.compile(rb"\xff(?=[^\x00\xd0-\xd7\xff])")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
_NONZERO = re.compile(rb"[^\x00]")


@dataclass(frozen=True)
class JpegInfo:
    frame: str  # "baseline" | "extended" | "progressive"
    components: int
    scans: int
    # DCT coefficients a pixel over all components (1.5 for YCbCr 4:2:0, 3 for 4:4:4, 4 for CMYK),
    # from the sampling factors: what libjpeg holds in memory when the file has several scans
    coefficients_per_pixel: float

    @property
    def buffers_coefficients(self) -> bool:
        return self.frame == "progressive" or self.scans > 1


def _refuse(name: str, what: str) -> RequestError:
    return RequestError("bad_frame", f"{name}: {what}")


def _trailing(blob: bytes, end: int, name: str, marker: str) -> None:
    """Zero padding after the end marker is allowed (some writers pad to a block); anything else is refused:
    bytes the decoder never reads are an attached payload or a second image."""
    found = _NONZERO.search(blob, end)
    if found is not None:
        raise _refuse(name, f"{len(blob) - end} bytes follow the {marker} marker (send one image per frame, "
                            "without appended data)")


def check_jpeg(blob: bytes, name: str, max_scans: int) -> JpegInfo:
    """Walks the JPEG's segments from SOI to EOI; refuses more than `max_scans` scans, more than
    MAX_JPEG_SEGMENTS segments, frame types other than JPEG_FRAMES, a second frame header, a scan
    before the frame header, a missing end-of-image marker and data after it."""
    if blob[:2] != b"\xff\xd8":
        raise _refuse(name, "not a JPEG stream (no start-of-image marker)")
    pos, segments, scans, frame, components, coefficients = 2, 0, 0, None, 0, 0.0
    size = len(blob)
    while True:
        if pos + 1 >= size:
            raise _refuse(name, "the JPEG data is truncated (no end-of-image marker)")
        if blob[pos] != 0xFF:
            raise _refuse(name, f"the JPEG data is malformed (no marker at byte {pos})")
        while pos + 1 < size and blob[pos + 1] == 0xFF:  # fill bytes before a marker
            pos += 1
        if pos + 1 >= size:
            raise _refuse(name, "the JPEG data is truncated (no end-of-image marker)")
        code = blob[pos + 1]
        if code == 0xD9:  # end of image
            if frame is None or not scans:
                raise _refuse(name, "the JPEG stream ends before its frame header or first scan")
            _trailing(blob, pos + 2, name, "JPEG end-of-image")
            return JpegInfo(frame, components, scans, coefficients)
        segments += 1
        if segments > MAX_JPEG_SEGMENTS:
            raise _refuse(name, f"the JPEG stream has more than {MAX_JPEG_SEGMENTS} segments (real files have "
                                "a few dozen)")
        if code in (0x01, 0xD8) or 0xD0 <= code <= 0xD7:
            raise _refuse(name, f"the JPEG stream has a stray marker 0xFF{code:02X} at byte {pos}")
        if pos + 4 > size:
            raise _refuse(name, "the JPEG data is truncated (in a segment header)")
        length = struct.unpack_from(">H", blob, pos + 2)[0]
        if length < 2 or pos + 2 + length > size:
            raise _refuse(name, f"the JPEG segment 0xFF{code:02X} at byte {pos} has a bad length {length}")
        if 0xC0 <= code <= 0xCF and code not in (0xC4, 0xC8, 0xCC):  # a frame header (SOFn)
            if code not in JPEG_FRAMES:
                raise _refuse(name, f"JPEG frame type 0xFF{code:02X} (lossless, hierarchical or arithmetic-coded) "
                                    f"is not accepted; only {', '.join(JPEG_FRAMES.values())} Huffman-coded frames")
            if frame is not None:
                raise _refuse(name, "the JPEG stream has a second frame header")
            components = blob[pos + 9] if length >= 8 else 0
            if not 1 <= components <= 4 or length != 8 + 3 * components:
                raise _refuse(name, f"the JPEG frame header is malformed ({components} components in {length} bytes)")
            sampling = [(blob[at] >> 4, blob[at] & 15) for at in range(pos + 11, pos + 11 + 3 * components, 3)]
            if not all(1 <= h <= 4 and 1 <= v <= 4 for h, v in sampling):
                raise _refuse(name, f"the JPEG frame header has bad sampling factors {sampling}")
            most = max(h for h, _ in sampling) * max(v for _, v in sampling)
            frame, coefficients = JPEG_FRAMES[code], sum(h * v for h, v in sampling) / most
        elif code in (0xDE, 0xDF):  # hierarchical (DHP, EXP)
            raise _refuse(name, "hierarchical JPEG is not accepted")
        pos += 2 + length
        if code == 0xDA:  # start of scan: its entropy-coded data runs to the next marker
            if frame is None:
                raise _refuse(name, "the JPEG stream has a scan before its frame header")
            scans += 1
            if scans > max_scans:
                raise RequestError("too_large", f"{name}: the JPEG stream has more than {max_scans} scans "
                                                "(rpc.max_jpeg_scans; a progressive JPEG has about 10): each "
                                                "scan costs a pass over the whole image")
            found = _NEXT_MARKER.search(blob, pos)
            if found is None:
                raise _refuse(name, "the JPEG data is truncated (no end-of-image marker)")
            pos = found.start()


def check_png(blob: bytes, name: str, max_chunks: int) -> None:
    """Walks the PNG's chunks from the signature to IEND; refuses more than `max_chunks` chunks,
    image data (IDAT) in more than one run, a missing IEND and data after it."""
    if blob[:8] != PNG_SIGNATURE:
        raise _refuse(name, "not a PNG stream (no PNG signature)")
    pos, chunks, idat_runs, last = 8, 0, 0, b""
    size = len(blob)
    while True:
        if pos + 8 > size:
            raise _refuse(name, "the PNG data is truncated (no IEND chunk)")
        length, kind = struct.unpack_from(">I4s", blob, pos)
        chunks += 1
        if chunks > max_chunks:
            raise RequestError("too_large", f"{name}: the PNG stream has more than {max_chunks} chunks "
                                            "(rpc.max_png_chunks; encoders write image data in 8-64 KB chunks)")
        if length > 0x7FFFFFFF or pos + 12 + length > size:
            raise _refuse(name, f"the PNG chunk {kind!r} at byte {pos} runs past the end of the data")
        if chunks == 1 and kind != b"IHDR":
            raise _refuse(name, "the PNG stream does not start with its IHDR chunk")
        if kind == b"IDAT" and last != b"IDAT":
            idat_runs += 1
            if idat_runs > 1:  # the standard puts all IDAT chunks in one run
                raise _refuse(name, "the PNG image data (IDAT) is split by other chunks")
        pos, last = pos + 12 + length, kind
        if kind == b"IEND":
            if not idat_runs:
                raise _refuse(name, "the PNG stream has no image data (IDAT)")
            _trailing(blob, pos, name, "PNG IEND")
            return
