"""`vlora serve` and the apps' own server: the base model comes with the adapters (picked, or a
mismatch refused naming both, or forced), several sources are served together, and every user
error is answered before any model is built."""

from __future__ import annotations

import json

import socket
import subprocess
import sys

import pytest
from adapter_cases import make_adapter
from base_cases import fusion_run, other_base, train_adapter
from omegaconf import OmegaConf

from adapters import fingerprint
from vlora.commands import serve, video_analytics, visual_retrieval
from vlora.commands.fusion import FusionJob
from vlora.config import compose, to_dataclass

NAME = "qwen2_vl_tiny"
SMALL = ["engine.device=cpu", "+engine.num_kv_blocks=32", "engine.adapter_slots=4", "engine.policy=fcfs",
         "rpc.token=serve-test-token"]


@pytest.fixture(scope="module")
def runs(tiny_zoo, tmp_path_factory):
    """Adapters trained on a second tiny base (b), in a fusion run, and one on the zoo's (a)."""
    root = tmp_path_factory.mktemp("serve")
    a, b = tiny_zoo[NAME], other_base(root)
    on_b = train_adapter(b, root / "bus", {"exists_bus": ("binary", 0.9)}, seed=4)
    return {"a": a, "b": b, "root": root,
            "fused_b": fusion_run(root / "cams", {0: (on_b, {"exists_bus": 0.9})}, b),
            "truck_b": train_adapter(b, root / "truck", {"exists_truck": ("binary", 0.7)}, seed=6),
            "plates_a": train_adapter(a, root / "plates", {"plate": ("detect", 0.8)}, seed=3)}


def _names(engine) -> list[str]:
    return [x["name"] for x in engine.list_adapters()]


def test_by_default_the_server_loads_the_base_the_adapters_record_and_logs_it(runs, capsys):
    engine = serve.build_engine(compose("serve", SMALL + [f"adapters.manifest={runs['fused_b']}"]))
    assert engine.checkpoint.resolve() == runs["b"].resolve() and _names(engine) == ["cams_0"]
    err = capsys.readouterr().err
    assert f"base {runs['b'].name} ({runs['b'].resolve()}, fingerprint {fingerprint(runs['b'])[:19]}" in err
    assert "recorded by the adapters" in err


def test_another_model_path_is_refused_naming_both_bases_unless_forced(runs, capsys):
    cfg = compose("serve", SMALL + [f"adapters.manifest={runs['fused_b']}", f"model.path={runs['a']}"])
    with pytest.raises(SystemExit, match=f"'cams_0' was trained on base model {runs['b'].name} \\({runs['b']}.*"
                                         f"would load {NAME} \\({runs['a']}.*allow_base_mismatch=true"):
        serve.plan_serve(cfg)
    cfg.adapters.allow_base_mismatch = True
    engine = serve.build_engine(cfg)
    assert engine.checkpoint == runs["a"] and _names(engine) == ["cams_0"]
    assert "adapter cams_0 was trained on" in capsys.readouterr().err


def test_manifests_and_train_adapter_directories_are_served_together(runs, capsys):
    again = fusion_run(runs["root"] / "roads", {0: (runs["truck_b"], {"exists_truck": 0.7})}, runs["b"])
    elsewhere = make_adapter(runs["b"], runs["root"] / "peft_only", ["q_proj"], 4, 8, seed=2)  # no meta.json
    sources = f"adapters.manifest=[{runs['fused_b']},{again.parent},{runs['truck_b']}]"
    engine = serve.build_engine(compose("serve", SMALL + [sources, f"adapters.extra=[{elsewhere}]"]))
    assert _names(engine) == ["cams_0", "roads_0", "truck", "peft_only"]
    assert f"adapter peft_only ({elsewhere}) has no meta.json: its base model is unknown" in capsys.readouterr().err
    mixed = compose("serve", SMALL + [f"adapters.manifest=[{runs['fused_b']},{runs['plates_a']}]"])
    with pytest.raises(SystemExit, match="record different base models"):
        serve.plan_serve(mixed)


def test_an_app_routes_to_a_train_adapter_directory_served_by_its_own_server(runs, tmp_path, capsys):
    import io

    from world import WorldConfig, write_world

    write_world(WorldConfig(seed=2, width=96, height=96, min_objects=2), tmp_path / "world", 1, 0, progress=False)
    counter = train_adapter(runs["a"], tmp_path / "counter", {"count_vehicles": ("count", 0.6)}, seed=8)
    cfg = compose("visual_retrieval", SMALL + [f"manifest={counter}", f"collection={tmp_path}/world/images",
                                               "queries=null", "max_new_tokens=4", f"out_dir={tmp_path}/out"])
    out = io.StringIO()
    report = visual_retrieval.run(cfg, stdin=io.StringIO("image_00000.png How many cars are there?\n"), stdout=out)
    assert report["answered"] == 1 and "[count, counter" in out.getvalue()
    assert f"base {NAME} ({runs['a'].resolve()}" in capsys.readouterr().err  # the base counter records


@pytest.fixture
def empty_zoo(tmp_path):
    zoo = tmp_path / "zoo"
    zoo.mkdir()
    return zoo


def _refused(overrides: list[str], zoo) -> str:
    cfg = compose("serve", SMALL + [f"paths.zoo={zoo}", "adapters.manifest=null", *overrides])
    with pytest.raises(SystemExit) as e:
        serve.run(cfg)
    assert list(zoo.iterdir()) == [], "nothing may be built before the config is checked"
    return str(e.value)


def test_bad_values_are_answered_before_any_model_is_built(empty_zoo):
    assert "engine.policy='nope' is not a policy; choose one of ['dlora', 'dlora_atmm', 'fcfs'" in _refused(
        ["engine.policy=nope"], empty_zoo)
    assert "the token is 5 characters; the server needs a secret of 8+" in _refused(["rpc.token=short"], empty_zoo)
    assert "engine.device='gpu0'" in _refused(["engine.device=gpu0"], empty_zoo)
    assert "model.dtype='fp8'" in _refused(["model.dtype=fp8"], empty_zoo)
    assert "rpc.switch_interval_ms=-1: give milliseconds" in _refused(["rpc.switch_interval_ms=-1"], empty_zoo)
    assert "rpc.engine_switch_interval_ms=0: give milliseconds" in _refused(["rpc.engine_switch_interval_ms=0"], empty_zoo)
    assert "rpc.tenant_process_nice=25: give 0-19" in _refused(["rpc.tenant_process_nice=25"], empty_zoo)
    assert "rpc.engine_threads=0: give a whole number" in _refused(["rpc.engine_threads=0"], empty_zoo)
    assert "rpc.engine_threads='many': give a whole number" in _refused(["rpc.engine_threads=many"], empty_zoo)
    assert "rpc.tenant_process_nice='x': give an integer" in _refused(["rpc.tenant_process_nice=x"], empty_zoo)
    assert "rpc.max_images=2.5: give an integer" in _refused(["rpc.max_images=2.5"], empty_zoo)
    assert "rpc.gate_share='half': give a number" in _refused(["rpc.gate_share=half"], empty_zoo)
    assert "rpc.tenant_processes='many': give the most tenants" in _refused(["rpc.tenant_processes=many"], empty_zoo)
    assert "rpc.pace_tenant_processes='often': give true, false or auto" in _refused(
        ["rpc.pace_tenant_processes=often"], empty_zoo)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert _refused([f"rpc.port={port}"], empty_zoo) == \
            f"vlora serve: port {port} is in use; pass rpc.port=<free port> (or 0 for any free one)"
    app = compose("video_analytics", SMALL + [f"paths.zoo={empty_zoo}", "engine.policy=nope"])
    with pytest.raises(SystemExit, match="engine.policy='nope'"):
        video_analytics.run(app)
    assert list(empty_zoo.iterdir()) == []


def test_the_command_ends_a_user_error_with_one_line(empty_zoo):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "vlora.cli", "serve", f"rpc.port={port}", "rpc.token=long-enough",
                               f"paths.zoo={empty_zoo}"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1] == f"vlora serve: port {port} is in use; pass rpc.port=<free port> " \
                                                   "(or 0 for any free one)"


def test_one_override_adds_a_domain_to_fusion(vlora_home):
    cfg = compose("fusion", ["fusion.only={direction: 0.6}"])
    job = to_dataclass(FusionJob, OmegaConf.to_container(cfg.fusion, resolve=True))
    assert job.selected() == {"direction": 0.6}
    listed = to_dataclass(FusionJob, OmegaConf.to_container(compose("fusion", ["fusion.only=[qa]"]).fusion))
    assert listed.selected() == {"qa": cfg.fusion.domains.qa}  # a listed name keeps its configured requirement


def test_a_requirement_relative_to_the_teacher_reads_the_dataset_record(tmp_path):
    from vlora.commands.fusion import resolve_requirement

    (tmp_path / "count_cars").mkdir()
    (tmp_path / "count_cars" / "domain.json").write_text(
        json.dumps({"teacher_vs_truth": {"metric": "accuracy", "value": 0.862, "items": 1024}}))
    assert resolve_requirement("count_cars", {"of_teacher": 0.9}, str(tmp_path)) == pytest.approx(0.7758)
    assert resolve_requirement("count_cars", 0.5, str(tmp_path)) == 0.5
    (tmp_path / "user_data").mkdir()
    (tmp_path / "user_data" / "domain.json").write_text(json.dumps({"teacher_vs_truth": None}))
    with pytest.raises(ValueError, match="user_data.*records no teacher-vs-truth agreement"):
        resolve_requirement("user_data", {"of_teacher": 0.9}, str(tmp_path))
    with pytest.raises(ValueError, match="count_cars.*of_teacher"):
        resolve_requirement("count_cars", {"of_techer": 0.9}, str(tmp_path))


def test_fusion_refuses_a_relative_requirement_without_a_record_before_building_the_model(vlora_home, capsys):
    from vlora.commands.fusion import run_fusion

    cfg = compose("fusion", ["fusion.only={not_distilled: {of_teacher: 0.9}}"])
    with pytest.raises(SystemExit, match="not_distilled.*records no teacher-vs-truth agreement"):
        run_fusion(cfg)


@pytest.mark.parametrize("epochs, what", [("{qa: 0}", "qa"), ("{not_fused: 8}", "not_fused")])
def test_fusion_refuses_bad_epochs_per_domain_before_building_the_model(vlora_home, epochs, what):
    from vlora.commands.fusion import run_fusion

    cfg = compose("fusion", ["fusion.only={qa: 0.5}", f"fusion.epochs={epochs}"])
    with pytest.raises(SystemExit, match=f"fusion.epochs.*{what}.*int >= 1"):
        run_fusion(cfg)


def test_a_cpu_engine_leaves_a_core_to_the_front_end_unless_told(monkeypatch):
    from serve.rpc.tenant_processes import usable_cores

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cpu = compose("serve", SMALL)
    assert serve.engine_threads(cpu) == max(1, usable_cores() - 1)
    assert serve.engine_threads(compose("serve", SMALL + ["rpc.engine_threads=3"])) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the operator's word stands
    assert serve.engine_threads(cpu) is None
