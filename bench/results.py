"""The one place benchmark results are written: the device's folder name, CSV rows, JSON summaries.

    out = results_dir(job.out_dir, device_label("cuda"))   # <out_dir>/nvidia_h200
    write_csv(out / "engine.csv", rows)
    write_json(out / "engine.json", {"meta": meta, "rows": rows})
"""

from __future__ import annotations

import csv
import io
import json
import sys
from pathlib import Path
from typing import Any, Iterable

from vlora_kernels.table import device_slug


def device_label(device) -> str:
    """The GPU's name for a CUDA device (as the driver reports it), "cpu" otherwise."""
    import torch

    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def results_dir(out_dir: str | Path, device_name: str) -> Path:
    """<out_dir>/<device slug> (e.g. "NVIDIA H200" -> nvidia_h200), created: results never mix GPUs.
    The slug is the tiling tables' (vlora_kernels.table.device_slug), so one GPU has one name everywhere."""
    out = Path(out_dir) / device_slug(device_name)
    out.mkdir(parents=True, exist_ok=True)
    return out


def write_csv(path: str | Path, rows: Iterable[dict], columns: Iterable[str] | None = None,
              drop_extra: bool = False) -> Path:
    """rows as CSV with a header: `columns` in order, else every row's keys in the order first seen
    (a row without one leaves its cell empty). A key outside given columns is an error unless
    drop_extra (a summary table of wider rows)."""
    rows = list(rows)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = list(columns) if columns is not None else list(dict.fromkeys(k for row in rows for k in row))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore" if drop_extra else "raise")
        writer.writeheader()
        writer.writerows(rows)
    return path


def write_json(path: str | Path, data: Any, indent: int = 2) -> Path:
    """data as JSON (values JSON cannot hold, such as paths, written as strings), newline-terminated."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=indent, default=str) + "\n")
    return path


class Tee(io.TextIOBase):
    """A text stream that prints what it is given and keeps it (`text`), for a probe's report file."""

    def __init__(self):
        super().__init__()
        self.kept = io.StringIO()

    def write(self, s: str) -> int:
        sys.stdout.write(s)
        return self.kept.write(s)

    @property
    def text(self) -> str:
        return self.kept.getvalue()
