"""The smoke run and the world command, composed from their real configs and run in-process."""

from __future__ import annotations

import json

from vlora.commands import smoke, world
from vlora.config import compose


def test_world_command_writes_the_configured_world(vlora_home):
    index = world.run(compose("world", ["world=tiny", "seed=5", "world.n_images=3", "world.n_clips=1"]))
    assert index.root == vlora_home / "world" / "tiny-seed5"
    assert [it.kind for it in index] == ["image"] * 3 + ["clip"]
    assert index.config.seed == 5
    assert all(it.path.is_file() for it in index)


def test_smoke_runs_every_model_end_to_end_and_reuses_artifacts(vlora_home, tiny_zoo, capsys):
    cfg = compose("smoke", ["smoke.max_new_tokens=2", "smoke.n_queries=1"])
    first = smoke.run(cfg)
    assert [m["model"] for m in first["models"]] == ["qwen2_vl_tiny", "qwen2_5_vl_tiny", "llava_1_5_tiny"]
    by_model = {m["model"]: m["queries"] for m in first["models"]}
    assert by_model == {"qwen2_vl_tiny": 2, "qwen2_5_vl_tiny": 2, "llava_1_5_tiny": 1}, "LLaVA takes no video"
    for q in first["queries"]:
        assert q["latency_ms"] > 0 and q["new_tokens"] <= 2 and q["truth"] != ""
    report = json.loads((vlora_home / "results" / "smoke" / "report.json").read_text())
    assert report["models"] == first["models"]
    assert "accuracy" in capsys.readouterr().out

    smoke.run(cfg)
    err = capsys.readouterr().err
    assert err.count(": kept ") == 3, "the second run reuses the zoo"
    assert "0 rendered" in err, "and the world"
