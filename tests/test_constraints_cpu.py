"""constraints-cpu.txt, the CPU-only install: torch and torchvision pinned as one pair of CPU builds
from the index it names. A torchvision of another torch release, or a CUDA torchvision beside a
CPU torch, fails at import ("operator torchvision::nms does not exist")."""

from __future__ import annotations

import re
from pathlib import Path

FILE = Path(__file__).resolve().parents[1] / "constraints-cpu.txt"
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def pins() -> dict[str, str]:
    lines = [line.split("#")[0].strip() for line in FILE.read_text().splitlines()]
    return dict(re.fullmatch(r"([a-z]+)==(\S+)", line).groups() for line in lines if line and not line.startswith("-"))


def test_torch_and_torchvision_are_one_pair_of_cpu_builds():
    p = pins()
    assert set(p) == {"torch", "torchvision"}, "only the CUDA-built packages are pinned; the rest resolve as usual"
    torch_v, vision_v = p["torch"], p["torchvision"]
    assert torch_v.endswith("+cpu") and vision_v.endswith("+cpu"), "both from the CPU index, never PyPI's CUDA build"
    t_major, t_minor = map(int, torch_v.split("+")[0].split(".")[:2])
    v_major, v_minor = map(int, vision_v.split("+")[0].split(".")[:2])
    # torchvision 0.(minor + 15) is built against torch 2.minor (0.28 <-> 2.13, 0.29 <-> 2.14)
    assert (t_major, v_major, v_minor) == (2, 0, t_minor + 15), f"torch {torch_v} with torchvision {vision_v}"


def test_the_cpu_index_is_named_in_the_file_itself():
    # pip applies index options found in a constraints file, so one `-c` flag is the whole change
    assert f"--extra-index-url {CPU_INDEX}" in FILE.read_text().splitlines()


def test_the_pins_lie_inside_the_project_ranges():
    import tomllib

    deps = tomllib.loads((FILE.parent / "pyproject.toml").read_text())["project"]["dependencies"]
    floors = {m[1]: m[2] for d in deps if (m := re.fullmatch(r"(torch|torchvision)>=([\d.]+)", d))}
    for name, version in pins().items():
        have = tuple(map(int, version.split("+")[0].split(".")))
        assert have >= tuple(map(int, floors[name].split("."))), f"{name} {version} below pyproject's >={floors[name]}"
