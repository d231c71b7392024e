"""`vlora offline` and `vlora teachers` alone are quiet like `vlora demo`: what their steps write goes
to a log under their output folder, the console gets one line per step and the result
(`verbose=true`: everything too). With stderr not a terminal, the long loops' progress is whole
lines, at most one every few seconds, never a line rewritten by carriage returns."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from world.progress import ProgressLine

ROOT = Path(__file__).resolve().parents[2]


def _run(command: str, overrides: list[str], capfd) -> str:
    """The console of one run of the command's entry point: fds 1 and 2 go to pytest's files (not a
    terminal), stdout and stderr together."""
    import importlib

    from vlora.config import compose

    capfd.readouterr()
    importlib.import_module(f"vlora.commands.{command}").run(compose(command, overrides))
    out = capfd.readouterr()
    return out.out + out.err


def test_a_progress_line_is_rewritten_on_a_terminal_and_whole_lines_elsewhere():
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    log = io.StringIO()
    bar = ProgressLine(log, every_s=3600)
    for i in range(1, 1001):
        bar.update(f"step {i}/1000")
    bar.end()
    assert log.getvalue() == "step 1/1000\nstep 1000/1000\n", "the first and the last state, one line each"
    tty = Terminal()
    bar = ProgressLine(tty)
    for i in range(1, 4):
        bar.update(f"step {i}/3")
    bar.end()
    assert tty.getvalue() == "\rstep 1/3\rstep 2/3\rstep 3/3\n"
    log = io.StringIO()
    bar = ProgressLine(log, every_s=0)
    for i in range(1, 4):
        bar.update(f"step {i}/3")
    bar.end()
    assert log.getvalue() == "step 1/3\nstep 2/3\nstep 3/3\n", "every_s=0: every update"


def test_vlora_teachers_alone_logs_the_training_and_says_one_line_per_teacher(tmp_path, capfd):
    args = [f"paths.home={tmp_path}", "build=[sklearn_color,torch_class]",
            "teachers.sklearn_color.images=24", "teachers.sklearn_color.val_images=8",
            "teachers.torch_class.images=16", "teachers.torch_class.val_images=8", "teachers.torch_class.epochs=1"]
    console = _run("teachers", args, capfd)
    log = (tmp_path / "teachers" / "teachers.log").read_text()
    assert "\r" not in console and "\r" not in log
    lines = console.splitlines()
    assert [line.split(":")[0] for line in lines if line.startswith("[teachers ")] == [
        "[teachers 1/2] sklearn_color (sklearn)", "[teachers 2/2] torch_class (torch)"]
    assert "rendered 32/32" in log and "rendered 24/24" in log and "epoch 1/1" in log and "held-out accuracy" in log
    assert "rendered" not in console and "held-out accuracy" not in console, "the training's lines: the log only"
    assert "sklearn_color" in console.split("held-out metrics")[-1], "the table stays on the console"
    assert len(lines) < 15, console
    (tmp_path / "teachers" / "sklearn_color" / "teacher.json").unlink()  # fitted again, with its output shown
    console = _run("teachers", args + ["build=[sklearn_color]", "verbose=true"], capfd)
    assert "rendered 32/32" in console and "held-out accuracy" in console and "\r" not in console


@pytest.fixture(scope="module")
def zoo_model(vlora_home):
    from zoo import build_checkpoint

    return build_checkpoint("qwen2_vl_tiny", vlora_home / "zoo" / "qwen2_vl_tiny")


def test_vlora_offline_alone_is_quiet_and_its_verbose_output_has_no_carriage_returns(tmp_path, zoo_model, capfd):
    args = [f"paths.home={tmp_path}", f"model.path={zoo_model}", "distill.only=[exists_bus]",
            "distill.domains.exists_bus.size=8", "fusion.only={exists_bus: 0.1}", "fusion.accept_at_baseline=true",
            "fusion.rehearsal=0", "fusion.refit_head_epochs=0", "train.base=model", "train.allow_random_base=true",
            "train.epochs=1", "train.batch_size=4", "adapter.rank=4", "offline.per_domain=false",
            "offline.all_in_one=false", "offline.other_orders=[]", "offline.compare_lm_head=null",
            "offline.base_eval_limit=0"]
    # everything on the console: the world's rendering, distillation and training progress as lines
    console = _run("offline", args + ["verbose=true"], capfd)
    assert "\r" not in console, [line for line in console.split("\n") if "\r" in line][:3]
    for progress in ("items (", "images labelled by truth", "[train "):
        assert progress in console, progress
    # alone and quiet: a line per step and the report; the rest in offline.log
    console = _run("offline", args, capfd)
    log = (tmp_path / "results" / "offline" / "offline.log").read_text()
    steps = [line for line in console.splitlines() if line.startswith("[offline")]
    assert [s.split("]")[0] for s in steps] == ["[offline", "[offline 1/3", "[offline 2/3", "[offline 3/3"]
    assert "Distilled knowledge domains" in log and "Distilled knowledge domains" not in console
    assert "Offline stage: " in console and "exists_bus" in console, "the summary and the report stay"
    assert "\r" not in log and "\r" not in console


NOISY = """
import subprocess, sys, time
from tqdm import tqdm
from vlora.commands.capture import StderrLines
from world.progress import ProgressLine

with StderrLines(every_s=float(sys.argv[1])):
    for _ in tqdm(range(300), desc="a third-party bar", mininterval=0):
        pass
    bar = ProgressLine(sys.stderr, every_s=3600)
    for i in range(1, 301):
        bar.update(f"our step {i}/300")
    bar.end()
    subprocess.run([sys.executable, "-c", "import sys; [sys.stderr.write(f'\\\\rchild {i}') for i in range(50)]"])
    print(file=sys.stderr)
    print("stdout is left as it is", flush=True)
"""


def test_stderr_to_a_file_gets_lines_from_every_writer(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(tmp_path / "err.txt", "wb") as err:
        out = subprocess.run([sys.executable, "-c", NOISY, "3600"], stdout=subprocess.PIPE, stderr=err, env=env,
                             timeout=60, check=True).stdout.decode()
    lines = (tmp_path / "err.txt").read_text().splitlines()
    assert "\r" not in "\n".join(lines)
    assert [line for line in lines if "a third-party bar" in line][-1].startswith("a third-party bar: 100%")
    assert len([line for line in lines if "a third-party bar" in line]) == 1, lines
    assert [line for line in lines if "our step" in line] == ["our step 1/300", "our step 300/300"]
    assert "child 49" in lines
    assert out == "stdout is left as it is\n"


def test_a_long_command_run_with_stderr_to_a_file_writes_lines(tmp_path):
    """`vlora zoo` (transformers' bars when it writes shards) through the real command line."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(tmp_path / "run.txt", "wb") as out:
        subprocess.run([sys.executable, "-m", "vlora", "zoo", "zoo.models=[qwen2_vl_tiny]", f"zoo.dir={tmp_path / 'zoo'}",
                        f"paths.home={tmp_path}"], stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path, env=env,
                       timeout=300, check=True)
    text = (tmp_path / "run.txt").read_text()
    assert "\r" not in text and "Writing model shards: 100%" in text and "[zoo 1/1] qwen2_vl_tiny" in text
