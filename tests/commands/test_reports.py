"""The offline report tells the truth: a domain whose fused adapter misses its requirement is
flagged in the table and in a line under it, a cell that holds no number says why in a footnote
(the demo's report: test_demo_report.py)."""

from __future__ import annotations

import json

from vlora.commands.offline_report import write_report


def _domains():
    row = {"task": "binary", "requirement": 0.7, "teacher_vs_truth": None, "base_zero_shot": None,
           "one_adapter_per_domain": None, "one_adapter_for_all": None}
    return [{"domain": "exists_bus", **row, "teacher_vs_truth": 0.95, "fused": 0.9, "fused_adapter": "fused_0",
             "meets_requirement": True},
            {"domain": "exists_bicycle", **row, "fused": 0.64, "fused_adapter": "fused_4", "meets_requirement": False}]


NOT_MEASURED = {"base_zero_shot": "the base model's zero-shot answers were not measured (offline.base_eval_limit=0)",
                "teacher_vs_truth": "the domain's dataset records no teacher-vs-truth agreement"}


def test_the_offline_report_flags_a_missed_requirement_and_explains_empty_cells(tmp_path):
    adapters = {"one_adapter_per_domain": 2, "one_adapter_for_all": 1, "fused": 2}
    report = {"model": "qwen2_vl_tiny", "domains": _domains(), "adapters": adapters,
              "head_vs_lm_head": None,
              "not_measured": NOT_MEASURED}
    text = (write_report(report, tmp_path) / "report.md").read_text()
    assert "None" not in text
    bicycle = next(line for line in text.splitlines() if line.startswith("exists_bicycle"))
    assert "MISSED" in bicycle and "-[" in bicycle
    assert "MISSED: exists_bicycle fused 0.64 < requirement 0.7 (adapter fused_4)" in text
    assert "offline.base_eval_limit=0" in text and "teacher-vs-truth" in text
    assert "one_adapter_per_domain: not measured" in text, "a column without a recorded reason still says so"
    assert (tmp_path / "report.png").stat().st_size > 0


def test_the_offline_report_compares_fusion_orders(tmp_path):
    from fusion import Domain, FusedAdapter, FusionResult
    from vlora.commands.offline_report import order_row

    doms = [Domain("count", "count", 0.45, 9), Domain("color", "classify", 0.7, 9), Domain("bus", "binary", 0.8, 9)]
    one = FusionResult([FusedAdapter(0, "fused_0", ["count", "color", "bus"], {"count": 0.5, "color": 0.8, "bus": 0.85},
                                     {}, True, None)], [], doms)
    two = FusionResult([FusedAdapter(0, "fused_0", ["bus", "count"], {"bus": 0.82, "count": 0.4}, {}, True, None),
                        FusedAdapter(1, "fused_1", ["color"], {"color": 0.75}, {}, True, None)], [], doms[::-1])
    rows = [order_row("size_desc", one, doms), order_row("seeded (seed 3)", two, doms)]
    assert rows[0] == {"order": "size_desc", "tried": "count > color > bus", "adapters": 1, "domains_per_adapter": 3.0,
                       "groups": "count+color+bus", "all_met": True, "missed": "-"}
    assert (rows[1]["adapters"], rows[1]["domains_per_adapter"], rows[1]["all_met"], rows[1]["missed"]) == (
        2, 1.5, False, "count")
    adapters = {"one_adapter_per_domain": 2, "one_adapter_for_all": 1, "fused": 2}
    report = {"model": "qwen2_vl_tiny", "domains": _domains(), "adapters": adapters, "orders": rows,
              "head_vs_lm_head": None, "not_measured": NOT_MEASURED}
    text = (write_report(report, tmp_path) / "report.md").read_text()
    assert "Fusion by the order domains are tried in" in text and "seeded (seed 3)" in text and "bus+count | color" in text


def test_wilson_intervals_and_the_near_line_for_a_verdict_within_the_noise():
    from fusion.confidence import score_interval, wilson
    from vlora.commands.offline_report import domain_lines

    lo, hi = wilson(0.5, 100)
    assert (round(lo, 3), round(hi, 3)) == (0.404, 0.596)
    lo, hi = wilson(0.77, 256)  # seed 1's exists_bus: 0.8 lies inside
    assert lo < 0.8 < hi and round(hi - lo, 2) == 0.10
    assert wilson(1.0, 256)[1] == 1.0 and wilson(0.0, 10)[0] == 0.0
    assert score_interval("detect", 0.7, 256) is None, "F1 is no share of items"
    row = {"task": "binary", "teacher_vs_truth": 1.0, "base_zero_shot": 0.69, "one_adapter_per_domain": 0.77,
           "one_adapter_for_all": 0.78, "fused_adapter": "fused_0", "eval_items": 256}
    rows = [{"domain": "exists_bus", **row, "requirement": 0.8, "fused": 0.77,
             "fused_95": score_interval("binary", 0.77, 256), "meets_requirement": False},
            {"domain": "color_main", **row, "requirement": 0.7, "fused": 0.83,
             "fused_95": score_interval("classify", 0.83, 256), "meets_requirement": True},
            {"domain": "detect_car", **row, "requirement": 0.7, "fused": 0.72, "task": "detect",
             "fused_95": score_interval("detect", 0.72, 256), "meets_requirement": True}]
    text = "\n".join(domain_lines({"domains": rows, "not_measured": {
        "fused_95": "detect scores F1, which is no share of items: no binomial interval"}}))
    near = [line for line in text.splitlines() if line.startswith("NEAR:")]
    assert len(near) == 1 and near[0].startswith("NEAR: exists_bus fused 0.77, 95% interval 0.715-0.817 over 256")
    assert "(missed here)" in near[0]
    assert "fused_95: detect scores F1" in text, "the detect row's empty interval cell says why"


def test_the_offline_report_lists_as_not_measured_only_empty_columns_and_counts_only_trained_comparisons(tmp_path):
    """The demo's short offline stage trains no comparison: its report states no adapter count for
    them, and its "not measured" lists only the columns that hold an empty cell."""
    from vlora.commands.offline_report import adapter_counts, not_measured
    from vlora.config import compose

    short = compose("offline", ["offline.per_domain=false", "offline.all_in_one=false"]).offline
    assert adapter_counts(short, 6, 1) == {"fused": 1}
    assert adapter_counts(compose("offline").offline, 6, 2) == {"one_adapter_per_domain": 6, "one_adapter_for_all": 1,
                                                                 "fused": 2}
    rows = _domains()  # teacher_vs_truth empty in one row; fused_95 and fused_of_teacher measured (absent: not rows')
    why = {**NOT_MEASURED, "fused_95": "detect scores F1", "one_adapter_for_all": None}
    assert not_measured(rows, why) == NOT_MEASURED, "measured columns and columns without a reason are left out"
    measured = [{**r, "teacher_vs_truth": 0.9, "base_zero_shot": 0.5} for r in rows]
    assert not_measured(measured, why) == {}
    report = {"model": "qwen2_vl_tiny", "domains": measured, "adapters": {"fused": 1}, "head_vs_lm_head": None,
              "not_measured": {}}
    text = (write_report(report, tmp_path) / "report.md").read_text()
    assert "Adapters: fused 1 (no comparison was trained)" in text and (tmp_path / "report.png").stat().st_size > 0
