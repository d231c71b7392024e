import json, cv2, numpy as np
from pathlib import Path
from datasets import load_from_disk
ds = load_from_disk("/tmp/digits/home/datasets/digits")["eval"]
photos = Path("/tmp/digits/photos"); photos.mkdir(exist_ok=True)
lines = []
for i, row in enumerate(ds):
    rgb = np.asarray(row["image"].convert("RGB"))
    cv2.imwrite(str(photos / f"item{i:03d}.png"), rgb[..., ::-1])
    lines.append(json.dumps({"image": f"item{i:03d}.png", "question": "Which digit is this?", "answer": row["label"], "item": i}))
Path("/tmp/digits/queries.jsonl").write_text("\n".join(lines) + "\n")
print(len(lines))
