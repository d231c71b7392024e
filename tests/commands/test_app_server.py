"""The apps find the server a user started: `vlora serve` (a real subprocess on loopback, with HOME
pointed at an empty folder) writes its address file into VLORA_HOME, the apps connect to it by
default and say so, a missing or wrong token ends them with one line naming VLORA_TOKEN (and the
server logs the refusal), a stale file is ignored with a note, each app run writes a folder of its
own, and nothing any of them writes lands outside VLORA_HOME."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from rpc_server import TOKEN, ServerProcess
from yolo_cache import files, user_env, write_cached_yolo_world

from vlora.commands import app_runs, video_analytics, visual_retrieval
from vlora.commands.address import address_path, find_server, write_address
from vlora.commands.app_server import choose_server
from vlora.config import compose

MODEL = "qwen2_vl_tiny"
STREAM = ("[{name: cam, source: 'synthetic:0', world: {width: 64, height: 64, fps: 10, clip_frames: 10}, width: 56, "
          "height: 56, chunk_frames: 2, max_chunks: 2, tasks: [{task: count, latency_ms: 60000}], "
          "shadow: {teacher: yolo_world, share: 1.0}}]")


@pytest.fixture(scope="module")
def served(tiny_zoo, tmp_path_factory):
    root = tmp_path_factory.mktemp("front_door")
    user, home, work = root / "user", root / "home", root / "work"
    for folder in (user, work):
        folder.mkdir()
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(user_env(user, home))  # the server runs as that user (HOME included)
    try:
        server = ServerProcess(tiny_zoo[MODEL], home)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    yield SimpleNamespace(server=server, user=user, home=home, work=work)
    server.stop()


def test_serve_writes_its_address_file_once_it_listens(served):
    record = json.loads(address_path(served.home).read_text())
    assert record["host"] == "127.0.0.1" and record["port"] == served.server.port
    assert record["pid"] == served.server.proc.pid and record["started"].endswith("Z")
    assert "token" not in record and TOKEN not in address_path(served.home).read_text()


def test_an_app_uses_the_server_vlora_serve_started_and_writes_nothing_outside_vlora_home(served, tmp_path):
    write_cached_yolo_world(served.home / "teachers", tmp_path)
    env = user_env(served.user, served.home, VLORA_TOKEN=TOKEN)
    done = subprocess.run([sys.executable, "-m", "vlora", "video_analytics", f"streams={STREAM}", "duration_s=null",
                           "report_every_s=60"], cwd=served.work, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    pid, port = served.server.proc.pid, served.server.port
    assert f"video_analytics: using the server at 127.0.0.1:{port} started by vlora serve (pid {pid})" in done.stderr
    assert "own server" not in done.stderr
    results = served.home / "results" / "video_analytics"
    report = json.loads((results / "latest" / "report.json").read_text())
    assert report["server"] == {"host": "127.0.0.1", "port": port, "own": False, "pid": pid}
    assert report["streams"]["cam"]["chunks_processed"] == 2
    assert report["streams"]["cam"]["tasks"]["count"]["shadow"]["compared"] == 2  # the cached YOLO answered
    # the server and the app, ultralytics and matplotlib included, wrote only under VLORA_HOME
    assert files(served.user) == [] and files(served.work) == []
    assert (served.home / "ultralytics").is_dir() or (served.home / "teachers" / "ultralytics").is_dir()


def test_a_wrong_token_is_one_line_naming_vlora_token_and_the_server_logs_the_refusal(served):
    env = user_env(served.user, served.home, VLORA_TOKEN="not-the-servers-token")
    done = subprocess.run([sys.executable, "-m", "vlora", "visual_retrieval", f"collection={served.work}",
                           "queries=null"], cwd=served.work, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "Traceback" not in done.stderr and "AuthError" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"visual_retrieval: the server at 127.0.0.1:{served.server.port} refused the token: set VLORA_TOKEN to the "
        "token `vlora serve` was started with")
    assert any("refused a connection from 127.0.0.1: wrong token" in line for line in served.server.lines)
    assert not any("not-the-servers-token" in line for line in served.server.lines)


def test_a_missing_token_is_one_line_naming_vlora_token(served, monkeypatch):
    monkeypatch.delenv("VLORA_TOKEN", raising=False)
    cfg = compose("video_analytics", [f"paths.home={served.home}"])
    with pytest.raises(SystemExit, match=f"^video_analytics: the server at 127.0.0.1:{served.server.port} needs its "
                                         "token: set VLORA_TOKEN to the token `vlora serve` was started with; "
                                         "or pass server=own for a server of the app's own$"):
        video_analytics.run(cfg)


def test_each_app_run_writes_a_folder_of_its_own_and_latest_names_the_newest(served, tmp_path, monkeypatch):
    from world import WorldConfig, write_world

    monkeypatch.setenv("VLORA_TOKEN", TOKEN)
    write_world(WorldConfig(seed=2, width=96, height=96, min_objects=2), tmp_path / "world", 2, 0, progress=False)
    over = [f"paths.home={served.home}", f"collection={tmp_path}/world/images", "queries_per_image=1",
            "max_new_tokens=2", "draw=none"]
    first = visual_retrieval.run(compose("visual_retrieval", over + ["run_name=first"]))
    second = visual_retrieval.run(compose("visual_retrieval", over))  # named by its start time
    results = served.home / "results" / "visual_retrieval"
    assert not first["server"]["own"] and second["server"]["port"] == served.server.port
    assert app_runs.latest_run(results) == Path(second["results"]).parent.resolve()
    assert json.loads((results / "first" / "report.json").read_text())["results"] == first["results"]
    assert Path(second["results"]).parent.name != "first" and (results / "latest" / "report.json").is_file()
    with pytest.raises(SystemExit, match=f"run_name=first: {results}/first exists"):
        visual_retrieval.run(compose("visual_retrieval", over + ["run_name=first"]))


def test_a_pointer_file_stands_for_latest_where_symlinks_fail(tmp_path, monkeypatch):
    run = tmp_path / "20261127-203107"
    run.mkdir()
    (run / "report.json").write_text("{}")
    monkeypatch.setattr(Path, "symlink_to", lambda *a, **k: (_ for _ in ()).throw(OSError("not supported")))
    assert app_runs.finish_run(tmp_path, run) == tmp_path / "LATEST"
    assert app_runs.latest_run(tmp_path) == run


def test_server_own_and_an_explicit_port_win_over_the_address_file(served, capsys):
    home = f"paths.home={served.home}"
    assert choose_server(compose("video_analytics", [home]), "video_analytics").port == served.server.port
    own = choose_server(compose("video_analytics", [home, "server=own"]), "video_analytics")
    assert own.own and own.how == "starting an own server (server=own)"
    given = choose_server(compose("visual_retrieval", [home, "server.port=9", "server.host=10.0.0.2"]),
                          "visual_retrieval")
    assert (given.host, given.port, given.own) == ("10.0.0.2", 9, False)
    with pytest.raises(SystemExit, match="server.host=10.0.0.2 needs server.port=<port> too"):
        choose_server(compose("visual_retrieval", [home, "server.host=10.0.0.2"]), "visual_retrieval")


def test_a_stale_address_file_is_ignored_with_a_note(tmp_path, capsys):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    path = write_address(tmp_path, "127.0.0.1", 18861)
    path.write_text(json.dumps({**json.loads(path.read_text()), "pid": int(gone.stdout)}))
    target = choose_server(compose("video_analytics", [f"paths.home={tmp_path}"]), "video_analytics")
    assert target.own and target.how == f"starting an own server (no `vlora serve` running for {tmp_path})"
    assert f"video_analytics: ignoring the stale server address file {path}: its server (pid {int(gone.stdout)}) " \
           "is gone" in capsys.readouterr().err
    import socket

    with socket.socket() as closed:  # a live pid (this one) on a port where nothing listens
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    write_address(tmp_path, "0.0.0.0", port)
    assert find_server(tmp_path, who="x") is None
    assert f"x: ignoring the stale server address file {path}: nothing answers at 127.0.0.1:{port}" in \
           capsys.readouterr().err


def test_a_clean_shutdown_removes_the_address_file(served):
    assert address_path(served.home).is_file()
    served.server.stop()
    assert served.server.proc.returncode == 0 and not address_path(served.home).exists()


def test_serve_goes_on_when_its_home_cannot_hold_the_address_file(tmp_path, capsys):
    from vlora.commands.serve import _announce

    home = tmp_path / "not_a_folder"
    home.write_text("")
    cfg = compose("serve", [f"paths.home={home}"])
    assert _announce(cfg, SimpleNamespace(host="127.0.0.1", port=18999)) is None
    err = capsys.readouterr().err
    assert f"vlora serve: cannot write the address file in {home}" in err and "server.port=18999" in err
