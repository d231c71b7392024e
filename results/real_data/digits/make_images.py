import cv2, numpy as np
from pathlib import Path
from sklearn.datasets import load_digits
d = load_digits()
root = Path("/tmp/digits/images")
for i, (img, y) in enumerate(zip(d.images, d.target)):
    grey = cv2.resize((img * (255 / 16)).astype(np.uint8), (56, 56), interpolation=cv2.INTER_NEAREST)
    f = root / str(y); f.mkdir(parents=True, exist_ok=True)
    cv2.imwrite(str(f / f"{i:04d}.png"), cv2.cvtColor(grey, cv2.COLOR_GRAY2BGR))
print(len(d.target))
