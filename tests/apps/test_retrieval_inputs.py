"""Visual retrieval as a user's files meet it: a malformed line of a query file is skipped and
reported while the rest runs, a photo over the server's pixel limit is downscaled on the client
(its boxes mapped back to the photo), a truncated JPEG is an input error never sent, and Qwen2-VL's
native grounding boxes are read."""

from __future__ import annotations

import json

import cv2
import numpy as np
import pytest
from apps_server import MODEL, TOKEN, connector, serving

from apps.common.answers import parse_boxes
from apps.visual_retrieval import ImageCollection, Query, RetrievalApp, RetrievalConfig
from serve.rpc import ServerError

SERVER_LIMIT = 64 * 64  # pixels of one frame the test server takes


@pytest.fixture(scope="module")
def server(tiny_zoo):
    with serving(tiny_zoo[MODEL], max_frame_pixels=SERVER_LIMIT) as s:
        yield s


def _photo(width: int, height: int) -> np.ndarray:
    """A dark BGR photo with a green car-like block (nothing white, so drawn white boxes show)."""
    image = np.full((height, width, 3), 40, np.uint8)
    cv2.rectangle(image, (width // 4, height // 3), (width // 2, height * 2 // 3), (0, 160, 0), -1)
    return image


def test_a_malformed_query_line_is_skipped_and_reported(tiny_zoo, tmp_path, capsys):
    from vlora.commands import visual_retrieval
    from vlora.config import compose

    photos = tmp_path / "photos"
    photos.mkdir()
    cv2.imwrite(str(photos / "a.png"), _photo(48, 32))
    lines = ['{"image": "a.png", "question": "How many cars are there?", "answer": "1"}',
             '{"image": "a.png", "question": "Is there a car?", "answer": "yes"}',
             '{"image": "a.png", "question": "Where is the car?"',  # cut short: not JSON
             '{"image": "a.png", "question": "Where is the car?", "box": [1, 2, 3]}',  # a box of 3 values
             '{"image": "a.png", "question": "Describe the image."}']
    (tmp_path / "q.jsonl").write_text("\n".join(lines) + "\n")
    cfg = compose("visual_retrieval", [f"model.path={tiny_zoo[MODEL]}", "engine.device=cpu",
                                       "+engine.num_kv_blocks=512", f"collection={photos}",
                                       f"queries={tmp_path / 'q.jsonl'}", "max_new_tokens=4",
                                       f"out_dir={tmp_path / 'out'}", f"rpc.token={TOKEN}"])
    report = visual_retrieval.run(cfg)
    assert report["overall"]["queries"] == 3 and report["overall"]["errors"] == 0
    assert report["overall"]["skipped_lines"] == 2
    assert [s["line"] for s in report["skipped"]] == [3, 4]
    assert "not valid JSON" in report["skipped"][0]["error"] and "box must be" in report["skipped"][1]["error"]
    rows = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert [r.get("id") for r in rows[:3]] == ["1", "2", "5"] and all("text" in r for r in rows[:3])
    assert [(r["skipped_line"], "error" in r) for r in rows[3:]] == [(3, True), (4, True)]
    printed = capsys.readouterr().out
    assert "skipped query line 3: " in printed and "skipped query line 4: " in printed


def test_a_photo_over_the_limit_is_downscaled_and_its_boxes_mapped_back(server, tmp_path):
    photos = tmp_path / "photos"
    photos.mkdir()
    photo = _photo(200, 100)  # 20,000 pixels, about five times the server's limit
    cv2.imwrite(str(photos / "wide.png"), photo)
    known = [100.0, 40.0, 180.0, 90.0]
    with connector(server)() as client:
        with pytest.raises(ServerError, match=f"exceeds {SERVER_LIMIT} pixels"):
            client.submit_image("Where is the car?", [photo[:, :, ::-1].copy()]).result(30)  # the server's limit holds
        config = RetrievalConfig(max_new_tokens=4, max_frame_pixels=SERVER_LIMIT, box_scale="pixel")
        app = RetrievalApp(client, ImageCollection(photos), config, None, tmp_path)
        result = app.ask(Query("wide.png", "Where is the car?", box=known, id="w"))
    assert "error" not in result, result.get("error")
    sent_w, sent_h = result["sent_size"]
    assert sent_w * sent_h <= SERVER_LIMIT and (sent_w, sent_h) == (90, 45)  # the 2:1 aspect kept
    drawn = cv2.imread(result["drawn"])
    assert drawn.shape == photo.shape, "drawn on the photo itself, not the frame sent"
    assert (drawn[45:85, 100] >= 250).all(), "the known box is drawn at the photo's pixels"
    # a box the model answers in pixels of the frame sent comes back in the photo's (x 200/90, 100/45)
    pred = app.prediction(Query("wide.png", "Where is the car?"), {"text": "the car (45, 10, 90, 40)"},
                          (200, 100), (sent_w, sent_h))
    assert pred.boxes == [pytest.approx((100.0, 22.222, 200.0, 88.889), abs=1e-3)]


def test_a_truncated_jpeg_is_an_input_error_not_sent(server, tmp_path):
    photos = tmp_path / "photos"
    photos.mkdir()
    ok, jpeg = cv2.imencode(".jpg", _photo(60, 40) + np.random.default_rng(0).integers(0, 60, (40, 60, 3), np.uint8))
    assert ok
    (photos / "whole.jpg").write_bytes(jpeg.tobytes())
    (photos / "cut.jpg").write_bytes(jpeg.tobytes()[: len(jpeg) * 2 // 3])  # a copy that stopped part-way
    assert cv2.imread(str(photos / "cut.jpg")) is not None, "OpenCV alone decodes the cut file (half grey)"
    queries = [Query("cut.jpg", "How many cars are there?", id="cut"),
               Query("whole.jpg", "How many cars are there?", id="whole")]
    with connector(server)() as client:
        admitted = client.metrics()["server"].get("engine_admitted", 0)
        app = RetrievalApp(client, ImageCollection(photos), RetrievalConfig(max_new_tokens=4), None, tmp_path)
        report = app.run_batch(queries)
        after = client.metrics()["server"].get("engine_admitted", 0)
    rows = [json.loads(line) for line in (tmp_path / "results.jsonl").read_text().splitlines()]
    assert rows[0]["input_error"] is True and "'cut.jpg' is truncated or corrupt" in rows[0]["error"]
    assert "error" not in rows[1] and "text" in rows[1]
    assert report["overall"]["input_errors"] == 1 and report["overall"]["errors"] == 1
    assert after - admitted == 1, "only the whole photo reached the server"


def test_qwen2_vl_native_boxes_parse_to_pixels():
    from apps.visual_retrieval import qwen_resized_size

    answer = ("<|object_ref_start|>the red car<|object_ref_end|><|box_start|>(100,250),(500,750)<|box_end|> "
              "and <|object_ref_start|>a bus<|object_ref_end|><|box_start|>(0,0),(1000,1000)<|box_end|>")
    assert parse_boxes(answer, 640, 480) == [(64.0, 120.0, 320.0, 360.0), (0.0, 0.0, 640.0, 480.0)]
    # decoded with special tokens skipped, only the label and the two points are left
    assert parse_boxes("the red car(100,250),(500,750)", 640, 480) == [(64.0, 120.0, 320.0, 360.0)]
    # Qwen2.5-VL: absolute pixels of its resized input (644 x 476 for a 640 x 480 image)
    resized = qwen_resized_size(640, 480)
    assert resized == (644, 476)
    assert parse_boxes("<|box_start|>(161,119),(322,238)<|box_end|>", 640, 480, native_size=resized) == \
        [pytest.approx((160.0, 120.0, 320.0, 240.0))]
    # and its JSON form, in the same pixels; without an input size it is read as before
    json_answer = '[{"bbox_2d": [161, 119, 322, 238], "label": "car"}]'
    assert parse_boxes(json_answer, 640, 480, native_size=resized) == [pytest.approx((160.0, 120.0, 320.0, 240.0))]
    assert parse_boxes(json_answer, 640, 480) == [(161.0, 119.0, 322.0, 238.0)]
    # the formats read before: a 4-tuple in percent, unit or pixels, alongside a native box in text order
    assert parse_boxes("car (10, 10, 30, 30) then <|box_start|>(500,500),(1000,1000)<|box_end|>", 100, 100) == \
        [(10.0, 10.0, 30.0, 30.0), (50.0, 50.0, 100.0, 100.0)]
    assert parse_boxes("(0.1, 0.2, 0.5, 0.6)", 200, 100) == [pytest.approx((20.0, 20.0, 100.0, 60.0))]


def test_qwen_resized_size_is_the_processors_smart_resize():
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    from apps.visual_retrieval import fit_image, qwen_resized_size

    for width, height in [(640, 480), (90, 45), (3840, 2160), (20, 300), (7000, 5000)]:
        h, w = smart_resize(height, width, 28, 56 * 56, 12845056)
        assert qwen_resized_size(width, height) == (w, h)
    assert fit_image(np.zeros((2160, 3840, 3), np.uint8), 3840 * 2160).shape == (2160, 3840, 3)  # at the limit: kept
    h, w = fit_image(np.zeros((2160, 3841, 3), np.uint8), 3840 * 2160).shape[:2]
    assert h * w <= 3840 * 2160 and abs(w / h - 3841 / 2160) < 1e-3
