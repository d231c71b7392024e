"""Routing by the fusion manifest without a server: a domain whose adapter misses its accuracy
requirement is never routed to, and the route's reason says so."""

from __future__ import annotations

from adapters.manifest import read_manifest, write_manifest
from apps.common.routing import ServerCaps, resolve_route
from fusion import Domain, FusedAdapter, FusionResult


def _manifest(tmp_path):
    order = [Domain("exists_bus", "binary", 0.7), Domain("exists_bicycle", "binary", 0.7)]
    ok = FusedAdapter(0, "fused_0", ["exists_bus"], {"exists_bus": 0.9}, {"exists_bus": 0.7}, True, None)
    miss = FusedAdapter(4, "fused_4", ["exists_bicycle"], {"exists_bicycle": 0.64}, {"exists_bicycle": 0.7},
                        False, None)
    return read_manifest(write_manifest(FusionResult([ok, miss], [], order), tmp_path))


def test_a_missed_requirement_falls_back_with_the_reason(tmp_path):
    manifest, caps = _manifest(tmp_path), ServerCaps(frozenset({"fused_0", "fused_4"}))
    route = resolve_route("exists_bicycle", 0.5, manifest, caps)
    assert route.adapter is None and route.output_mode == "generate"
    assert "fused_4 on exists_bicycle misses its requirement (0.64 < 0.7)" in route.reason
    assert route.reason.endswith("base model")
    by_type = resolve_route("binary", 0.5, manifest, caps)
    assert by_type.adapter == "fused_0" and "fused_4 on exists_bicycle misses its requirement" in by_type.reason
    assert "skipped" not in resolve_route("exists_bus", 0.5, manifest, caps).reason
