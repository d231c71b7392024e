"""Tiling tables: the fastest configuration per shape bucket, found offline, one JSON per GPU.

    vlora_kernels/tables/<gpu-slug>.json = {"device": "NVIDIA H100 80GB HBM3", "entries": {
        "shrink|t64|m1|k4096|n4096|r64|s1": {"block_m": 16, ..., "us": 11.2}, ...}}

Lookup is a dict access. A shape missing from the table takes the entry of the nearest
model dimensions with the same op, token and rank buckets; a GPU without a table, or a
bucket nobody searched, takes the heuristic.

Whether a batch takes a one-launch op (`fused.py`, `handoff.py`) rather than shrink + expand
is the table's call alone (`one_launch`): a one-launch entry is used where it beat the two
launches measured at the same shape, and a bucket without one keeps the two launches. Each
one-launch entry's "us" is the time of the whole LoRA op; where the search also timed the two
launches at the table's tilings in the same run, the entry holds that as "two_launch_us" and
the comparison uses it (times from one run, not from two machines or days). The one-launch ops
are opt-in that way because each is faster only at some decode shapes (the fused op at none
timed on an H100, at best 0.81x as fast; `tiling.py`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from pathlib import Path

from .tiling import ONE_LAUNCH_OPS, ShapeKey, TileConfig, heuristic_config

TABLE_DIR = Path(__file__).resolve().parent / "tables"
# A one-launch op replaces the two launches only where it was faster by more than this share. Each
# entry is one median from one tuning run, so a closer finish is not a measured win (the H100
# table's 64-token, rank-64 bucket recorded fused 32.4 us against 32.6 us for the two launches).
FUSED_MARGIN = 0.05


def device_slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


class TilingTable:
    def __init__(self, device: str = "unknown", entries: dict[str, dict] | None = None, num_sms: int = 132):
        self.device, self.num_sms = device, num_sms
        self.entries: dict[str, dict] = dict(entries or {})
        self._configs: dict[ShapeKey, TileConfig] = {}
        self._by_bucket: dict[tuple, list[ShapeKey]] = {}
        self._one_launch: dict[ShapeKey, tuple[str, TileConfig] | None] = {}
        for text, entry in self.entries.items():
            key = ShapeKey.parse(text)
            self._configs[key] = TileConfig.from_dict(entry)
            self._by_bucket.setdefault(self._bucket(key), []).append(key)

    @staticmethod
    def _bucket(key: ShapeKey) -> tuple:
        return key.op, key.tokens, key.seg_len, key.rank, key.slices

    def lookup(self, key: ShapeKey) -> TileConfig:
        cfg = self._configs.get(key)
        if cfg is None:
            cfg = self._nearest(key) or heuristic_config(key, self.num_sms)
            self._configs[key] = cfg  # later lookups of this shape are a plain dict hit
        return cfg

    def _nearest(self, key: ShapeKey) -> TileConfig | None:
        measured = self._nearest_key(key)
        return None if measured is None else self._configs[measured]

    def _nearest_key(self, key: ShapeKey) -> ShapeKey | None:
        """The measured key of `key`'s bucket with the closest model dimensions (itself if measured)."""
        candidates = self._by_bucket.get(self._bucket(key))
        if not candidates:
            return None
        dist = lambda c: abs(math.log2(c.k / key.k)) + abs(math.log2(c.n / key.n))  # noqa: E731
        return min(candidates, key=dist)

    def one_launch(self, key: ShapeKey) -> tuple[str, TileConfig] | None:
        """(op, tiling) of the one-launch op that should serve `key`'s bucket (any op in the key),
        else None: two launches.

        For each op of ONE_LAUNCH_OPS: its entry nearest in model dimensions, a candidate only if
        it beat the two-launch op timed at its own shape by more than FUSED_MARGIN (no two-launch
        time there: no comparison, so two launches). Of the candidates, the fastest. A bucket
        without one-launch entries: two launches (no heuristic sends a batch to these ops).
        """
        key = replace(key, op=ONE_LAUNCH_OPS[0])
        if key not in self._one_launch:
            best = None
            for op in ONE_LAUNCH_OPS:
                measured = self._nearest_key(replace(key, op=op))
                if measured is None:
                    continue
                entry = self.entries[str(measured)]
                us, two = entry.get("us", math.inf), entry.get("two_launch_us")
                if two is None:
                    halves = [self.entries.get(str(replace(measured, op=o)), {}).get("us") for o in ("shrink", "expand")]
                    two = min((h for h in halves if h is not None), default=None)
                if two is not None and us < (1.0 - FUSED_MARGIN) * two and (best is None or us < best[0]):
                    best = (us, op, self._configs[measured])
            self._one_launch[key] = None if best is None else best[1:]
        return self._one_launch[key]

    def record(self, key: ShapeKey, cfg: TileConfig, us: float, two_launch_us: float | None = None) -> None:
        """Records `key`'s fastest tiling and its time; two_launch_us: for a one-launch op, the
        two launches timed at the table's tilings in the same run."""
        if str(key) not in self.entries:
            self._by_bucket.setdefault(self._bucket(key), []).append(key)
        extra = {} if two_launch_us is None else {"two_launch_us": round(two_launch_us, 3)}
        self.entries[str(key)] = {**cfg.to_dict(), "us": round(us, 3), **extra}
        self._configs[key] = cfg
        self._one_launch.clear()  # a new measurement may change which op wins

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        body = {"device": self.device, "num_sms": self.num_sms, "entries": dict(sorted(self.entries.items()))}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(body, indent=1) + "\n")
        tmp.replace(path)  # a crash mid-write never leaves a truncated table

    @classmethod
    def load(cls, path: str | Path) -> "TilingTable":
        body = json.loads(Path(path).read_text())
        return cls(body.get("device", "unknown"), body.get("entries", {}), body.get("num_sms", 132))

    @classmethod
    def for_device(cls, device_name: str, num_sms: int = 132, table_dir: Path = TABLE_DIR) -> "TilingTable":
        """The committed table of this GPU, or an empty one (heuristic tilings everywhere, two
        launches at every shape)."""
        path = table_dir / f"{device_slug(device_name)}.json"
        return cls.load(path) if path.exists() else cls(device_name, {}, num_sms)
