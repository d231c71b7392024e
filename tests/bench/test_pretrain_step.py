"""The pretraining-step probe runs end to end on the CPU with the tiny model (timings are not checked)."""

from __future__ import annotations

from bench.pretrain_step import main


def test_pretrain_step_probe_writes_its_report(tmp_path, capsys):
    main(["--model", "qwen2_vl_tiny", "--device", "cpu", "--workers", "0", "--batch-size", "2", "--steps", "2",
          "--repeats", "1", "--no-profile", "--out", str(tmp_path)])
    text = (tmp_path / "pretrain_step.txt").read_text()
    for line in ("loader alone", "transformers' vision attention: model step, image batch",
                 "batched vision attention: model step, clip batch", "pretrain 2 steps end to end"):
        assert line in text, line
    assert "patched 2 vision attention modules" in text  # the tiny tower's two blocks
