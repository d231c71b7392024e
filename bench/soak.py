"""The soak (`vlora bench bench.suite=soak`): every attack class against a real `vlora serve`, then
checks that nothing leaked.

It starts its own server on loopback (the tiny zoo model built into a temporary VLORA_HOME unless a
checkpoint is given, a handful of KV blocks so that a leak shows) and measures a baseline: the
server's resident memory, a legitimate client's latency over `baseline_requests` requests, and the
engine's counters through health() and metrics(). Then the phases, each bounded by its time and
its count: handshake sockets, malformed and hostile requests, results never polled, disconnects
mid-request, a flood from one client while another measures its latency (the fairness ratio),
and the earlier fuzz. After `settle_s` it checks: the server alive, a legitimate client answered
within 2x its baseline p95, KV blocks, requests in flight, decoded pixels and adapter slots back to
the baseline, resident memory within `rss_tolerance` of it, no handler crashed (internal errors),
the log under `log_max_bytes`. Each check is a row of soak.csv with its value and bound.
"""

from __future__ import annotations

import gzip
import json
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from bench.results import results_dir, write_csv, write_json
from bench.soak_attacks import fuzz_phase, handshake_phase, malformed_phase
from bench.soak_floods import FLOODS, HTTP_FLOODS, OWN_FLOODS, flood_phases
from bench.soak_load import disconnect_phase, flood_phase, unpolled_phase
from bench.soak_server import ServerUnderTest, latency_summary, legit_latencies, snapshot
from bench.soak_tenancy import (amplify_phase, boundary_phase, decode_phase, http_lockout_phase, lockout_phase,
                                numbers_phase)


@dataclass
class SoakJob:
    out_dir: str
    checkpoint: str | None = None  # an HF directory; null: the tiny zoo model `model`, built in a temporary home
    model: str = "qwen2_vl_tiny"
    device: str = "cpu"
    server_threads: int | None = 1  # the server's OpenMP threads (None: its own choice, rpc.engine_threads)
    num_kv_blocks: int = 48
    max_batch_size: int = 8
    handshake_timeout_s: float = 2.0
    max_handshakes: int = 16
    max_unpolled_per_connection: int = 8
    result_ttl_s: float = 30.0
    max_message_bytes: int = 4 << 20
    probe_tokens: int = 2  # a legitimate request: one 32x32 image, this many tokens out
    baseline_requests: int = 50
    final_requests: int = 50
    handshake_s: float = 20.0
    handshake_sockets: int = 600
    malformed_s: float = 20.0
    malformed_count: int = 3000
    bomb_mb: int = 64  # all-zero raw frame bytes of the compressed bomb
    unpolled_s: float = 15.0
    unpolled_count: int = 2000
    unpolled_tokens: int = 4
    disconnect_s: float = 15.0
    disconnect_count: int = 1000
    disconnect_tokens: int = 16
    flood_s: float = 30.0
    flood_depth: int = 64
    flood_tokens: int = 16
    flood_probes: int = 40
    fairness_max_ratio: float = 2.0
    fuzz_s: float = 20.0
    fuzz_bytes_count: int = 5000
    fuzz_calls_count: int = 100000
    # a server shared by tenants (bench/soak_tenancy.py, bench/soak_floods.py): the attacks come from
    # tenant "attacker", the legitimate requests from tenant "victim", the checks from the operator
    lockout_s: float = 20.0
    lockout_sockets: int = 1000  # idle and trickling sockets from 127.0.0.2, reopened when dropped
    lockout_probes: int = 10  # connections from 127.0.0.3, each connected and served within lockout_max_s
    lockout_max_s: float = 1.0
    numbers_s: float = 15.0
    numbers_victim_tokens: int = 24
    amplify_connections: int = 24
    amplify_bytes: int = 3 << 20  # under max_message_bytes: the call arrives, the reply must not echo it
    decode_s: float = 15.0
    decode_connections: int = 4
    decode_frames: int = 8
    floods: tuple = ("long", "topup4", "queue2048", "topup32", "poll32")
    floods_s: float = 20.0
    floods_probes: int = 200
    floods_client_nice: int = 0  # the flood's client process's niceness (0-19; bench/soak_floods.py)
    settle_s: float = 3.0
    settle_max_s: float = 30.0  # waits up to this for requests in flight to drain before checking
    rss_tolerance: float = 0.10
    latency_max_ratio: float = 2.0
    log_max_bytes: int = 1 << 20
    seed: int = 0
    server_overrides: tuple = ()  # more `vlora serve` overrides, e.g. ("rpc.gate_share=0.5",)
    phases: tuple = ()  # which of PHASES run (in PHASES' order); empty: all of them
    command: str = ""


PHASES = ("handshake", "lockout", "http_lockout", "malformed", "numbers", "boundary", "amplify", "decode", "unpolled",
          "disconnect", "flood", "floods", "fuzz")


def _phase(name: str, job: SoakJob, server: ServerUnderTest, tokens: dict, unloaded_p95_ms: float, root: Path) -> dict:
    token, victim, port = tokens["attacker"], tokens["victim"], server.port
    if name == "lockout":
        return lockout_phase(port, victim, job.lockout_s, job.lockout_sockets, job.lockout_probes, job.lockout_max_s)
    if name == "http_lockout":  # the same at the OpenAI-compatible HTTP port (serve/http/door.py)
        return http_lockout_phase(server.http_port, victim, job.lockout_s, job.lockout_sockets, job.lockout_probes,
                                  job.lockout_max_s)
    if name == "numbers":
        return numbers_phase(port, token, victim, job.numbers_s, job.numbers_victim_tokens)
    if name == "boundary":
        return boundary_phase(port, tokens["ops"], victim, token, str(root))
    if name == "amplify":
        return amplify_phase(port, token, job.amplify_connections, job.amplify_bytes)
    if name == "decode":
        return decode_phase(port, token, victim, job.decode_s, job.decode_connections, job.decode_frames)
    if name == "floods":
        floods = flood_phases(port, token, victim, job.floods, job.floods_s, job.floods_probes, job.probe_tokens,
                              unloaded_p95_ms, job.fairness_max_ratio, job.floods_client_nice, server.http_port,
                              server.proc.pid)
        return {"actions": sum(f["actions"] for f in floods.values()), "by_flood": floods,
                "ok": all(f["ok"] for f in floods.values())}
    if name == "handshake":
        return handshake_phase(port, job.handshake_s, job.handshake_sockets, job.handshake_timeout_s)
    if name == "malformed":
        return malformed_phase(port, token, job.malformed_s, job.malformed_count, job.max_message_bytes, job.bomb_mb)
    if name == "unpolled":
        return unpolled_phase(port, token, job.unpolled_s, job.unpolled_count, job.unpolled_tokens)
    if name == "disconnect":
        return disconnect_phase(port, token, job.disconnect_s, job.disconnect_count, job.disconnect_tokens)
    if name == "flood":  # the earlier single-tenant flood: attacker and victim hold one token
        return flood_phase(port, victim, job.flood_s, job.flood_depth, job.flood_tokens, job.flood_probes,
                           job.probe_tokens, unloaded_p95_ms, job.fairness_max_ratio)
    return fuzz_phase(port, token, job.fuzz_s, job.fuzz_bytes_count, job.fuzz_calls_count, job.seed)


def _phases(job: SoakJob) -> tuple:
    unknown = sorted(set(job.phases) - set(PHASES))
    if unknown:
        raise ValueError(f"bench.soak.phases: no phase(s) {unknown}; valid: {list(PHASES)} (empty: all)")
    names = tuple(p for p in PHASES if not job.phases or p in job.phases)
    bad_floods = sorted(set(job.floods) - set(FLOODS)) if "floods" in names else []
    if bad_floods:
        raise ValueError(f"bench.soak.floods: no flood(s) {bad_floods}; valid: {list(FLOODS)}")
    if "http_lockout" in names:
        from serve.http.config import missing_packages

        missing = missing_packages()
        why = missing.split(" but ", 1)[1] if missing else ""  # "starlette is not installed; pip install ..."
        if missing and "http_lockout" in job.phases:
            raise ValueError(f"bench.soak.phases names http_lockout, but {why}")
        if missing:  # all phases asked for: the server has no HTTP port to attack without the extra
            print(f"soak: http_lockout left out: {why}", file=sys.stderr, flush=True)
            names = tuple(p for p in names if p != "http_lockout")
    return names


def _settle(server: ServerUnderTest, token: str, job: SoakJob) -> dict:
    time.sleep(job.settle_s)
    end = time.monotonic() + job.settle_max_s
    while True:
        snap = snapshot(server.port, token)
        if (snap["in_flight"] == 0 and snap["connections"] == 0) or time.monotonic() > end:
            return snap
        time.sleep(0.5)


def _check(name: str, value, bound: str, passed: bool, unit: str = "") -> dict:
    return {"check": name, "value": value, "bound": bound, "unit": unit, "pass": bool(passed)}


def _checks(job: SoakJob, server: ServerUnderTest, base: dict, after: dict | None, final: dict | None,
            rss_after: float | None, phases: dict) -> list[dict]:
    alive = server.alive()
    rows = [_check("server_alive", alive, "running", alive)]
    if final is None:
        rows.append(_check("legit_answered", False, "answered", False))
    else:
        limit = job.latency_max_ratio * base["latency"]["p95_ms"]
        rows.append(_check("legit_answered", True, "answered", True))
        rows.append(_check("legit_p95_after", final["p95_ms"], f"<= {limit:.1f} ({job.latency_max_ratio:g}x baseline p95)",
                           final["p95_ms"] <= limit, "ms"))
    if after is not None:
        b = base["counters"]
        rows += [_check("kv_blocks_free", after["blocks_free"], f"== {b['blocks_free']} (baseline)",
                        after["blocks_free"] == b["blocks_free"], "blocks"),
                 _check("requests_in_flight", after["in_flight"], "== 0", after["in_flight"] == 0),
                 _check("requests_waiting_running", after["waiting"] + after["running"], "== 0",
                        after["waiting"] + after["running"] == 0),
                 _check("pixels_in_flight", after["pixels_in_flight"], "== 0", after["pixels_in_flight"] in (0, None)),
                 _check("adapter_slots", f"{after['adapters_loaded']}/{after['adapters_resident']}",
                        f"== {b['adapters_loaded']}/{b['adapters_resident']} (loaded/resident)",
                        (after["adapters_loaded"], after["adapters_resident"])
                        == (b["adapters_loaded"], b["adapters_resident"])),
                 _check("connections_left", after["connections"], "== 0", after["connections"] == 0)]
        internal = after["server_counters"].get("errors_internal", 0) - b["server_counters"].get("errors_internal", 0)
        rows.append(_check("internal_errors", internal, "== 0", internal == 0))
    if rss_after is not None:
        growth = rss_after / base["rss_mb"] - 1
        rows.append(_check("rss_growth", round(100 * growth, 1), f"<= {100 * job.rss_tolerance:g} "
                           f"(baseline {base['rss_mb']:.0f} MB, after {rss_after:.0f} MB)",
                           growth <= job.rss_tolerance, "%"))
    log_bytes, log_lines = server.log_size()
    rows.append(_check("log_size", log_bytes, f"< {job.log_max_bytes} ({log_lines} lines)",
                       log_bytes < job.log_max_bytes, "bytes"))
    for name, phase in phases.items():
        if name == "flood":
            rows.append(_check("fairness_p95_ratio", phase.get("ratio"), f"<= {job.fairness_max_ratio:g}",
                               phase["ok"], "x"))
        elif name == "floods" and "by_flood" in phase:
            for flood, f in phase["by_flood"].items():
                ci = f.get("ratio_interval")
                detail = f", 95% interval {ci[0]:g}-{ci[1]:g}" if ci else ""
                if f.get("drift") is not None:  # how far the victim alone moved from the window before to after
                    detail += f"; alone {f['quiet']['p95_ms']:g} ms before, {f['quiet_after']['p95_ms']:g} after"
                whose = "another connection of its own" if flood in OWN_FLOODS else "attacker's"
                rows.append(_check(f"fairness_{flood}_p95_ratio", f.get("ratio"),
                                   f"<= {job.fairness_max_ratio:g} (victim tenant, {whose} flood '{flood}'{detail})",
                                   f["ok"], "x"))
        elif name in ("lockout", "http_lockout") and "worst_s" in phase:
            rows.append(_check(f"{name}_connect_served", phase["worst_s"] if not phase["probes_failed"] else
                               f"failed {phase['probes_failed']}", f"<= {job.lockout_max_s:g} s from another address, "
                               f"{job.lockout_sockets} sockets held", phase["ok"], "s"))
        else:
            rows.append(_check(f"phase_{name}", phase.get("error") or _faults(phase),
                               "clean (no internal error, unanswered call, lingering socket)", phase["ok"]))
    return rows


def _faults(phase: dict) -> str:
    """What went wrong in a phase, e.g. "internal=50", or "clean"."""
    outcomes = phase.get("outcomes", {})
    kinds = ("internal", "no_answer", "connection_failed") + (("accepted",) if "by_case" in phase else ())
    faults = {k: outcomes[k] for k in kinds if outcomes.get(k)}  # a hostile case accepted is a fault too
    if phase.get("lingering"):
        faults["lingering"] = phase["lingering"]
    return " ".join(f"{k}={v}" for k, v in faults.items()) or "clean"


def _tenants(home: Path, checkpoint: str) -> tuple[dict, Path]:
    """A tenants file (operator "ops", tenants "victim" and "attacker"; the attacker's quotas let its
    floods reach the sizes the floods name) and each one's adapters under the adapter root."""
    import torch

    from bench.adapter_parts import write_peft_adapter
    from serve.models import read_model_args
    from serve.rpc.tenants import add_tenant

    path = home / "tenants.yaml"
    tokens = {"ops": add_tenant(path, "ops", "operator"), "victim": add_tenant(path, "victim"),
              "attacker": add_tenant(path, "attacker", quotas={"queued": 4096, "connections": 48})}
    args = read_model_args(checkpoint)[0]
    root = home / "adapter_root"
    for i, where in enumerate(("victim/plates", "attacker/other", "shared")):
        write_peft_adapter(root / where, args, 8, ("q_proj", "v_proj"), 7 + i, torch.float32, "cpu")
    return tokens, path


def _needs_http(job: SoakJob, names: tuple) -> bool:
    """Whether the server under soak opens its HTTP port: a phase or a flood attacks it."""
    return "http_lockout" in names or ("floods" in names and bool(set(job.floods) & HTTP_FLOODS))


def run_soak(job: SoakJob) -> tuple[list[dict], dict]:
    """Runs the soak; returns (check rows, the full report) and writes soak.json, soak.csv and, with the
    floods, probes.json.gz (every probe's parts: `read_probes`)."""
    names = _phases(job)  # a misspelt phase is refused before the server is built
    if not 0 <= job.floods_client_nice <= 19:  # a negative one would fail in the flood's process, unseen
        raise ValueError(f"bench.soak.floods_client_nice={job.floods_client_nice}: give 0-19")
    home = Path(tempfile.mkdtemp(prefix="vlora-soak-"))
    checkpoint = job.checkpoint
    if checkpoint is None:
        from zoo import build_checkpoint

        checkpoint = str(build_checkpoint(job.model, home / "zoo" / job.model))
    tokens, tenants_file = _tenants(home, checkpoint)
    token = tokens["ops"]  # the operator's: the checks read the server as its operator would
    overrides = [f"+engine.num_kv_blocks={job.num_kv_blocks}", f"engine.max_batch_size={job.max_batch_size}",
                 f"rpc.handshake_timeout_s={job.handshake_timeout_s}", f"rpc.max_handshakes={job.max_handshakes}",
                 f"rpc.max_unpolled_per_connection={job.max_unpolled_per_connection}",
                 f"rpc.result_ttl_s={job.result_ttl_s}", f"rpc.max_message_bytes={job.max_message_bytes}",
                 f"rpc.adapter_root={home / 'adapter_root'}", f"rpc.tenants={tenants_file}",
                 *(("http.port=0", "http.host=127.0.0.1") if _needs_http(job, names) else ()), *job.server_overrides]
    started = time.time()
    server = ServerUnderTest(checkpoint, home, token, job.device, overrides, job.server_threads)
    base, phases, after, final, rss_after = {}, {}, None, None, None
    try:
        victim = tokens["victim"]
        legit_latencies(server.port, victim, 3, job.probe_tokens)  # warm-up, not measured
        base["latency"] = latency_summary(legit_latencies(server.port, victim, job.baseline_requests, job.probe_tokens))
        base["counters"] = snapshot(server.port, token)
        base["rss_mb"] = round(server.rss_mb(), 1)
        print(f"soak: baseline p50 {base['latency']['p50_ms']:.0f} ms, p95 {base['latency']['p95_ms']:.0f} ms, "
              f"RSS {base['rss_mb']:.0f} MB", file=sys.stderr, flush=True)
        for name in names:
            t0 = time.monotonic()
            try:
                phases[name] = _phase(name, job, server, tokens, base["latency"]["p95_ms"], home / "adapter_root")
            except Exception as e:  # the phase's own failure (e.g. the server gone): recorded, the run goes on
                phases[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"[:300]}
            phases[name]["seconds"] = round(time.monotonic() - t0, 1)
            phases[name]["server_alive"] = server.alive()
            print(f"soak: {name} done in {phases[name]['seconds']} s, ok={phases[name]['ok']}", file=sys.stderr,
                  flush=True)
            if not server.alive():
                break
        if server.alive():
            after = _settle(server, token, job)
            final = latency_summary(legit_latencies(server.port, victim, job.final_requests, job.probe_tokens))
            rss_after = round(server.rss_mb(), 1)
    except Exception as e:
        base.setdefault("error", f"{type(e).__name__}: {e}"[:300])
    finally:
        checks = _checks(job, server, base, after, final, rss_after, phases) if "latency" in base else \
            [_check("baseline", base.get("error"), "measured", False)]
        log_tail = server.log_tail()
        server.stop()
        shutil.rmtree(home, ignore_errors=True)
    report = {"meta": {**asdict(job), "checkpoint": job.checkpoint or f"zoo:{job.model}",
                       "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(started)),
                       "seconds": round(time.time() - started, 1)},
              "baseline": base, "phases": phases, "after": {"counters": after, "latency": final, "rss_mb": rss_after},
              "checks": checks, "passed": all(c["pass"] for c in checks),
              "missed": [c["check"] for c in checks if not c["pass"]], "log_tail": log_tail}
    out = results_dir(job.out_dir, "cpu" if job.device == "cpu" else _device_name(job.device))
    probes = _take_probes(report)
    write_json(out / "soak.json", report)
    if probes:
        write_probes(out / "probes.json.gz", probes)
    write_csv(out / "soak.csv", checks, columns=("check", "value", "bound", "unit", "pass"))
    print_table(report)
    return checks, report


def _take_probes(report: dict) -> dict:
    """Every flood's per-probe parts, taken out of the report: "floods/topup32" -> {"probes": [...],
    "quiet_probes": [...]}. Kept in the report, 200 probes of 30 parts under each of five floods made a
    run's soak.json 1-2 MB; the report keeps each flood's summary (`where`), the probes go to
    probes.json.gz."""
    out = {}
    for phase, body in report["phases"].items():
        for flood, row in ((body.get("by_flood") or {}) if isinstance(body, dict) else {}).items():
            taken = {k: row.pop(k) for k in ("probes", "quiet_probes") if k in row}
            if taken:
                out[f"{phase}/{flood}"] = taken
    return out


def write_probes(path: Path, probes: dict) -> Path:
    with gzip.open(path, "wt", compresslevel=9) as f:
        json.dump(probes, f)
    return path


def read_probes(path: str | Path) -> dict:
    """A run's probes.json.gz: "floods/<flood>" -> {"probes": [...], "quiet_probes": [...]}."""
    with gzip.open(path, "rt") as f:
        return json.load(f)


def _device_name(device: str) -> str:
    from bench.results import device_label

    return device_label(device)


def print_table(report: dict) -> None:
    print(f"\nsoak: {report['meta']['seconds']} s; phases:")
    for name, p in report["phases"].items():
        print(f"  {name:<11} {p.get('seconds', 0):>6} s  {p.get('actions', 0):>6} actions  ok={p['ok']}")
    print(f"\n{'check':<26} {'value':>14}  {'bound':<60} pass")
    for c in report["checks"]:
        print(f"{c['check']:<26} {str(c['value']) + c['unit']:>14}  {c['bound']:<60} {'yes' if c['pass'] else 'NO'}")
    print(f"\nsoak: {'all checks passed' if report['passed'] else 'missed: ' + ', '.join(report['missed'])}")
