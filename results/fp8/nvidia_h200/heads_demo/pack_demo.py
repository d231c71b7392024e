"""Packs the demo's fused adapters, their base and the eval splits of their domains, images deduplicated."""
import hashlib, io, json, shutil, sys
from PIL import Image as PILImage
from pathlib import Path
from datasets import load_from_disk, Image

SRC = Path("/tmp/demo_run/.vlora")
DST = Path(sys.argv[1])
N_EVAL = int(sys.argv[2])  # eval items per domain kept; images stored as lossless WebP (the same pixels)
shutil.rmtree(DST, ignore_errors=True)
(DST / "images").mkdir(parents=True)
manifest = json.loads((SRC / "adapters/fused/manifest.json").read_text())
domains = sorted({d for a in manifest["adapters"] for d in a["domains"]})
for d in domains:
    dd = load_from_disk(str(SRC / "datasets" / d))
    out = {}
    for split, n in (("train", 2), ("eval", min(N_EVAL, len(dd["eval"])))):
        ds = dd[split].cast_column("image", Image(decode=False)).select(range(n))
        rows = []
        for r in ds:
            img = r.pop("image")
            if img is not None and img.get("bytes"):
                h = hashlib.md5(img["bytes"]).hexdigest()
                p = DST / "images" / f"{h}.webp"
                if not p.exists():
                    im = PILImage.open(io.BytesIO(img["bytes"]))
                    o = io.BytesIO()
                    im.save(o, "WEBP", lossless=True, quality=100, method=6)
                    assert PILImage.open(io.BytesIO(o.getvalue())).tobytes() == im.convert(im.mode).tobytes()
                    p.write_bytes(o.getvalue())
                r["image"] = h
            else:
                r["image"] = None
            rows.append(r)
        out[split] = rows
    (DST / "domains" / d).mkdir(parents=True)
    (DST / "domains" / d / "rows.json").write_text(json.dumps(out))
    shutil.copy(SRC / "datasets" / d / "domain.json", DST / "domains" / d / "domain.json")
    (DST / "domains" / d / "features.json").write_text(json.dumps(dd["eval"].features.to_dict()))
shutil.copytree(SRC / "zoo/qwen2_vl_tiny_pretrained", DST / "zoo/qwen2_vl_tiny_pretrained")
(DST / "adapters/fused").mkdir(parents=True)
shutil.copy(SRC / "adapters/fused/manifest.json", DST / "adapters/fused/manifest.json")
for a in manifest["adapters"]:
    shutil.copytree(SRC / "adapters/fused" / a["path"], DST / "adapters/fused" / a["path"])
print(domains, sum(f.stat().st_size for f in DST.rglob("*") if f.is_file()) / 2**20, "MiB")
