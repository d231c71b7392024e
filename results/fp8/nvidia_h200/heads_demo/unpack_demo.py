"""Rebuilds the packed demo under /tmp/demo_run/.vlora (the paths its adapters' meta.json record)."""
import json, shutil, sys
from pathlib import Path
from datasets import Dataset, DatasetDict, Features

SRC = Path(sys.argv[1])
DST = Path(sys.argv[2] if len(sys.argv) > 2 else "/tmp/demo_run/.vlora")
DST.mkdir(parents=True, exist_ok=True)
for sub in ("zoo", "adapters"):
    shutil.copytree(SRC / sub, DST / sub, dirs_exist_ok=True)
for d in sorted(p.name for p in (SRC / "domains").iterdir()):
    src = SRC / "domains" / d
    feats = Features.from_dict(json.loads((src / "features.json").read_text()))
    rows = json.loads((src / "rows.json").read_text())
    splits = {}
    for split, rs in rows.items():
        for r in rs:
            h = r["image"]
            r["image"] = None if h is None else {"bytes": (SRC / "images" / f"{h}.webp").read_bytes(), "path": None}
        splits[split] = Dataset.from_list(rs, features=feats)
    out = DST / "datasets" / d
    shutil.rmtree(out, ignore_errors=True)
    DatasetDict(splits).save_to_disk(str(out))
    shutil.copy(src / "domain.json", out / "domain.json")
    print(d, {k: len(v) for k, v in splits.items()})
