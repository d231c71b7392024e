"""The simulator prices steps as the profile says; in long randomized runs no request starves
past its threshold and every switch is accounted for; `vlora simulate` writes its results."""

from __future__ import annotations

import csv
import subprocess
import sys
from pathlib import Path

import pytest
from orchestrator_cases import linear_profile, req

from serve.orchestrator import Mode, VLoRAConfig, VLoRAPolicy, WorkloadSpec, assumed_profile, build_policy, \
    generate, write_trace
from serve.sim import SimConfig, simulate

ROOT = Path(__file__).resolve().parents[3]


def test_one_request_alone_takes_its_prefill_then_one_step_per_token():
    p = linear_profile()
    one = simulate([req("r", "a", 100.0, prompt=100, out=10)], build_policy("unmerge_only", p), p)
    rec = one.records[0]
    prefill, decode = p.batch_ms(Mode.unmerge(), [("a", 100)]), p.batch_ms(Mode.unmerge(), [("a", 1)])
    assert rec.first_scheduled_ms == 100.0 and rec.first_token_ms == pytest.approx(100.0 + prefill)
    assert rec.latency_ms == pytest.approx(prefill + 9 * decode) and one.steps == 10


def test_long_prompts_prefill_in_chunks_and_head_requests_end_with_their_prefill():
    p = linear_profile()
    trace = [req("long", None, 0.0, prompt=5000, out=3), req("head", None, 1.0, prompt=50, out=1, output_mode="head")]
    res = simulate(trace, build_policy("fcfs", p), p, SimConfig(max_tokens_per_step=2048, keep_timeline=True))
    assert [s.tokens for s in res.timeline] == [2048, 2048, 904 + 50, 1, 1]
    long, head = res.records
    assert head.finish_ms == pytest.approx(sum(s.step_ms for s in res.timeline[:3]))
    assert long.first_token_ms == head.finish_ms and long.finish_ms == pytest.approx(res.timeline[-1].start_ms
                                                                                      + res.timeline[-1].step_ms)


def _max_overshoot(trace, result, threshold):
    by_id = {r.request_id: r for r in trace}
    return max(rec.wait_ms - threshold(by_id[rec.request_id]) for rec in result.records)


@pytest.mark.parametrize("seed", [0, 1])
def test_no_request_waits_past_its_threshold_in_a_long_randomized_run(seed):
    profile = assumed_profile()
    trace = generate(WorkloadSpec(rate=4.0, duration_s=120.0, skewness=0.8, num_adapters=8, base_share=0.05,
                                  seed=seed))
    sim = SimConfig(max_batch_size=64, max_tokens_per_step=8192, keep_timeline=True)
    config = VLoRAConfig(share_of="present")
    res = simulate(trace, VLoRAPolicy(profile, config), profile, sim)
    assert res.metrics.completed == len(trace) > 400
    assert res.mode_ms["merge"] > 1000 and res.mode_ms["mixture"] > 1000, "the run must exercise merge and mixture"
    threshold = VLoRAPolicy(profile, config).threshold_ms
    one_step = max(s.step_ms for s in res.timeline) + 2 * max(s.ms for s in res.switches)
    assert _max_overshoot(trace, res, threshold) <= one_step
    # the same trace under merge only (no credits): requests do starve, so the check can fail
    merge_only = simulate(trace, build_policy("merge_only", profile), profile, sim)
    assert _max_overshoot(trace, merge_only, threshold) > 10 * one_step


@pytest.mark.parametrize("name", ["v_lora_paper", "dlora", "merge_only"])
def test_stats_account_for_every_switch(name):
    profile = assumed_profile()
    trace = generate(WorkloadSpec(rate=5.0, duration_s=60.0, skewness=0.9, num_adapters=4, seed=7))
    policy = build_policy(name, profile)
    policy.log = type(policy.log)(maxlen=None)
    res = simulate(trace, policy, profile, SimConfig(max_batch_size=16))
    merged, changes, cost = None, 0, 0.0
    for rec in policy.log:  # independent count: merged adapter changes between consecutive decisions
        now = rec.mode.partition("(")[2].rstrip(")") or None
        if now != merged:
            changes += 1
            cost += profile.switch_cost_ms(policy.switch_op, merged, now)
        merged = now
    assert changes > 2
    assert len(res.switches) == res.metrics.switches == policy.stats.switches == changes
    assert sum(s.ms for s in res.switches) == pytest.approx(policy.stats.switch_ms) == pytest.approx(cost)
    assert res.metrics.switch_ms == pytest.approx(cost) and policy.stats.decisions == len(policy.log)


def test_every_policy_serves_every_request_deterministically():
    profile = assumed_profile()
    trace = generate(WorkloadSpec(rate=3.0, duration_s=20.0, skewness=0.7, num_adapters=4, base_share=0.1, seed=2))
    for name in ("v_lora", "v_lora_paper", "merge_only", "unmerge_only", "dlora", "dlora_atmm", "fcfs"):
        first = simulate(trace, build_policy(name, profile), profile).metrics
        again = simulate(trace, build_policy(name, profile), profile).metrics
        assert first.completed == len(trace) and first == again, name


def test_the_orchestrator_imports_no_torch():
    # a fresh interpreter importing it as any caller would: nothing may pull torch in
    code = ("import sys; import serve.orchestrator, serve.sim as s; s.simulate; "
            "print(sorted(m for m in ('torch', 'triton', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def _compose(overrides):
    from vlora.config import compose

    return compose("simulate", overrides)


def test_simulate_command_writes_csv_table_and_plots_and_resumes(tmp_path, capsys):
    from vlora.commands import simulate as command

    overrides = [f"simulate.out_dir={tmp_path}", "simulate.rates=[2,5]", "simulate.skewness=[0.9]",
                 "simulate.adapters=[4]", "simulate.seeds=[0]", "workload.duration_s=10", "workload.rate=5"]
    out = command.run(_compose(overrides))
    folder = tmp_path / "assumed-paper-a100-7b"
    rows = list(csv.DictReader(open(folder / "results.csv")))
    assert len(rows) == 4 * 7 and {r["policy"] for r in rows} == {"v_lora", "v_lora_paper", "merge_only",
                                                                    "unmerge_only", "dlora", "dlora_atmm", "fcfs"}
    assert all((folder / f"latency_vs_{s}.png").stat().st_size > 10_000 for s in ("rate", "skewness", "adapters"))
    assert "ASSUMED" in (folder / "table.md").read_text() and "| 0.9 |" in out["table"]
    assert (folder / "profile.json").is_file()
    command.run(_compose(overrides))
    assert len(list(csv.DictReader(open(folder / "results.csv")))) == 4 * 7, "a rerun keeps the finished points"
    assert "[1/" not in capsys.readouterr().err.split("profile:")[-1]

    trace = write_trace(tmp_path / "t.jsonl", generate(WorkloadSpec(rate=3.0, duration_s=5.0, seed=1)))
    got = command.run(_compose(overrides + [f"simulate.trace={trace}", "simulate.policies=[v_lora,dlora]"]))
    assert set(got["results"]) == {"v_lora", "dlora"} and "| dlora |" in (folder / "trace_table.md").read_text()


def test_the_simulator_runs_the_engines_scheduler_with_its_memory_limit():
    # the engine's scheduler and block manager: with few K/V blocks, running requests are preempted
    # (recompute) and still every request completes, later than with memory to spare
    profile = assumed_profile()
    trace = generate(WorkloadSpec(rate=8.0, duration_s=6.0, skewness=0.5, num_adapters=2, base_share=0.2, seed=5))
    longest = max(-(-(r.prompt_tokens + r.output_tokens) // 16) for r in trace)  # blocks of the longest request
    roomy = simulate(trace, build_policy("unmerge_only", profile), profile, SimConfig(max_batch_size=8))
    tight = simulate(trace, build_policy("unmerge_only", profile), profile,
                     SimConfig(max_batch_size=8, kv_blocks=longest + 2))
    assert roomy.metrics.completed == tight.metrics.completed == len(trace)
    assert tight.steps > roomy.steps and tight.metrics.avg_latency_ms > roomy.metrics.avg_latency_ms
