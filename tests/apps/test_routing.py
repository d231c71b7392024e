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


def _counts(tmp_path, questions):
    """fused_0: count_cars, the cheaper adapter; fused_1: count_vehicles beside exists_bus."""
    order = [Domain("count_cars", "count", 0.7), Domain("count_vehicles", "count", 0.7),
             Domain("exists_bus", "binary", 0.7)]
    cars = FusedAdapter(0, "fused_0", ["count_cars"], {"count_cars": 0.8}, {"count_cars": 0.7}, True, None)
    both = FusedAdapter(1, "fused_1", ["count_vehicles", "exists_bus"], {"count_vehicles": 0.75, "exists_bus": 0.9},
                        {"count_vehicles": 0.7, "exists_bus": 0.7}, True, None)
    return read_manifest(write_manifest(FusionResult([cars, both], [], order), tmp_path, questions=questions))


def test_a_task_type_is_routed_to_the_domain_that_answers_the_question(tmp_path):
    """A head answers the question its domain was trained on: asking how many vehicles there are
    must not reach the cheaper count_cars head (it counted cars on a stream asking for vehicles)."""
    manifest = _counts(tmp_path, {"count_cars": "How many cars are there?",
                                  "count_vehicles": "How many vehicles are there?", "exists_bus": "Is there a bus?"})
    assert manifest["tasks"]["count_cars"]["question"] == "How many cars are there?"
    caps = ServerCaps(frozenset({"fused_0", "fused_1"}))
    vehicles = resolve_route("count", 0.5, manifest, caps, question="how many  vehicles are there")
    assert (vehicles.adapter, vehicles.head, vehicles.output_mode) == ("fused_1", "count_vehicles", "head")
    assert resolve_route("count", 0.5, manifest, caps, question="How many cars are there?").head == "count_cars"
    assert resolve_route("count", 0.5, manifest, caps).head == "count_cars", "no question: any domain of the type"
    buses = resolve_route("count", 0.5, manifest, caps, question="How many buses are there?")
    assert buses.adapter is None and buses.output_mode == "generate"
    assert "no domain of 'count' answers 'How many buses are there?'" in buses.reason
    assert "'How many cars are there?'" in buses.reason and buses.reason.endswith("base model")
    # a domain named explicitly is the caller's choice, whatever the question
    assert resolve_route("count_cars", 0.5, manifest, caps, question="How many buses are there?").head == "count_cars"


def test_a_manifest_without_questions_routes_by_task_type_as_before(tmp_path):
    manifest = _counts(tmp_path, None)
    assert "question" not in manifest["tasks"]["count_cars"]
    route = resolve_route("count", 0.5, manifest, ServerCaps(frozenset({"fused_0", "fused_1"})),
                          question="How many vehicles are there?")
    assert route.head == "count_cars", "a domain that records no question may answer any"


def test_a_route_carries_what_its_domain_was_trained_on(tmp_path):
    order = [Domain("count_cars", "count", 0.7), Domain("count_vehicles", "count", 0.7)]
    cars = FusedAdapter(0, "fused_0", ["count_cars"], {"count_cars": 0.8}, {"count_cars": 0.7}, True, None)
    clips = FusedAdapter(1, "fused_1", ["count_vehicles"], {"count_vehicles": 0.9}, {"count_vehicles": 0.7}, True, None)
    manifest = read_manifest(write_manifest(FusionResult([cars, clips], [], order), tmp_path,
                                            media={"count_cars": "image", "count_vehicles": "clip"}))
    caps = ServerCaps(frozenset({"fused_0", "fused_1"}))
    route = resolve_route("count_cars", 0.5, manifest, caps)
    assert (route.media, route.to_dict()["media"]) == ("image", "image")
    assert resolve_route("count_vehicles", 0.5, manifest, caps).media == "clip"
    generated = route.degrade("no head")
    assert (generated.adapter, generated.media) == ("fused_0", "image"), "the same adapter: the same frames"
    assert route.degrade("no head").degrade("gone").media is None, "the base model takes the whole chunk"
    assert resolve_route("count_cars", 0.5, manifest, ServerCaps(frozenset())).media is None, "not served: base"
