"""Routes tell what an expected accuracy is worth, and queries find the domain that asked them,
without a server: the baseline a route shows is the one the adapter's meta.json records (majority
and zero-shot; "not recorded" without), flagged where the adapter is no better; the demo's online
rows put it beside the expected accuracy; a question a domain asked routes to it whatever its
wording suggests; a query line's own keys are its metadata; the video app's classify and exists
tasks read their truth, question and labels."""

from __future__ import annotations

import json

from adapters.manifest import read_manifest, write_manifest
from apps.common.routing import ServerCaps, resolve_route, route_cell, route_worth
from apps.video_analytics.tasks import TaskSpec, task_from_dict
from apps.visual_retrieval.plan import plan_query
from apps.visual_retrieval.queries import Query, read_queries, write_queries
from fusion import Domain, FusedAdapter, FusionResult
from vlora.commands.demo_report import retrieval_rows, stream_rows

MAJORITY = {"answer": 2, "accuracy": 0.4375, "n": 16, "wins": 1, "losses": 1, "p_value": 0.75, "alpha": 0.05,
            "better": False}
ROUTES = {kind: kind for kind in ("ground", "count", "exists", "color", "direction", "classify", "caption", "qa")}


def _manifest(tmp_path, baselines: bool = True):
    """fused_0: count_vehicles (accuracy 0.4375, its meta.json records the majority baseline when
    `baselines`) and digits, a classify domain asked "Which digit is this?"."""
    order = [Domain("count_vehicles", "count", 0.0), Domain("digits", "classify", 0.0)]
    fused = FusedAdapter(0, "fused_0", ["count_vehicles", "digits"], {"count_vehicles": 0.4375, "digits": 0.9},
                         {"count_vehicles": 0.0, "digits": 0.0}, True, None)
    path = write_manifest(FusionResult([fused], [], order), tmp_path,
                          questions={"count_vehicles": "How many vehicles are there?", "digits": "Which digit is this?"})
    domains = {"count_vehicles": {"task": "count", "accuracy": 0.4375}, "digits": {"task": "classify", "accuracy": 0.9,
                                                                                   "labels": ["0", "1", "7"]}}
    if baselines:
        domains["count_vehicles"].update(baseline=MAJORITY, baselines={"zero_shot": {"accuracy": 0.125, "better": True},
                                                                       "teacher_vs_truth": 1.0})
        domains["digits"]["baseline"] = {**MAJORITY, "answer": "7", "accuracy": 0.375, "p_value": 0.001, "better": True}
    (tmp_path / "fused_0").mkdir()
    (tmp_path / "fused_0" / "meta.json").write_text(json.dumps({"name": "fused_0", "domains": domains}))
    return read_manifest(path)


def test_a_route_shows_the_recorded_baseline_beside_its_expected_accuracy(tmp_path):
    caps = ServerCaps(frozenset({"fused_0"}))
    route = resolve_route("count", 0.0, _manifest(tmp_path), caps, question="How many vehicles are there?")
    assert route.adapter == "fused_0" and route.no_better and route.baselines["majority"] == MAJORITY
    assert set(route.baselines) == {"majority", "zero_shot"}  # teacher_vs_truth is the labels' quality, no baseline
    assert route.reason == ("manifest: fused_0 (count_vehicles, accuracy 0.4375); majority baseline always 2 0.438: "
                            "adapter NO BETTER (p=0.75), zero_shot baseline 0.125")
    shown = route.to_dict()
    assert route_worth(shown) == ("expected 0.438; majority baseline always 2 0.438: adapter NO BETTER (p=0.75), "
                                  "zero_shot baseline 0.125")
    digits = resolve_route("digits", 0.0, _manifest(tmp_path / "again"), caps)
    assert not digits.no_better and digits.labels == ("0", "1", "7") and digits.question == "Which digit is this?"
    bare = resolve_route("count", 0.0, _manifest(tmp_path / "bare", baselines=False), caps)
    assert bare.reason.endswith("; baseline: not recorded") and not bare.no_better
    assert route_worth(bare.to_dict()) == "expected 0.438; baseline: not recorded"
    base = resolve_route("count", 0.0, None, caps)
    assert route_worth(base.to_dict()) == "" and base.to_dict()["baseline"] is None


def test_the_demos_online_rows_put_the_baseline_beside_the_expected_accuracy(tmp_path):
    manifest, caps = _manifest(tmp_path), ServerCaps(frozenset({"fused_0"}))
    routes = {"count": resolve_route("count", 0.0, manifest, caps, question="How many vehicles are there?").to_dict(),
              "direction": resolve_route("direction", 0.0, manifest, caps).to_dict()}
    task = {"accuracy": 0.5, "requests": 4, "unparsed": 0, "errors": 0, "slo_violations": 0,
            "latency_ms": {"p50": 1.0, "p95": 2.0, "p99": 3.0}}
    va = {"streams": {"cam0": {"routes": routes, "tasks": {"count": task, "direction": task}, "chunks_processed": 4,
                               "chunks_dropped": 0}}}
    count, direction = stream_rows(va, {})
    assert (count["expected"], count["baseline"]) == (0.438, "always 2 0.438 NO BETTER")
    assert (direction["expected"], direction["baseline"]) == (None, None)  # the base model: nothing expected
    digits = resolve_route("classify", 0.0, manifest, caps, question="Which digit is this?")
    vr = {"by_kind": {"classify": {"accuracy": 0.9, "queries": 2, "errors": 0, "latency_ms": {}}},
          "routes": {"classify: Which digit is this?": {**digits.to_dict(), "via": "question matches domain digits"}}}
    (row,) = retrieval_rows(vr)
    assert row["route"] == "fused_0/head (question matches domain digits)" and row["baseline"] == "always '7' 0.375"
    assert row["expected"] == "0.900"


def test_a_question_a_domain_asked_routes_to_that_domain(tmp_path):
    manifest = _manifest(tmp_path)
    digit = plan_query(Query("a.png", "which digit is this"), ROUTES, manifest)  # reads as qa
    assert (digit.kind, digit.key, digit.generated, digit.via) == ("classify", "classify", False,
                                                                  "question matches domain digits")
    assert plan_query(Query("a.png", "Which digit is this?", kind="color"), ROUTES, manifest).kind == "color"
    caption = plan_query(Query("a.png", "Which digit is this?", kind="caption"), ROUTES, manifest)
    assert (caption.kind, caption.generated, caption.via) == ("caption", True, "routes.caption=caption")
    other = plan_query(Query("a.png", "Why is the sky blue?"), ROUTES, manifest)
    assert (other.name, other.generated) == ("qa", True)
    assert plan_query(Query("a.png", "Which digit is this?"), ROUTES, None).kind == "qa"  # no manifest: by wording
    routed = plan_query(Query("a.png", "What is this?"), {**ROUTES, "qa": "digits"}, manifest)  # routes.qa=digits
    assert (routed.name, routed.kind, routed.key, routed.generated) == ("classify: routes.qa=digits", "classify",
                                                                        "digits", False)
    from apps.visual_retrieval import RetrievalApp, RetrievalConfig

    app = RetrievalApp(None, None, RetrievalConfig(routes={"qa": "digits"}), manifest)
    asked = app.prepared(Query("a.png", "What is this?"))  # answered and scored as the domain's kind ...
    assert asked.kind == "classify" and app.plan(asked).key == "digits"  # ... on the route that chose it


def test_a_query_lines_own_keys_are_its_metadata(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text('{"image": "a.png", "question": "Which digit is this?", "answers": "7", "item": 3, '
                    '"split": "eval"}\n')
    skipped: list = []
    (query,) = read_queries(path, skipped)
    assert not skipped and query.meta == {"item": 3, "split": "eval"} and query.answers == ["7"]
    assert query.guessed and "kind" not in query.to_dict()  # a guessed kind is not written back as given
    assert read_queries(write_queries([query], tmp_path / "again.jsonl")) == [query]


def test_the_classify_and_exists_tasks_ask_their_domains_and_read_their_answers(tmp_path):
    from world import WorldConfig, render_clip

    manifest, caps = _manifest(tmp_path), ServerCaps(frozenset({"fused_0"}))
    spec = task_from_dict({"task": "classification", "manifest_key": "digits"})
    route = resolve_route(spec.key, 0.0, manifest, caps, question=spec.question())
    assert spec.task == "classify" and route.head == "digits" and spec.asked(route) == "Which digit is this?"
    assert spec.predict({"text": "It is a 7."}, 56, 56, route.labels).label == "7"
    assert spec.predict({"head": {"label": "1"}}, 56, 56).label == "1"
    assert TaskSpec("classify", prompt="What is it?").asked(route) == "What is it?"  # a prompt is asked as written
    world = TaskSpec("classify")  # the world: the class of the largest object, as class_main asks
    assert world.question() == "What kind of object is the largest one?"
    from apps.video_analytics.sources import FrameTruth

    frames, clip = render_clip(WorldConfig(seed=0, width=64, height=64, clip_frames=4, min_objects=2), 0)
    objects = clip.frames[2].objects
    largest = max(objects, key=lambda o: ((o.box[2] - o.box[0]) * (o.box[3] - o.box[1]), -o.track_id))
    assert world.truth(FrameTruth(clip, 2), 64, 64) == largest.cls
    assert world.score(world.predict({"head": {"label": largest.cls}}, 64, 64), largest.cls)["correct"]
    exists = task_from_dict({"task": "binary", "classes": [largest.cls]})  # a binary domain's task: yes / no
    assert exists.task == "exists" and exists.key == "binary" and exists.question().startswith("Is there a")
    assert exists.truth(FrameTruth(clip, 2), 64, 64) == "yes"
    assert exists.score(exists.predict({"head": {"answer": "yes"}}, 64, 64), "yes")["correct"]
    assert exists.predict({"text": "No, there is none."}, 64, 64).label == "no"
