"""Visual retrieval: query kinds and files, scores (exact, VQA, IoU, caption F1), batch mode
with known answers from a synthetic world against a real server, drawn boxes, the interactive
loop and the `vlora visual_retrieval` command."""

from __future__ import annotations

import io
import json

import cv2
import numpy as np
import pytest
from apps_server import MODEL, TOKEN, connector, serving

from apps.video_analytics import Prediction, parse_boxes, parse_yes_no
from apps.visual_retrieval import (DEFAULT_ROUTES, ImageCollection, Query, RetrievalApp, RetrievalConfig, classify, read_queries,
                                   score, token_f1, vqa_normalise, vqa_score, world_queries, write_queries)
from world import WorldConfig, referring_expressions, write_world


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("world")
    write_world(WorldConfig(seed=2, width=96, height=96, min_objects=2), root, 3, 0, progress=False)
    return root


@pytest.fixture(scope="module")
def server(tiny_zoo):
    with serving(tiny_zoo[MODEL]) as s:
        yield s


def test_query_kinds_and_the_query_file(tmp_path):
    assert [classify(q) for q in ("Describe the image.", "Where is the red car?", "How many buses are there?",
                                  "Is there a blue truck?", "What color is the bus?", "Which way is the car moving?",
                                  "Why is the sky blue?")] == \
        ["caption", "ground", "count", "exists", "color", "direction", "qa"]
    path = tmp_path / "q.jsonl"
    path.write_text('{"image": "a.png", "question": "How many cars are there?", "answer": 2}\n\n'
                    '{"image": "a.png", "question": "Where is the car?", "box": [1, 2, 3, 4], "id": "x"}\n')
    first, second = read_queries(path)
    assert (first.kind, first.answers, first.id) == ("count", ["2"], "1")
    assert (second.kind, second.box, second.id) == ("ground", [1, 2, 3, 4], "x")
    assert read_queries(write_queries([first, second], tmp_path / "again.jsonl")) == [first, second]
    path.write_text('{"image": "a.png", "question": "Hi?", "colour": "red"}\n')  # a key of the user's own
    (own,) = read_queries(path)
    assert own.meta == {"colour": "red"} and read_queries(write_queries([own], tmp_path / "own.jsonl")) == [own]
    with pytest.raises(ValueError, match="kind must be one of"):
        Query("a.png", "Hi?", kind="poem")


def test_scores_exact_vqa_iou_and_caption_f1():
    assert vqa_normalise("There are TWO cars.") == "there are 2 cars"
    assert vqa_score("Two", ["2"]) == 1.0 and vqa_score("3", ["2"]) == 0.0
    refs = ["2"] * 2 + ["3"] * 8  # ten annotators, two said "2": the official leave-one-out average
    assert vqa_score("2", refs) == pytest.approx((8 * 2 / 3 + 2 * 1 / 3) / 10)
    assert vqa_score("3", refs) == 1.0
    # articles go: 4 words against 7, all 4 shared -> precision 1, recall 4/7
    assert token_f1("a road with 2 cars", "A road with 2 cars and 1 bus.") == pytest.approx(8 / 11)
    count = Query("a.png", "How many cars are there?", answers=["2"])
    said = Prediction("count", text="There are 2 cars.", count=2, parsed=True)
    assert score(count, said) == {"exact": 0.0, "vqa": 1.0, "correct": True}
    assert score(count, Prediction("count", text="2", count=2, parsed=True))["exact"] == 1.0
    ground = Query("a.png", "Where is the red car?", box=[10, 10, 30, 30])
    assert score(ground, Prediction("detect", boxes=[(12, 10, 30, 30)]))["correct"] is True
    miss = score(ground, Prediction("detect", boxes=[(20, 20, 40, 40)]))
    assert miss["correct"] is False and miss["iou"] == pytest.approx(100 / 700, abs=1e-4)
    assert score(ground, Prediction("detect"))["iou"] == 0.0
    assert parse_boxes("the car at (10, 10, 30, 30)", 100, 100) == [(10, 10, 30, 30)]  # percent of 100 px
    assert parse_yes_no("Yes, there is.") == "yes"


def test_world_queries_carry_exact_answers(world):
    collection = ImageCollection(world / "images")
    assert collection.names == [f"image_{i:05d}.png" for i in range(3)] and collection.has_truth
    queries = world_queries(collection, per_image=4, seed=1)
    assert len(queries) == 12 and len({q.kind for q in queries}) >= 4
    for q in queries:
        item = collection.truth(q.image)
        if q.kind == "ground":
            expr = q.question[len("Where is "):-1]
            assert any(e == expr and list(b) == q.box for e, b in referring_expressions(item.truth))
        elif q.kind == "caption":
            assert q.answers == [item.caption]
        else:
            assert (q.question, q.answers[0]) in {(p.question, p.answer) for p in item.qa}


def test_batch_mode_scores_known_answers_and_draws_boxes(server, world, tmp_path):
    collection = ImageCollection(world / "images")
    queries = world_queries(collection, per_image=4, seed=0)
    queries += [Query(collection.names[0], "Where is nothing at all?", "ground", box=[0.0, 0.0, 20.0, 20.0],
                      id="extra"),
                Query("missing.png", "How many cars are there?", answers=["0"], id="bad")]
    with connector(server)() as client:
        app = RetrievalApp(client, collection, RetrievalConfig(max_new_tokens=12, concurrency=3), None, tmp_path)
        report = app.run_batch(queries)
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == [q.id for q in queries]
    assert "no image 'missing.png'" in rows[-1]["error"] and report["overall"]["errors"] == 1
    done = [r for r in rows if "error" not in r]
    assert all((r["route"]["adapter"], r["route"]["output_mode"]) == (None, "generate") for r in done)
    assert all(r["route"]["via"] == f"routes.{r['kind']}={DEFAULT_ROUTES[r['kind']]}" for r in done)  # and why
    scored = [r for r in done if "correct" in r["scores"]]
    assert len(scored) == len(done), "every world query has a known answer"
    assert report["overall"]["accuracy"] == pytest.approx(np.mean([r["scores"]["correct"] for r in scored]))
    for kind, summary in report["by_kind"].items():
        assert summary["queries"] == sum(r["kind"] == kind for r in rows)
        if any(r["kind"] == kind for r in done):
            assert summary["latency_ms"]["p50"] > 0
    grounded = [r for r in done if r["kind"] == "ground"]
    assert grounded and all(r["drawn"] for r in grounded)
    checked = 0
    for r in grounded:
        drawn = cv2.imread(r["drawn"])
        assert drawn.shape == collection.load(r["image"]).shape
        x1, y1, x2, y2 = (int(round(v)) for v in r["box"])
        rows = [y for y in range(y1, y2 - 1) if y >= 20]  # below the question / answer band
        if rows:
            assert (drawn[rows, x1] >= 250).all(), "the known box's left edge is drawn in white"
            checked += 1
    assert checked


def test_known_answers_that_match_score_one(server, world, tmp_path):
    """A query whose accepted answer is exactly what the model says is scored correct."""
    collection = ImageCollection(world / "images")
    with connector(server)() as client:
        app = RetrievalApp(client, collection, RetrievalConfig(max_new_tokens=6), None, tmp_path)
        said = app.ask(Query(collection.names[1], "Tell me about the scene.", id="0"))["text"]
        question = "Tell me about the scene."
        report = app.run_batch([Query(collection.names[1], question, answers=[said], id="a"),
                                Query(collection.names[1], question, answers=[said + " bus"], id="b")])
    assert report["by_kind"]["qa"]["accuracy"] == 0.5 and report["by_kind"]["qa"]["exact"] == 0.5


def test_interactive_mode_answers_lines_until_quit(server, world, tmp_path):
    collection = ImageCollection(world / "images")
    lines = io.StringIO(f":images\n{collection.names[0]} Where is the car?\nnope.png How many?\n"
                        f"{collection.names[0]}\n:quit\n{collection.names[1]} never asked\n")
    out = io.StringIO()
    with connector(server)() as client:
        app = RetrievalApp(client, collection, RetrievalConfig(max_new_tokens=4, draw="all"), None, tmp_path)
        assert app.interactive(lines, out) == 1
    text = out.getvalue()
    assert collection.names[2] in text and "[ground, base model," in text and "drawn:" in text
    assert "error: no image 'nope.png'" in text and "give an image name and a question" in text


def test_visual_retrieval_command_runs_world_queries(tiny_zoo, world, tmp_path, capsys):
    from vlora.commands import visual_retrieval
    from vlora.config import compose

    cfg = compose("visual_retrieval", [f"model.path={tiny_zoo[MODEL]}", "engine.device=cpu",
                                       "+engine.num_kv_blocks=512", f"collection={world}/images", "queries=world",
                                       "queries_per_image=2", "max_new_tokens=8", f"out_dir={tmp_path}",
                                       f"rpc.token={TOKEN}"])
    report = visual_retrieval.run(cfg)
    assert report["mode"] == "batch" and report["overall"]["queries"] == 6 and report["overall"]["errors"] == 0
    assert 0.0 <= report["overall"]["accuracy"] <= 1.0 and report["overall"]["latency_ms"]["p95"] > 0
    assert len(read_queries(tmp_path / "queries.jsonl")) == 6
    assert json.loads((tmp_path / "report.json").read_text())["overall"] == report["overall"]
    assert "all" in capsys.readouterr().out

    cfg.queries = None  # interactive, on the given input
    out = io.StringIO()
    report = visual_retrieval.run(cfg, stdin=io.StringIO("image_00000.png How many cars are there?\n"), stdout=out)
    assert report["answered"] == 1 and "[count, base model" in out.getvalue()


def test_caption_and_qa_queries_go_in_generate_mode(server, world, tmp_path):
    """Captions and free questions are answered in text (their lm domains carry no head), even when
    heads are forced for the other kinds; a count with no head to answer it under heads=always is
    an error that says why, not a generated answer (heads=always is never ignored)."""
    collection = ImageCollection(world / "images")
    names = collection.names
    queries = [Query(names[i % len(names)], "Describe the image.", id=f"c{i}") for i in range(3)]
    queries += [Query(names[i % len(names)], "Tell me about the scene.", id=f"q{i}") for i in range(2)]
    queries += [Query(names[i % len(names)], "How many cars are there?", id=f"n{i}") for i in range(4)]
    with connector(server)() as client:
        app = RetrievalApp(client, collection, RetrievalConfig(max_new_tokens=4, concurrency=4, heads="always"),
                           None, tmp_path)
        rows = app.run(queries)
    texts = [r for r in rows if r["kind"] in ("caption", "qa")]
    assert all("error" not in r for r in texts), [r.get("error") for r in texts]
    assert all(r["route"]["output_mode"] == "generate" for r in texts)
    assert "refused" not in app.routes["caption"].reason and "refused" not in app.routes["qa"].reason
    counts = [r for r in rows if r["kind"] == "count"]
    assert [r["error"] for r in counts] == ["heads=always: no task head serves this query (no fusion manifest: "
                                            "base model)"] * 4 and app.mode_switches == 0


def test_count_and_exists_queries_are_routed_by_their_question(server, world, tmp_path):
    """A head answers its own domain's question: "How many buses are there?" must not be answered
    by the head that counts cars. Routes are then kept per question for such kinds, and the
    questions no domain asks go to the base model, saying why."""
    from adapters.manifest import read_manifest, write_manifest
    from fusion import Domain, FusedAdapter, FusionResult

    order = [Domain("count_cars", "count", 0.5), Domain("exists_bus", "binary", 0.5)]
    fused = FusedAdapter(0, "fused_0", ["count_cars", "exists_bus"], {"count_cars": 0.8, "exists_bus": 0.9},
                         {"count_cars": 0.5, "exists_bus": 0.5}, True, None)
    manifest = read_manifest(write_manifest(FusionResult([fused], [], order), tmp_path, questions={
        "count_cars": "How many cars are there?", "exists_bus": "Is there a bus?"}))
    image = ImageCollection(world / "images").names[0]
    with connector(server)() as client:
        app = RetrievalApp(client, ImageCollection(world / "images"), RetrievalConfig(), manifest, tmp_path)
        cars = app.route(Query(image, "How many cars are there?"))
        buses = app.route(Query(image, "How many buses are there?"))
        bus, caption = app.route(Query(image, "Is there a bus?")), app.route(Query(image, "Describe the image."))
    assert (cars.selected, buses.selected, bus.selected) == ("fused_0", None, "fused_0")
    assert "count_cars" in cars.reason and "no domain of 'count' answers 'How many buses are there?'" in buses.reason
    assert sorted(app.routes) == ["caption", "count: How many buses are there?", "count: How many cars are there?",
                                  "exists: Is there a bus?"]
