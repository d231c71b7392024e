"""The LoRA-step probe runs end to end on the CPU with the tiny model (timings are not checked)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "train"))  # the distilled-domain fixture
from train_fixtures import tiny_domain  # noqa: E402

from bench.lora_step import main  # noqa: E402


def test_lora_step_probe_writes_its_report(tiny_zoo, vlora_home, tmp_path):
    root = tiny_domain(vlora_home, "color_largest", tiny_zoo["qwen2_vl_tiny"], limit=12).parent
    main(["--datasets", str(root), "--domains", "color_largest", "--model", "qwen2_vl_tiny", "--device", "cpu",
          "--batch-sizes", "4", "--steps", "3", "--repeats", "1", "--frozen", "autocast", "float32", "--out", str(tmp_path)])
    text = (tmp_path / "lora_step.txt").read_text()
    assert text.count("model step alone") == 2
    for line in ("frozen decoder projections: autocast", "frozen decoder projections: float32", "rows whole (pictures decoded)", "first encoding", "pictures of encoded items skipped",
                 "encoder cache hits", "collate", "model step alone", "profile of 4 model steps",
                 "trainer loop, eager", "under cProfile", "evaluation of the eval split", "head re-fit"):
        assert line in text, line
