"""Every primary config composes and resolves; the CLI dispatches to its Hydra apps."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from vlora.config import CONF_DIR, PRIMARY_CONFIGS, compose, to_dataclass
from zoo import SPECS


@pytest.mark.parametrize("name", PRIMARY_CONFIGS)
def test_primary_config_composes_and_resolves(name, vlora_home):
    cfg = compose(name)
    resolved = OmegaConf.to_container(cfg, resolve=True)
    assert resolved["paths"]["home"] == str(vlora_home)
    assert resolved["seed"] == 0


def test_every_primary_config_file_is_listed():
    on_disk = {p.stem for p in CONF_DIR.glob("*.yaml")} - {"common"}
    assert on_disk == set(PRIMARY_CONFIGS)


@pytest.mark.parametrize("group_file", sorted((CONF_DIR / "model").glob("*.yaml")), ids=lambda p: p.stem)
def test_model_group_matches_zoo_specs(group_file, vlora_home):
    cfg = compose("train", [f"model={group_file.stem}"])
    assert cfg.model.name in SPECS, "every model option names a zoo spec"
    assert cfg.model.arch == SPECS[cfg.model.name].arch
    assert cfg.model.path == f"{vlora_home}/zoo/{group_file.stem}"


def test_overrides_reach_the_config(vlora_home):
    cfg = compose("train", ["adapter=lora_r64_all", "head=detect", "train.lr=0.01", "model.path=/ckpt"])
    assert cfg.adapter.rank == 64 and "down_proj" in cfg.adapter.target_modules
    assert cfg.head.type == "detect" and cfg.train.lr == 0.01 and cfg.model.path == "/ckpt"


def test_unknown_config_and_unknown_field_are_named():
    with pytest.raises(ValueError, match="unknown config 'nope'"):
        compose("nope")

    @dataclasses.dataclass
    class Job:
        a: int

    with pytest.raises(ValueError, match=r"no field\(s\) \['b'\]"):
        to_dataclass(Job, {"a": 1, "b": 2})


def test_cli_help_and_unknown_command():
    ok = subprocess.run([sys.executable, "-m", "vlora.cli", "--help"], capture_output=True, text=True)
    assert ok.returncode == 0 and "zoo" in ok.stdout and "demo" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "vlora.cli", "nope"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown command 'nope'" in bad.stderr


def test_cli_runs_a_hydra_app(tmp_path):
    """The real entry point: overrides on the command line, artifacts under paths.home."""
    out = subprocess.run(
        [sys.executable, "-m", "vlora.cli", "zoo", "zoo.models=[qwen2_5_vl_tiny]", f"paths.home={tmp_path}"],
        capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "zoo" / "qwen2_5_vl_tiny" / "model.safetensors").is_file()
    assert "[zoo 1/1] qwen2_5_vl_tiny: built" in out.stderr
    assert list((tmp_path / "runs" / "zoo").iterdir()), "Hydra writes its run directory under paths.home"


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the CPU-only refusal")
@pytest.mark.parametrize("command", ["tune", "bench"])
def test_gpu_commands_refuse_clearly_without_a_gpu(command, tmp_path):
    out = subprocess.run([sys.executable, "-m", "vlora.cli", command, f"paths.home={tmp_path}"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "CUDA" in out.stderr + out.stdout
