"""The README and docs/ stay true to the code: every relative link and repository path they name
exists, every `vlora` command they show composes with its real Hydra config (`--cfg job`, all in
one process), and their Python snippets run as written (the server one against a real `vlora serve`).

A command is checked as a user would type it: shell words (quotes, line continuations, `&&`),
`NAME=value` prefixes as its environment, `python -m vlora`, `torchrun ... -m vlora.cli`."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# top-level folders of the repository: a code span starting with one of them names a repository path
TOP_DIRS = ("adapters", "apps", "bench", "conf", "docs", "fusion", "heads", "vlora_kernels", "results", "serve",
            "tests", "train", "vlora", "world", "zoo")
FENCE = re.compile(r"^```(\w*)\s*$")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
SPAN = re.compile(r"`([^`\n]+)`")
ENV_PREFIX = re.compile(r"^[A-Z_][A-Z0-9_]*=")


def _parse(path: Path) -> tuple[list[tuple[str, str, int]], str]:
    """(fenced blocks as (language, text, first line number), the prose with the blocks left out)."""
    blocks, prose, lang, body, start = [], [], None, [], 0
    for number, line in enumerate(path.read_text().splitlines(), 1):
        fence = FENCE.match(line)
        if lang is None and fence:
            lang, body, start = fence.group(1) or "text", [], number + 1
        elif lang is not None and line.startswith("```"):
            blocks.append((lang, "\n".join(body), start))
            lang = None
        elif lang is not None:
            body.append(line)
        else:
            prose.append(line)
    assert lang is None, f"{path.name}: a code block opened at line {start - 1} is never closed"
    return blocks, "\n".join(prose)


PARSED = {path: _parse(path) for path in DOCS}


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but - and _ dropped, spaces to hyphens."""
    text = heading.strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in PARSED[path][1].splitlines() if line.startswith("#")}


def test_every_relative_link_and_anchor_exists():
    broken = []
    for doc, (_, prose) in PARSED.items():
        for target in LINK.findall(prose):
            if re.match(r"^[a-z]+:", target):  # http(s), mailto: not ours to check offline
                continue
            file_part, _, anchor = target.partition("#")
            dest = (doc.parent / file_part).resolve() if file_part else doc
            if not dest.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no such file or directory)")
            elif anchor and dest.suffix == ".md" and dest in PARSED and anchor not in _anchors(dest):
                broken.append(f"{doc.relative_to(ROOT)}: {target} (no heading gives #{anchor})")
    assert not broken, "broken links:\n" + "\n".join(broken)


def _repo_paths(text: str) -> set[str]:
    """Code spans that name a repository path: `conf/serve.yaml`, `results/soak/`, ..."""
    return {span for span in SPAN.findall(text)
            if span.split("/")[0] in TOP_DIRS and "/" in span and re.fullmatch(r"[\w./-]+", span)}


def test_every_repository_path_named_exists():
    missing = [f"{doc.relative_to(ROOT)}: `{p}`" for doc, (_, prose) in PARSED.items()
               for p in sorted(_repo_paths(prose)) if not (ROOT / p).exists()]
    assert not missing, "code spans naming paths that do not exist:\n" + "\n".join(missing)


def _shell_commands(block: str) -> list[list[str]]:
    """Shell words of each command of a bash block: continuations and multi-line quotes joined,
    comments dropped, `a && b` split."""
    commands, pending = [], ""
    for line in block.splitlines():
        pending += line + "\n"
        if pending.rstrip("\n").endswith("\\"):
            pending = pending.rstrip("\n")[:-1] + " "
            continue
        try:
            words = shlex.split(pending, comments=True)
        except ValueError:  # a quote still open: the command goes on on the next line
            continue
        pending = ""
        command = []
        for word in words + ["&&"]:
            if word in ("&&", "||", ";", "|"):
                if command:
                    commands.append(command)
                command = []
            else:
                command.append(word)
    assert not pending.strip(), f"unterminated command in a code block: {pending!r}"
    return commands


def _vlora_call(words: list[str]) -> tuple[dict[str, str], list[str]] | None:
    """(environment, arguments after `vlora`) of a command that runs the vlora CLI, else None."""
    env = {}
    while words and ENV_PREFIX.match(words[0]):
        name, _, value = words[0].partition("=")
        env[name], words = value, words[1:]
    if words[:1] == ["vlora"]:
        return env, words[1:]
    for module in ("vlora", "vlora.cli"):  # python -m vlora ..., torchrun ... -m vlora.cli ...
        for i in range(len(words) - 1):
            if words[i] == "-m" and words[i + 1] == module:
                return env, words[i + 2:]
    return None


def _shown_commands() -> list[tuple[str, dict[str, str], list[str]]]:
    """(where, environment, vlora arguments) of every vlora command in a shell block of the docs,
    and of every inline `vlora <command> key=value ...` span."""
    from vlora.cli import COMMANDS

    shown = []
    for doc, (blocks, prose) in PARSED.items():
        name = doc.relative_to(ROOT)
        for lang, text, line in blocks:
            if lang in ("bash", "sh", "shell", "console"):
                for words in _shell_commands(text):
                    call = _vlora_call(words)
                    if call and call[1]:
                        shown.append((f"{name}:{line}", *call))
        for span in SPAN.findall(prose):
            words = shlex.split(span)
            if len(words) > 2 and words[0] == "vlora" and words[1] in COMMANDS and "=" in span:
                shown.append((f"{name} (inline)", {}, words[1:]))
    return shown


# Runs each command in one process: a Hydra command through the CLI's own Hydra entry point for its
# config (vlora.config.hydra_entry, as vlora.cli does) with `--cfg job` appended, so Hydra composes and
# prints the config and exits without running the job (the command's module, and torch, never load);
# a plain command (`vlora tenants`) as it is, in this temporary folder, so `tenants add` writes the
# file that the `serve rpc.tenants=` after it names.
DRIVER = r"""
import contextlib, io, json, os, sys
from hydra.core.global_hydra import GlobalHydra
from vlora import cli
from vlora.config import hydra_entry

results = []
for env, args in json.load(sys.stdin):
    saved = dict(os.environ)
    os.environ.update(env)
    out, err, code = io.StringIO(), io.StringIO(), 0
    GlobalHydra.instance().clear()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            if args[0] in cli.PLAIN:
                cli.main(list(args))
            else:
                sys.argv = [f"vlora-{args[0]}", *args[1:], *([] if "--cfg" in args else ["--cfg", "job"])]
                hydra_entry(cli.COMMANDS[args[0]][1], lambda cfg: None)()
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    except Exception as error:  # a failure outside Hydra's own reporting
        code, err = 1, io.StringIO(repr(error))
    os.environ.clear()
    os.environ.update(saved)
    results.append({"code": code, "out": out.getvalue()[-300:], "err": err.getvalue()[-800:]})
print("RESULTS" + json.dumps(results))
"""


def test_every_vlora_command_shown_composes_with_its_config(tmp_path):
    from vlora.cli import COMMANDS, PLAIN

    shown = _shown_commands()
    unknown = [f"{where}: vlora {args[0]}" for where, _, args in shown if args[0] not in COMMANDS | PLAIN]
    assert not unknown, "commands the vlora CLI does not have:\n" + "\n".join(unknown)
    assert len(shown) >= 20, f"only {len(shown)} vlora commands found in the docs: is the parsing broken?"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VLORA_HOME": str(tmp_path / ".vlora"), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", DRIVER], input=json.dumps([[e, a] for _, e, a in shown]),
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert "RESULTS" in proc.stdout, f"the driver failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    results = json.loads(proc.stdout.rsplit("RESULTS", 1)[1])
    failed = [f"{where}: vlora {shlex.join(args)}\n  {r['err'].strip() or r['out'].strip()}"
              for (where, _, args), r in zip(shown, results) if r["code"] != 0]
    assert not failed, "commands that do not compose:\n" + "\n\n".join(failed)


def test_every_python_module_shown_exists():
    import importlib.util

    sys.path.insert(0, str(ROOT))
    try:
        missing = []
        for doc, (blocks, prose) in PARSED.items():
            texts = [text for _, text, _ in blocks] + SPAN.findall(prose)
            for module in sorted({m for text in texts for m in re.findall(r"python -m ([\w.]+)", text)}):
                if module.split(".")[0] in TOP_DIRS and importlib.util.find_spec(module) is None:
                    missing.append(f"{doc.relative_to(ROOT)}: python -m {module}")
    finally:
        sys.path.remove(str(ROOT))
    assert not missing, "modules the docs run that do not exist:\n" + "\n".join(missing)


def _python_blocks(doc: Path) -> list[tuple[str, int]]:
    return [(text, line) for lang, text, line in PARSED[doc][0] if lang == "python"]


def _run_snippet(code: str, cwd: Path, where: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"the snippet at {where} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def user_folder(tmp_path_factory):
    """A user's folder: the README's engine snippet builds the tiny zoo model under its ./.vlora,
    which the docs' server snippet then serves (one build for both)."""
    return tmp_path_factory.mktemp("user")


def test_readme_snippets_run_as_written(user_folder):
    blocks = _python_blocks(ROOT / "README.md")
    assert blocks, "the README shows no Python snippet"
    for code, line in blocks:
        out = _run_snippet(code, user_folder, f"README.md:{line}")
        assert out.strip(), f"the snippet at README.md:{line} printed nothing"


def test_docs_snippets_run(user_folder):
    """Snippets of docs/ run as written; one that connects a Client to 127.0.0.1:18861 with the token
    change-me runs against a real `vlora serve` started here with that token (on a free port, put
    in place of 18861, so the test never takes a port a user's server may hold)."""
    from zoo import build_checkpoint

    sys.path.insert(0, str(Path(__file__).parent))
    from rpc_server import ServerProcess

    snippets = [(doc, code, line) for doc in DOCS[1:] for code, line in _python_blocks(doc)]
    assert snippets, "docs/ show no Python snippet"
    server = None
    try:
        for doc, code, line in snippets:
            where = f"{doc.relative_to(ROOT)}:{line}"
            if 'Client("127.0.0.1", 18861, "change-me")' not in code:
                _run_snippet(code, user_folder, where)
                continue
            if server is None:  # the model the README's snippet built, or a fresh build when run alone
                checkpoint = build_checkpoint("qwen2_vl_tiny", user_folder / ".vlora" / "zoo" / "qwen2_vl_tiny")
                # the engine on a thread of the server: the snippet is about the client, and the
                # engine's own process (tests/serve/rpc/test_engine_process.py) costs ~15 s more here
                server = ServerProcess(checkpoint, user_folder / "server_home", "rpc.token=change-me",
                                       "rpc.engine_process=false")
            out = _run_snippet(code.replace("18861", str(server.port)), user_folder, where)
            assert "'type': 'final'" in out, f"{where}: the snippet printed no final event:\n{out}"
    finally:
        if server is not None:
            server.stop()
