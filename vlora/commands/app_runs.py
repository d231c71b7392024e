"""Every application run writes a folder of its own, so a later run never overwrites an earlier one:

    ${paths.results}/video_analytics/20261127-203107/{report.json, results.jsonl, cam0.mp4}
    ${paths.results}/video_analytics/latest -> 20261127-203107     (the newest finished run)

`run_name=<name>` names the folder instead of the start time; a name already used is refused.
`latest` is a relative symlink; where the file system has none, a file `LATEST` holds the run's
name instead (`latest_run` reads either).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from omegaconf import DictConfig

LINK, POINTER = "latest", "LATEST"


def start_run(cfg: DictConfig, app: str) -> Path:
    """Creates the run's folder (cfg.run_dir) and sets cfg.run_name: the start time when null
    (with -2, -3, ... when two runs start in one second), else the name given, refused if used."""
    results = Path(cfg.results_dir)
    results.mkdir(parents=True, exist_ok=True)
    name = cfg.get("run_name")
    if name is not None:
        name = str(name)
        if not name or name in (LINK, POINTER, ".", "..") or "/" in name or os.sep in name:
            raise SystemExit(f"{app}: run_name={name!r}: use a plain folder name (not {LINK!r})")
        try:
            (results / name).mkdir()
        except FileExistsError:
            raise SystemExit(f"{app}: run_name={name}: {results / name} exists (an earlier run's results); pick "
                             "another run_name, or leave it out for a folder named by the start time") from None
    else:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for n in range(1, 1000):
            name = stamp if n == 1 else f"{stamp}-{n}"
            try:
                (results / name).mkdir()
                break
            except FileExistsError:
                continue
    cfg.run_name = name
    return Path(cfg.run_dir)


def finish_run(results_dir: str | os.PathLike, run_dir: Path) -> Path | None:
    """Points `latest` at the run's folder; a folder the run wrote nothing into (every output sent
    elsewhere) is removed instead. Returns the link (or pointer file) written."""
    results, run_dir = Path(results_dir), Path(run_dir)
    if run_dir.is_dir() and not any(run_dir.iterdir()):
        run_dir.rmdir()
        return None
    if run_dir.parent.resolve() != results.resolve():
        return None  # run_dir set elsewhere: not one of this folder's runs
    link = results / LINK
    tmp = results / f".{LINK}.{os.getpid()}"
    try:
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(run_dir.name, target_is_directory=True)
        os.replace(tmp, link)  # atomic: a reader sees the old run or the new one
        (results / POINTER).unlink(missing_ok=True)
        return link
    except OSError:  # no symlinks here (some file systems): a pointer file
        tmp.unlink(missing_ok=True)
        pointer = results / POINTER
        pointer.write_text(run_dir.name + "\n")
        return pointer


def latest_run(results_dir: str | os.PathLike) -> Path | None:
    """The newest finished run's folder under results_dir, or None."""
    results = Path(results_dir)
    if (results / LINK).is_dir():
        return (results / LINK).resolve()
    pointer = results / POINTER
    if pointer.is_file():
        run = results / pointer.read_text().strip()
        return run if run.is_dir() else None
    return None


def abandon_run(run_dir: Path) -> None:
    """A run that failed: its folder goes if it is empty; `latest` keeps naming the last finished run."""
    try:
        Path(run_dir).rmdir()
    except OSError:  # not empty (partial results stay for a look) or gone
        pass
