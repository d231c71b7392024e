"""The soak's `own64` flood comes from another connection of the victim's own tenant, not from the
attacker: run against a real `vlora serve` on CPU with an attacker token the server does not know, it
still floods (its requests finish) and the victim is measured under it. A flood sent with the
attacker's token would be refused at the door and finish nothing."""

from __future__ import annotations

import secrets

from bench.soak import _tenants
from bench.soak_floods import FLOODS, OWN_FLOODS, flood_phases
from bench.soak_server import ServerUnderTest


def test_the_own_flood_holds_the_victims_token_and_a_tenant_flood_the_attackers(tiny_zoo, tmp_path):
    assert OWN_FLOODS <= set(FLOODS)
    checkpoint = str(tiny_zoo["qwen2_vl_tiny"])
    tokens, tenants_file = _tenants(tmp_path, checkpoint)
    server = ServerUnderTest(checkpoint, tmp_path, tokens["ops"], "cpu",
                             ["+engine.num_kv_blocks=48", "engine.max_batch_size=8", f"rpc.tenants={tenants_file}"], 1)
    unknown = secrets.token_hex(16)  # no tenant holds it
    try:
        # 20 probes: the CPU window is the probes' time, and the flood's client polls at about a tenth of a
        # core; /proc counts whole ticks of 10 ms, so 4 probes (0.1 s) could read its process as 0 ticks
        out = flood_phases(server.port, unknown, tokens["victim"], ["own64", "topup4"], seconds=3.0, probes=20,
                           probe_tokens=2, unloaded_p95_ms=100.0, max_ratio=1e9, server_pid=server.proc.pid)
        assert server.proc.poll() is None
    finally:
        server.stop()
    own, tenant = out["own64"], out["topup4"]
    assert own["flood"].get("submitted", 0) > 0 and own["flood"].get("finished", 0) > 0, own["flood"]
    assert own["probe"]["n"] > 0 and not own["victim_errors"], own
    assert own["cpu"]["cores"]["flood"] > 0  # the flood's own process did the sending
    # the same code with the attacker's (unknown) token: nothing goes in
    assert tenant["flood"].get("submitted", 0) == 0 and tenant["flood"].get("finished", 0) == 0, tenant["flood"]
    # the gate's counts by tenant: the own flood's are the victim's alone; an unknown token has none to read
    assert set(own["gate"]) == {"victim"} and own["gate"]["victim"]["gate_calls"] > own["probe"]["n"], own["gate"]
    assert tenant["gate"]["attacker"] == {} and tenant["gate"]["victim"]["gate_calls"] > 0, tenant["gate"]
