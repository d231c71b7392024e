"""Fusion progress and its journal on disk, so an interrupted fusion resumes where it stopped.

    workdir/journal.json   the progress after the last finished step (written atomically)
    workdir/ckpt_<step>    trainer checkpoint of the open adapter (and of a rolled-back one, and
                           ckpt_<step>_joined of its joined state, kept while its violator is tried alone)
    workdir/adapter_<i>    trainer checkpoint of each closed adapter

A step is committed by writing the journal, after the checkpoints it names: a crash before that
leaves the previous journal in force and the step is simply trained again. Checkpoints no
journal names any more are deleted once the new journal is in place.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from adapters.files import write_json_atomic

from .spec import Domain, FusedAdapter, FusionEvent, Trainer

JOURNAL = "journal.json"
VERSION = 1


def adapter_name(index: int) -> str:
    """The name of an adapter inside a run (journal, events); export_adapters names the saved
    ones after the run (<run>_<index>), so two runs' manifests can be served together."""
    return f"fused_{index}"


@dataclass
class OpenAdapter:
    """An adapter still taking domains; `state` is its last state that met every requirement."""

    index: int
    domains: list[str]
    accuracies: dict[str, float]
    state: Any
    checkpoint: str | None = None  # file name under workdir, once saved
    # members that miss their requirement, fused because they did no worse here than alone
    # (greedy's place_missed="best"): the accuracy they had alone, which they must keep instead
    floors: dict[str, float] = field(default_factory=dict)
    baselines: dict[str, dict] = field(default_factory=dict)  # each member's baseline verdict (Trainer.baseline)

    def holds(self, domain: Domain, accuracy: float) -> bool:
        """Whether a member (or the joining domain) is where it must be: its floor, or its requirement."""
        floor = self.floors.get(domain.name)
        return domain.met_by(accuracy) if floor is None else accuracy >= floor

    def closed(self, by_name: dict[str, Domain]) -> FusedAdapter:
        reqs = {d: by_name[d].requirement for d in self.domains}
        return FusedAdapter(self.index, adapter_name(self.index), list(self.domains), dict(self.accuracies),
                            reqs, all(by_name[d].met_by(self.accuracies[d]) for d in self.domains), self.state,
                            baselines=dict(self.baselines))


@dataclass
class Progress:
    pos: int = 0  # position in the order of the next domain to train
    next_index: int = 0  # index the next new adapter gets
    current: OpenAdapter | None = None
    parked: OpenAdapter | None = None  # rolled back, kept until its violator is tried alone
    joined: OpenAdapter | None = None  # parked with its violator fused, where that was the only one below
    closed: list[FusedAdapter] = field(default_factory=list)
    events: list[FusionEvent] = field(default_factory=list)
    done: bool = False


def _remove(path: Path) -> None:
    # A trainer checkpoint may be a file (the fakes) or a directory (a PEFT adapter).
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


class Journal:
    def __init__(self, workdir: str | os.PathLike, ordered: list[Domain], order: str, seed: int,
                 trainer: Trainer, place_missed: str = "best", baseline_check: bool = False):
        self.dir = Path(workdir)
        self.path = self.dir / JOURNAL
        self.ordered, self.trainer = ordered, trainer
        self.header = {"version": VERSION, "order": order, "seed": seed if order == "seeded" else None,
                       "domains": [d.to_dict() for d in ordered],
                       # how the trainer trains (e.g. rehearsal): states trained otherwise must not mix
                       "trainer": dict(getattr(trainer, "settings", None) or {}),
                       "place_missed": place_missed,
                       # whether domains had to beat their majority baseline: decisions made without
                       # that rule must not be resumed under it, nor the other way round
                       "baseline_check": baseline_check}

    def resume(self) -> Progress | None:
        """The progress recorded in workdir, or None when there is no journal yet."""
        if not self.path.exists():
            return None
        try:
            data = json.loads(self.path.read_text())
        except ValueError as e:
            raise ValueError(f"fusion journal {self.path} is not valid JSON ({e}); delete it to start over") from e
        self._verify(data)
        run = Progress(data["pos"], data["next_index"], self._open(data["current"]), self._open(data["parked"]),
                       self._open(data.get("joined")), done=data["done"])
        for c in data["closed"]:
            state = self._load(c["path"])
            run.closed.append(FusedAdapter(c["index"], c["name"], c["domains"], c["accuracies"],
                                           c["requirements"], c["met"], state, str(self.dir / c["path"]),
                                           dict(c.get("baselines") or {})))
        run.events = [FusionEvent.from_dict(e) for e in data["events"]]
        return run

    def commit(self, run: Progress) -> None:
        """Save what this step made, then the journal that names it, then drop what is unnamed."""
        self.dir.mkdir(parents=True, exist_ok=True)
        for a in run.closed:
            if a.path is None:
                target = self.dir / f"adapter_{a.index}"
                _remove(target)  # left by a crash before the journal that would have named it
                self.trainer.save(a.state, str(target))
                a.path = str(target)
        for o in (run.current, run.parked, run.joined):
            if o is not None and o.checkpoint is None:
                o.checkpoint = f"ckpt_{len(run.events)}" + ("_joined" if o is run.joined else "")
                _remove(self.dir / o.checkpoint)
                self.trainer.save(o.state, str(self.dir / o.checkpoint))
        write_json_atomic(self.path, {**self.header, **self._progress_dict(run)})
        keep = {o.checkpoint for o in (run.current, run.parked, run.joined) if o is not None}
        for stale in self.dir.glob("ckpt_*"):
            if stale.name not in keep:
                _remove(stale)

    def _progress_dict(self, run: Progress) -> dict[str, Any]:
        def open_dict(o: OpenAdapter | None) -> dict[str, Any] | None:
            return None if o is None else {"index": o.index, "domains": o.domains, "accuracies": o.accuracies,
                                           "checkpoint": o.checkpoint, "floors": o.floors, "baselines": o.baselines}

        closed = [{"index": a.index, "name": a.name, "domains": a.domains, "accuracies": a.accuracies,
                   "requirements": a.requirements, "met": a.met, "path": Path(a.path).name,
                   "baselines": a.baselines} for a in run.closed]
        return {"pos": run.pos, "next_index": run.next_index, "done": run.done, "current": open_dict(run.current),
                "parked": open_dict(run.parked), "joined": open_dict(run.joined), "closed": closed,
                "events": [e.to_dict() for e in run.events]}

    def _open(self, d: dict[str, Any] | None) -> OpenAdapter | None:
        if d is None:
            return None
        return OpenAdapter(d["index"], d["domains"], d["accuracies"], self._load(d["checkpoint"]), d["checkpoint"],
                           dict(d.get("floors", {})), dict(d.get("baselines") or {}))

    def _load(self, name: str) -> Any:
        path = self.dir / name
        if not path.exists():
            raise FileNotFoundError(f"fusion journal {self.path} names checkpoint {path}, which is missing; "
                                    "delete the workdir to start over")
        return self.trainer.load(str(path))

    def _verify(self, data: dict[str, Any]) -> None:
        """Resuming under other domains or another order would mix two different fusions."""
        where = f"fusion journal {self.path}"
        if data.get("version") != VERSION:
            raise ValueError(f"{where} has version {data.get('version')!r}, expected {VERSION}")
        then = {d["name"]: d for d in data["domains"]}
        now = {d["name"]: d for d in self.header["domains"]}
        if then.keys() != now.keys():
            raise ValueError(f"{where} is for other domains: in the journal only {sorted(then.keys() - now.keys())}, "
                             f"given only {sorted(now.keys() - then.keys())}; use another workdir or delete it")
        changed = [f"{n}: journal {then[n]}, now {now[n]}" for n in now if then[n] != now[n]]
        if changed:
            raise ValueError(f"{where}: domains changed since it was written: " + "; ".join(changed))
        # a journal from before place_missed was recorded was made the paper's way: "alone"
        # and one from before the baseline check accepted domains without it
        for key, before in (("order", None), ("seed", None), ("trainer", {}), ("place_missed", "alone"),
                            ("baseline_check", False)):
            if data.get(key, before) != self.header[key]:
                raise ValueError(f"{where} was made with {key}={data.get(key)!r}, now {key}={self.header[key]!r}")
        names_then, names_now = list(then), list(now)
        if names_then != names_now:
            raise ValueError(f"{where}: the domain order differs: journal {names_then}, now {names_now}")
