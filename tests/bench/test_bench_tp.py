"""`vlora bench bench.suite=tp` on the CPU: the tiny shape, two gloo ranks (a LocalGroup whose
followers run the bench's ranks) against one process at fp32 in every LoRA mode and after switches,
the timings of both sizes, the files, a rerun that keeps what was measured, and bad options refused
before any model is built."""

from __future__ import annotations

import csv
import json
import math
import re

import pytest
import torch

from vlora.commands.bench import run
from vlora.config import compose

TINY = ["bench.suite=tp", "bench.tp.shape=tiny", "bench.tp.device=cpu", "bench.tp.dtype=float32",
        "bench.tp.prompts=3", "bench.tp.prompt_tokens=16", "bench.tp.image_size=56", "bench.tp.output_tokens=4",
        "bench.tp.batches=[1,2]", "bench.tp.decode_tokens=3", "bench.tp.repeats=2", "bench.tp.vision_images=4",
        "bench.tp.vision_repeats=2", "bench.tp.threads=1"]
LABELS = ["unmerge", "mixture(a)", "merge(a)", "unmerge after merge(a)", "merge(b) after switch"]


def _run(overrides: list[str]):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: a second thread only waits (see tests/adapter_cases.py)
    try:
        return run(compose("bench", overrides))
    finally:
        torch.set_num_threads(threads)


def test_tp_suite_on_cpu_matches_one_process_and_resumes(vlora_home, tmp_path, capsys):
    result = _run(TINY + [f"bench.out_dir={tmp_path}"])
    rows = result["tp"]
    parity = {r["mode"]: r for r in rows if r["section"] == "parity"}
    assert list(parity) == LABELS and all(r["tp"] == 2 and r["against"] == "TP=1" for r in parity.values())
    for r in parity.values():  # fp32 on the CPU: the split sums in another order, nothing more
        assert r["logit_max_abs_err"] < 1e-4 and r["token_agreement"] == 1 and r["diverged"] == 0, r
        assert r["prompts"] == 3 and r["divergences"] == ""
    noise = {(r["tp"], r["mode"]) for r in rows if r["section"] == "noise"}
    assert noise == {(tp, m) for tp in (1, 2) for m in LABELS}
    decode = {(r["tp"], r["batch"]): r for r in rows if r["section"] == "decode"}
    assert set(decode) == {(tp, b) for tp in (1, 2) for b in (1, 2)}
    assert all(math.isnan(r["decode_step_ms"]) and r["decode_wall_ms"] > 0 for r in decode.values())  # no graphs
    vision = {(r["tp"], r["tp_vision"]): r for r in rows if r["section"] == "vision"}
    assert set(vision) == {(1, "whole"), (2, "split"), (2, "whole")}  # the tower both ways on the group
    assert vision[1, "whole"]["items_here"] == vision[1, "whole"]["items"] == 4
    split, whole = vision[2, "split"], vision[2, "whole"]
    assert split["items_here"] == 2 and split["vision_ms"] > 0  # rank 0 encoded its half
    assert whole["items_here"] == 4 and whole["vision_ms"] > 0  # every rank all of them
    # the split one broken down on every rank: rank 0's tower pass and the all-gather after it, its peer's
    parts = ("tower_ms", "gather_ms", "host_ms", "gather_min_ms", "peer_tower_ms", "peer_host_ms")
    assert all(split[k] > 0 for k in parts)
    prof = {r["tp"]: r for r in rows if r["section"] == "vision_profile"}
    assert prof[1]["tp_vision"] == "whole" and prof[1]["comm_us"] == 0 and prof[1]["tower_us"] > 0
    assert prof[2]["tp_vision"] == "split" and prof[2]["comm_us"] > 0 and prof[2]["tower_us"] > 0  # gloo's all-gather
    assert {r["tp"] for r in rows if r["section"] == "prefill"} == {1, 2}
    out = tmp_path / "cpu"
    with open(out / "tp.csv", newline="") as f:
        assert {r["section"] for r in csv.DictReader(f)} == {"parity", "noise", "decode", "prefill", "vision",
                                                             "vision_profile"}
    meta = json.loads((out / "tp.json").read_text())["meta"]
    assert meta["job"]["sizes"] == [2] and any("NCCL" in n for n in meta["notes"])
    md = (out / "tp.md").read_text()
    assert "## Parity: TP=N against TP=1" in md and "## Decode step" in md and "## Vision encoder" in md
    assert "| 2 | split |" in md and "| 2 | whole |" in md and "Profiled call on rank 0" in md
    printed = capsys.readouterr().out
    assert "bench.suite=tp bench.tp.sizes=[2]" in printed and "bench.out_dir=$OUT/tp" in printed
    # a rerun keeps every section and builds no engine: the same rows come back
    again = _run(TINY + [f"bench.out_dir={tmp_path}"])
    assert [(r["section"], r["tp"], r.get("batch"), r.get("mode")) for r in again["tp"]] == \
        [(r["section"], r["tp"], r.get("batch"), r.get("mode")) for r in rows]
    assert not any(k.startswith("build_") for k in again["meta"]["seconds"])


@pytest.mark.parametrize("override, message", [
    ("bench.tp.sizes=[4]", "num_kv_heads (2) to be a multiple of 4"),  # the tiny model's 2 K/V heads
    ("bench.tp.sizes=[1]", "TP sizes of 2 or more"),
    ("bench.tp.adapters=1", "2 to 4"),
    ("bench.tp.shape=nope", "nor a zoo spec"),
    ("bench.tp.batches=[0]", "must be >= 1"),
])
def test_bad_options_are_refused_before_a_model_is_built(vlora_home, tmp_path, override, message):
    work = tmp_path / "work"
    with pytest.raises(SystemExit, match=re.escape(message)):
        _run(TINY + [override, f"bench.out_dir={tmp_path / 'out'}", f"bench.tp.work_dir={work}"])
    assert not work.exists()  # no checkpoint written


def test_more_gpus_than_visible_and_a_work_dir_under_the_results_are_refused(vlora_home, tmp_path):
    work = tmp_path / "work"
    sizes = next((n for n in (2, 4) if n > torch.cuda.device_count()), None)  # sizes the 7B's 4 K/V heads split
    if sizes is not None:
        with pytest.raises(SystemExit, match=f"TP={sizes} needs {sizes} GPUs, this process sees"):
            _run(["bench.suite=tp", "bench.tp.device=cuda", f"bench.tp.sizes=[{sizes}]",
                  f"bench.out_dir={tmp_path / 'out'}", f"bench.tp.work_dir={work}"])
    with pytest.raises(SystemExit, match="is under out_dir"):
        _run(TINY + [f"bench.out_dir={tmp_path}", f"bench.tp.work_dir={work}"])
    assert not work.exists()
