"""`vlora simulate`: every orchestrator policy over generated workloads (or a replayed trace) on a
cost profile, in the discrete-event simulator. CPU only; writes CSV, a Markdown table and plots."""

from __future__ import annotations

import re
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf


def run(cfg: DictConfig) -> dict:
    from serve.orchestrator import CostProfile, WorkloadSpec, assumed_profile, build_policy, read_trace
    from serve.sim import EvalJob, SimConfig, run_sweeps, simulate
    from serve.sim.report import metrics_table, plot, profile_label, table

    s = cfg.simulate
    profile = CostProfile.load(s.profile) if s.profile else assumed_profile()
    all_policies = OmegaConf.to_container(cfg.policies, resolve=True)
    chosen = list(s.policies) if s.get("policies") else list(all_policies)
    unknown = sorted(set(chosen) - set(all_policies))
    if unknown:
        raise SystemExit(f"simulate.policies: {unknown} not configured; configured: {sorted(all_policies)}")
    policies = {name: all_policies[name] for name in chosen}
    out = Path(s.out_dir) / re.sub(r"[^A-Za-z0-9_.-]+", "_", profile.name)
    out.mkdir(parents=True, exist_ok=True)
    profile.save(out / "profile.json")
    say = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    say(f"profile: {profile_label(profile)}")

    if s.trace:
        trace = read_trace(s.trace)
        results = {}
        for name, params in policies.items():
            result = simulate(trace, build_policy(name, profile, params), profile,
                              SimConfig(s.max_batch_size, s.max_tokens_per_step))
            results[name] = result.metrics.as_row()
            say(f"{name}: {results[name]['avg_token_latency_ms']:.1f} ms/token")
        text = f"Trace {s.trace} ({len(trace)} requests), {profile_label(profile)}\n\n{metrics_table(results)}\n"
        (out / "trace_table.md").write_text(text)
        print(text)
        return {"out_dir": str(out), "results": results, "table": text}

    workload = WorkloadSpec(**OmegaConf.to_container(cfg.workload, resolve=True))
    job = EvalJob(policies=policies, workload=workload, max_batch_size=s.max_batch_size,
                  max_tokens_per_step=s.max_tokens_per_step, rates=list(s.rates), skewness=list(s.skewness),
                  adapters=list(s.adapters), seeds=list(s.seeds), sweeps=list(s.sweeps))
    rows = run_sweeps(job, profile, out / "results.csv", progress=say)
    text = table(rows, profile)
    (out / "table.md").write_text(text + "\n")
    plots = plot(rows, profile, out)
    print(text)
    say(f"wrote {out / 'results.csv'}, {out / 'table.md'}, " + ", ".join(p.name for p in plots))
    return {"out_dir": str(out), "rows": rows, "table": text, "plots": [str(p) for p in plots]}
