"""The seeds table of the offline stage: reports already on disk are read, not run again; a
missed requirement in any seed shows in its row and in the count of runs that met them all."""

from __future__ import annotations

import json
import re

from bench.offline_seeds import main


def _report(root, seed, fused, total=1.0, intervals=None):
    rows = [{"domain": d, "requirement": req, "fused": acc, "meets_requirement": acc >= req,
             "one_adapter_for_all": acc - 0.1, "one_adapter_per_domain": acc,
             **({"fused_95": intervals[d]} if intervals and d in intervals else {})}
            for d, (req, acc) in fused.items()]
    path = root / f"seed{seed}" / "results" / "offline"
    path.mkdir(parents=True)
    (path / "report.json").write_text(json.dumps({"domains": rows, "adapters": {"fused": 1 + seed},
                                                  "timings_s": {"total_s": total}}))


def test_seeds_table_from_existing_reports(tmp_path):
    _report(tmp_path, 0, {"count": (0.45, 0.6), "color": (0.7, 0.8)})
    _report(tmp_path, 1, {"count": (0.45, 0.44), "color": (0.7, 0.75)})
    main(["--root", str(tmp_path), "--seeds", "0", "1", "--out", str(tmp_path / "out")])
    md = (tmp_path / "out" / "seeds.md").read_text()
    assert "Every requirement met in 1 of 2 runs; domains per adapter 2.0, 1.0" in md
    assert "0.440/0.45" in md and "0.600/0.45" in md
    saved = json.loads((tmp_path / "out" / "seeds.json").read_text())
    assert set(saved["reports"]) == {"0", "1"} and saved["extra_args"] == []
    assert not (tmp_path / "seed0.log").exists(), "a seed with a report is not run again"


def test_a_verdict_inside_the_scores_interval_is_starred(tmp_path):
    _report(tmp_path, 0, {"bus": (0.8, 0.77), "color": (0.7, 0.83)},
            intervals={"bus": "0.715-0.817", "color": "0.780-0.870"})
    _report(tmp_path, 1, {"bus": (0.8, 0.85)})  # an older report without intervals: no star
    main(["--root", str(tmp_path), "--seeds", "0", "1", "--out", str(tmp_path / "out")])
    md = (tmp_path / "out" / "seeds.md").read_text()
    assert "0.770/0.8*" in md and re.search(r"0\.830/0\.7(?!\*)", md) and re.search(r"0\.850/0\.8(?!\*)", md)
    assert "* the requirement lies inside" in md


def test_fusion_against_the_other_methods_is_called_only_when_the_seeds_resolve_it(tmp_path):
    from bench.offline_seeds import against_others, seed_rows

    def rep(fused, all_in_one, per_domain):
        return {"adapters": {"fused": 1}, "domains": [
            {"domain": "a", "requirement": 0.5, "fused": fused, "meets_requirement": True,
             "one_adapter_for_all": all_in_one, "one_adapter_per_domain": per_domain}]}

    # against all-in-one the differences change sign (-0.014, +0.016, -0.013); against one per domain
    # they are +0.10 +- 0.01 in every seed
    rows = seed_rows({0: rep(0.674, 0.688, 0.57), 1: rep(0.679, 0.663, 0.58), 2: rep(0.667, 0.680, 0.57)})
    assert [r["fused_mean"] for r in rows] == [0.674, 0.679, 0.667]
    all_in_one, per_domain = against_others(rows)
    # scipy.stats.t.interval(0.95, 2, loc=mean, scale=sem) of the three differences: -0.0460 to +0.0387
    assert "mean -0.004, 95% interval -0.046 to +0.039 over 3 runs: the runs do not resolve" in all_in_one
    assert per_domain.startswith("Fused minus one adapter per domain") and per_domain.endswith("fusion ahead.")
    assert against_others(rows[:1]) == [], "one seed gives no interval"


def test_the_table_is_rebuilt_from_saved_runs_without_running(tmp_path):
    _report(tmp_path, 0, {"count": (0.45, 0.6)})
    _report(tmp_path, 1, {"count": (0.45, 0.5)})
    main(["--root", str(tmp_path), "--seeds", "0", "1", "--out", str(tmp_path / "out")])
    main(["--from-json", str(tmp_path / "out" / "seeds.json"), "--out", str(tmp_path / "again")])
    md = (tmp_path / "again" / "seeds.md").read_text()
    assert f"command: `python -m bench.offline_seeds --root {tmp_path} --seeds 0 1" in md
    assert "tabulated from its saved reports by: `python -m bench.offline_seeds --from-json" in md
    assert "0.500/0.45" in md and "Fused minus one adapter for all" in md
    assert not (tmp_path / "seed2").exists()


def test_vlora_bench_runs_the_seeds_as_its_offline_suite(tmp_path, vlora_home):
    from vlora.commands.bench import run
    from vlora.config import compose

    _report(tmp_path, 0, {"count": (0.45, 0.6)})  # reports on disk: the suite tabulates them, runs nothing
    _report(tmp_path, 1, {"count": (0.45, 0.5)})
    cfg = compose("bench", ["bench.suite=offline", f"bench.offline.root={tmp_path}", "bench.offline.seeds=[0,1]",
                            f"bench.out_dir={tmp_path}/out"])
    rows = run(cfg)["offline"]
    assert [r["all_met"] for r in rows] == [True, True]
    assert "Every requirement met in 2 of 2 runs" in (tmp_path / "out" / "seeds.md").read_text()
