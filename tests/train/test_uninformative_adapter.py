"""A deliberately uninformative adapter (every label of its domain "no", one epoch on a few items)
is flagged as no better than its baseline by every report that shows its score: `vlora train`'s
output and meta.json, the fusion report and the offline report; each also shows the base model's
zero-shot score and the teacher's agreement with the truth beside it."""

from __future__ import annotations

import json

TEACHER = {"value": 0.9, "metric": "top1"}  # as `vlora distill` records it for data with ground truth


def _all_no(vlora_home, tiny_zoo, root):
    """exists_bus with every label "no": always answering "no" is right on every item."""
    from datasets import load_from_disk
    from train_fixtures import tiny_domain

    src = tiny_domain(vlora_home, "exists_bus", tiny_zoo["qwen2_vl_tiny"], limit=12)
    out = root / "exists_bus"
    load_from_disk(str(src)).map(lambda r: {"label": "no", "answer": "no"}).save_to_disk(str(out))
    meta = json.loads((src / "domain.json").read_text())
    (out / "domain.json").write_text(json.dumps({**meta, "teacher_vs_truth": TEACHER}))
    return out


SMALL = ["train.base=model", "train.allow_random_base=true", "train.epochs=1", "train.batch_size=4",
         "adapter.rank=4"]


def test_every_report_flags_an_uninformative_adapter(tiny_zoo, vlora_home, tmp_path, capsys):
    from vlora.commands import train as train_command
    from vlora.commands.fusion import run_fusion
    from vlora.commands.offline_report import build_report, write_report
    from vlora.config import compose

    path = _all_no(vlora_home, tiny_zoo, tmp_path / "datasets")
    # vlora train: the table with every baseline beside the score, the flag, and meta.json
    out = train_command.run(compose("train", SMALL + [f"train.dataset_dir={path}", f"train.out_dir={tmp_path / 'bus'}"]))
    printed = capsys.readouterr().out
    table = next(line for line in printed.splitlines() if line.startswith("exists_bus"))
    assert "always 'no' 1.000" in table and "NO (p=1)" in table and "0.900" in table, table
    assert "zero_shot" in printed and "not measured" not in table
    assert "NO BETTER THAN MAJORITY: exists_bus top1" in printed
    metrics = json.loads((tmp_path / "bus" / "meta.json").read_text())["domains"]["exists_bus"]
    assert metrics["baseline"]["better"] is False
    shot = metrics["baselines"]["zero_shot"]
    assert shot == out["metrics"]["exists_bus"]["baselines"]["zero_shot"] and shot["n"] == metrics["n_eval"]
    assert metrics["baselines"]["teacher_vs_truth"] == 0.9
    assert list((path / "zero_shot").glob("*.json")), "the base's answers are cached beside the dataset"

    # vlora fusion (as `vlora offline` runs it), then the offline report on its result
    cfg = compose("offline", SMALL + [
        "fusion.only={exists_bus: 0.5}", f"fusion.datasets_dir={tmp_path / 'datasets'}",
        f"fusion.out_dir={tmp_path / 'fused'}", "fusion.rehearsal=0", "fusion.refit_head_epochs=0",
        "offline.per_domain=false", "offline.all_in_one=false", "offline.other_orders=[]",
        "offline.compare_lm_head=null"])
    fused = run_fusion(cfg)
    printed = capsys.readouterr()
    assert "REJECTED: exists_bus, no better than always answering 'no' (1.000" in printed.out
    assert "[fusion step 0] reject      exists_bus" in printed.err
    assert "zero-shot " in printed.err, "each fusion evaluation is logged beside the base's zero-shot score"
    report = build_report(cfg, fused, fused["trainer"])
    row = report["domains"][0]
    assert row["base_zero_shot"] == round(shot["accuracy"], 3) and row["teacher_vs_truth"] == 0.9
    text = (write_report(report, tmp_path / "report") / "report.md").read_text()
    assert "REJECTED: exists_bus 1.000 alone, no better than always answering 'no'" in text
    assert "beats_zero_shot" in text and "always 'no' 1.000" in text

    # kept anyway (fusion.accept_at_baseline): the `vlora train` adapter as the fused one, its meta read back
    from fusion import FusedAdapter, FusionResult
    from train import load_adapter
    from vlora.commands.fusion import result_lines

    state = load_adapter(tmp_path / "bus")
    kept = FusedAdapter(0, "fused_0", ["exists_bus"], {"exists_bus": metrics["accuracy"]}, {"exists_bus": 0.5}, True,
                        state, baselines={"exists_bus": metrics["baseline"]})
    result = FusionResult([kept], [], fused["result"].order)
    fusion_text = "\n".join(result_lines(result))
    assert (f"exists_bus 1.00 (>= 0.50; always 'no' 1.000; zero-shot {shot['accuracy']:.3f}; teacher vs truth 0.90)"
            in fusion_text)
    report = build_report(cfg, {**fused, "result": result}, fused["trainer"])
    assert report["domains"][0]["beats_zero_shot"] == f"{'yes' if shot['better'] else 'NO'} (p={shot['p_value']:.3g})"
    text = (write_report(report, tmp_path / "report") / "report.md").read_text()
    assert "NO BETTER THAN MAJORITY: exists_bus fused 1.0 against always 'no' 1.000 (NO (p=1))" in text
