"""Quiet by default: what third-party training writes (ultralytics' logger and progress bars,
print, child processes, C-level writes) goes to the run's log file, not the console, where only
the lines the command says appear; the log holds each progress bar as one clean line."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from vlora.commands.capture import TerminalLines, shown

ROOT = Path(__file__).resolve().parents[2]

# a run's noise, from every kind of writer, between two stage lines
NOISY_RUN = textwrap.dedent("""
    import os, subprocess, sys
    from vlora.commands.capture import CapturedOutput

    with CapturedOutput(sys.argv[1], verbose=sys.argv[2] == "verbose") as console:
        console.say("[run 1/2] training")
        from ultralytics.utils import LOGGER, TQDM   # its handler took sys.stdout at import
        for epoch in TQDM(range(300), desc="epoch 1/1"):
            pass
        LOGGER.info("ultralytics says hello")
        print("a print of the training loop")
        print("a warning on stderr", file=sys.stderr)
        os.write(1, b"a C library writes fd 1\\n")
        subprocess.run([sys.executable, "-c", "print('a child process writes')"], check=True)
        console.say("[run 2/2] report")
        if len(sys.argv) > 3:
            raise RuntimeError("the training failed")
    print("after the run: the console again")
""")


def _run(tmp_path, mode: str, *extra: str) -> tuple[subprocess.CompletedProcess, str]:
    log = tmp_path / "run.log"
    env = {**os.environ, "YOLO_CONFIG_DIR": str(tmp_path / "ultralytics"), "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", NOISY_RUN, str(log), mode, *extra], capture_output=True,
                          text=True, env=env, timeout=120)
    return proc, log.read_text()


NOISE = ("epoch 1/1", "ultralytics says hello", "a print of the training loop", "a warning on stderr",
         "a C library writes fd 1", "a child process writes")


def test_third_party_training_output_goes_to_the_log_and_the_console_gets_one_line_per_stage(tmp_path):
    proc, log = _run(tmp_path, "quiet")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == ["[run 1/2] training", "[run 2/2] report"]
    assert proc.stdout.splitlines() == ["after the run: the console again"]
    for noise in NOISE:
        assert noise in log, noise
    lines = log.splitlines()
    assert lines[0] == "[run 1/2] training" and lines[-1] == "[run 2/2] report", "stage lines in order"
    assert "\r" not in log and "\x1b" not in log
    bar = [line for line in lines if "epoch 1/1" in line]
    assert len(bar) == 1 and "300/300" in bar[0], "the bar's 300 updates are its last state, on one line"


def test_verbose_shows_everything_on_the_console_and_still_writes_the_log(tmp_path):
    proc, log = _run(tmp_path, "verbose")
    assert proc.returncode == 0, proc.stderr
    console = proc.stderr + proc.stdout
    for noise in NOISE:
        assert noise in console and noise in log, noise
    assert console.count("[run 1/2] training") == 1


def test_a_failure_shows_the_end_of_the_log_on_the_console(tmp_path):
    proc, log = _run(tmp_path, "quiet", "fail")
    assert proc.returncode == 1
    assert re.search(rf"the last \d+ lines of {re.escape(str(tmp_path / 'run.log'))}", proc.stderr)
    assert "a child process writes" in proc.stderr
    assert "RuntimeError: the training failed" in proc.stderr


def test_terminal_lines_keep_what_a_terminal_shows():
    lines = TerminalLines()
    out = lines.feed(b"\x1b[34mepoch\x1b[0m 1/3\r\x1b[Kepoch 2/3\r\x1b[")  # an escape cut between two reads
    assert out == []
    out += lines.feed(b"Kepoch 3/3\r\x1b[K\nplain line\npartial")
    assert out == ["epoch 3/3", "plain line"]
    assert lines.close() == ["partial"]
    assert lines.feed("\u00e9t\u00e9\n".encode()[:2]) == [] and lines.feed("\u00e9t\u00e9\n".encode()[2:]) == ["\u00e9t\u00e9"]
    assert shown("a\r\r") == "a" and shown("\x1b[K") == ""


def test_python_writers_are_captured_where_sys_stdout_is_not_fd_1(tmp_path, capsys):
    """Under a test runner's capture (or in a notebook) sys.stdout is no file descriptor: what the
    captured code prints still goes to the log, and the streams are given back after."""
    from vlora.commands.capture import CapturedOutput

    before = sys.stdout
    with CapturedOutput(tmp_path / "run.log") as console:
        print("a print of the training loop")
        print("a warning", file=sys.stderr)
        console.say("[run 1/1] training")
    print("after the run")
    assert sys.stdout is before
    assert (tmp_path / "run.log").read_text().splitlines() == ["a print of the training loop", "a warning",
                                                                "[run 1/1] training"]
    assert capsys.readouterr().out == "after the run\n"


def test_a_long_running_progress_line_leaves_its_state_in_the_log_as_it_moves(tmp_path):
    """A step counter rewritten by carriage returns for minutes (the world pretraining's) shows in
    the log while it runs, not only when its line ends."""
    import time

    from vlora.commands.capture import CapturedOutput

    log = tmp_path / "run.log"
    with CapturedOutput(log, progress_every_s=0.2):
        for step in range(1, 4):
            print(f"\r[pretrain] step {step}/3", end="", flush=True)
            time.sleep(0.3)
            if step == 2:
                seen = log.read_text().splitlines()
        print()
    assert seen == ["[pretrain] step 1/3", "[pretrain] step 2/3"] or seen == ["[pretrain] step 2/3"], seen
    assert log.read_text().splitlines()[-1] == "[pretrain] step 3/3"
