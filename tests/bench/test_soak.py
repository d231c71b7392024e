"""The soak (`vlora bench bench.suite=soak bench.soak.preset=quick`) end to end on CPU: a real
`vlora serve` subprocess through every phase, then the report's structure and the server's survival.
Timing ratios (fairness, latency after) are measured but not asserted: a shared CI machine's noise
would decide them."""

from __future__ import annotations

import csv
import json

from bench.soak import PHASES
from vlora.commands.bench import run
from vlora.config import compose

CHECKS = {"server_alive", "legit_answered", "legit_p95_after", "kv_blocks_free", "requests_in_flight",
          "requests_waiting_running", "pixels_in_flight", "adapter_slots", "connections_left", "internal_errors",
          "rss_growth", "log_size", "fairness_p95_ratio", "lockout_connect_served",
          "http_lockout_connect_served",
          "fairness_topup4_p95_ratio", "fairness_poll32_p95_ratio",  # the quick preset's floods
          *(f"phase_{p}" for p in PHASES if p not in ("flood", "floods", "lockout", "http_lockout"))}


def test_quick_soak_on_cpu(tiny_zoo, tmp_path):
    cfg = compose("bench", ["bench.suite=soak", "bench.soak.preset=quick", f"bench.soak.checkpoint={tiny_zoo['qwen2_vl_tiny']}",
                            f"bench.out_dir={tmp_path}"])
    result = run(cfg)
    checks = {c["check"]: c for c in result["soak"]}
    assert set(checks) == CHECKS
    report = json.loads((tmp_path / "cpu" / "soak.json").read_text())
    assert report["checks"] == result["soak"]
    assert report["passed"] == all(c["pass"] for c in result["soak"])
    assert report["missed"] == [c["check"] for c in result["soak"] if not c["pass"]]
    with open(tmp_path / "cpu" / "soak.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["check"] for r in rows] == [c["check"] for c in result["soak"]]

    # every phase ran, did something, and left the server up
    assert list(report["phases"]) == list(PHASES)
    for name, phase in report["phases"].items():
        assert "error" not in phase, (name, phase)
        assert phase["actions"] > 0 and phase["server_alive"], (name, phase)
    # hostile requests are answered with a reason, oversize ones end their connection
    malformed = report["phases"]["malformed"]["by_case"]
    assert malformed["top_k_2_63"] == {"refused": malformed["top_k_2_63"]["refused"]}
    assert set(malformed["compressed_bomb"]) == {"closed"} and set(malformed["oversize_frame"]) == {"closed"}
    assert report["phases"]["handshake"]["lingering"] == 0
    # the tenant phases: nothing of the victim's reachable, nothing amplified, no bomb decoded, no
    # number that fails a step (these hold whatever the machine's speed)
    for name in ("phase_boundary", "phase_amplify", "phase_numbers"):
        assert checks[name]["pass"], (name, report["phases"][name.removeprefix("phase_")])
    decode = report["phases"]["decode"]
    assert decode["attacker"].get("accepted", 0) == 0 and not decode["victim_errors"], decode
    for name in ("lockout", "http_lockout"):  # the HTTP port's door too (the dev extras bring the HTTP front end)
        assert report["phases"][name]["served_s"], report["phases"][name]

    # the server survived, answers, and leaked nothing
    for name in ("server_alive", "legit_answered", "kv_blocks_free", "requests_in_flight", "requests_waiting_running",
                 "pixels_in_flight", "adapter_slots", "connections_left", "log_size"):
        assert checks[name]["pass"], checks[name]
    floods = report["phases"]["floods"]["by_flood"]  # topup4's window alone after it is poll32's before it
    assert floods["topup4"]["quiet_after"] == floods["poll32"]["quiet"] and floods["poll32"]["quiet_after"]["n"] > 0
    assert "ms before" in checks["fairness_topup4_p95_ratio"]["bound"], checks["fairness_topup4_p95_ratio"]
    flood = report["phases"]["flood"]
    assert flood["probe"]["n"] > 0 and flood["ratio"] > 0 and flood["flood"]["submitted"] > 0
    assert report["baseline"]["rss_mb"] > 0 and report["after"]["rss_mb"] > 0
