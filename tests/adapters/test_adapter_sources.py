"""What a user hands over as adapters: a `vlora train` directory is routed like a one-adapter
manifest, several manifests combine into one view with distinct names, and a clash is refused."""

from __future__ import annotations

import pytest
from base_cases import fusion_run, train_adapter

from adapters import ManifestError, read_sources
from apps.common.routing import ServerCaps, load_manifest, resolve_route

NAME = "qwen2_vl_tiny"


@pytest.fixture(scope="module")
def trained(tiny_zoo, tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    base = tiny_zoo[NAME]
    return {"base": base, "root": root,
            "plates": train_adapter(base, root / "plates", {"plate": ("detect", 0.8)}, seed=3),
            "bus": train_adapter(base, root / "bus", {"exists_bus": ("binary", 0.9)}, seed=4),
            "truck": train_adapter(base, root / "truck", {"exists_truck": ("binary", 0.7)}, seed=6)}


def test_a_single_train_adapter_directory_is_routed_by_the_app(trained):
    manifest = load_manifest(str(trained["plates"]))
    assert [a["name"] for a in manifest["adapters"]] == ["plates"]
    route = resolve_route("plate", 0.5, manifest, ServerCaps(frozenset({"plates"})))
    assert route.adapter == "plates" and route.expected_accuracy == 0.8 and route.output_mode == "generate"
    assert resolve_route("detect", 0.5, manifest, ServerCaps(frozenset({"plates"}))).adapter == "plates"
    assert resolve_route("plate", 0.9, manifest, ServerCaps(frozenset({"plates"}))).adapter is None


def test_two_fusion_runs_and_a_train_adapter_combine_with_distinct_names(trained):
    root, base = trained["root"], trained["base"]
    cams = fusion_run(root / "cams", {0: (trained["bus"], {"exists_bus": 0.9})}, base)
    roads = fusion_run(root / "roads", {0: (trained["truck"], {"exists_truck": 0.7})}, base)
    found = read_sources([str(cams), str(roads.parent), str(trained["plates"])])
    assert [e.name for e in found.entries] == ["cams_0", "roads_0", "plates"]
    assert all(e.base["path"] == str(base.resolve()) for e in found.entries)
    routes = {k: resolve_route(k, 0.5, found.manifest, ServerCaps(frozenset(e.name for e in found.entries))).adapter
              for k in ("exists_bus", "exists_truck", "plate")}
    assert routes == {"exists_bus": "cams_0", "exists_truck": "roads_0", "plate": "plates"}


def test_clashing_adapter_names_are_refused_naming_both_sources(trained):
    root, base = trained["root"], trained["base"]
    one = fusion_run(root / "a" / "fused", {0: (trained["bus"], {"exists_bus": 0.9})}, base)
    two = fusion_run(root / "b" / "fused", {0: (trained["truck"], {"exists_truck": 0.7})}, base)
    with pytest.raises(ManifestError, match=f"'fused_0' is in both {one}.*{two}.*fusion.name="):
        read_sources([str(one), str(two)])
    with pytest.raises(ManifestError, match="neither a fusion manifest"):
        read_sources(str(root))
    assert read_sources(str(root / "nothing")).missing == [str(root / "nothing")]
