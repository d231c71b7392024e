"""What a user may hand the server and the applications as adapters, read as one set.

A source is a fusion manifest (manifest.json, or the folder holding it), a single adapter
directory (what `vlora train` writes: PEFT files, meta.json, heads/), or a list of these:

    found = read_sources(["runs/fused", "adapters/plates"])
    found.entries    # every adapter to load: AdapterEntry(name, path, base, origin)
    found.manifest   # the routing view in read_manifest's format (None when nothing has domains)

A single adapter directory becomes a one-adapter manifest built from its meta.json (its domains,
tasks and recorded accuracies; no requirement, so 0.0). A PEFT directory without meta.json
(trained elsewhere) is loaded but routes nothing and records no base. Names must be unique
across the sources: a clash is refused (ManifestError) naming both sources. A domain that
several sources serve is routed to the most accurate of them (the first on a tie).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from .base import recorded_base
from .layout import MANIFEST, PEFT_CONFIG
from .manifest import CREATED_BY, ManifestError, read_manifest
from .meta import read_meta


@dataclass(frozen=True)
class AdapterEntry:
    name: str
    path: str  # absolute
    base: dict | None  # the base identity it records (adapters.base), None when unknown
    origin: str  # the source it came from
    has_meta: bool = True


@dataclass
class AdapterSet:
    entries: list[AdapterEntry] = field(default_factory=list)
    manifest: dict[str, Any] | None = None
    missing: list[str] = field(default_factory=list)  # sources that do not exist (yet)


def as_list(sources: Any) -> list[str]:
    """A source or a list of them (None / "" = none) as a list of strings."""
    if sources is None or sources == "":
        return []
    if isinstance(sources, (str, os.PathLike)):
        return [str(sources)]
    return [str(s) for s in sources if s not in (None, "")]


def kind_of(path: str | os.PathLike) -> str | None:
    """ "manifest", "adapter" or None (nothing there); ManifestError for something else."""
    p = Path(path)
    if not p.exists():
        return None
    if p.is_file() or (p / MANIFEST).is_file():
        return "manifest"
    if (p / PEFT_CONFIG).is_file():
        return "adapter"
    raise ManifestError(f"{p} is neither a fusion manifest (a {MANIFEST} or a folder holding one) nor an adapter "
                        f"directory (a folder with {PEFT_CONFIG}, as `vlora train` writes)")


def read_sources(sources: Any, extra: Iterable[str] = ()) -> AdapterSet:
    """Every adapter of `sources` (see the module's docstring) and of `extra` (adapter directories,
    "path" or "name=path"), with the combined routing view. Sources that do not exist are listed in
    `missing`, not an error (a fusion that has not run yet)."""
    found = AdapterSet()
    pieces: list[dict] = []  # per source: its routing manifest (or None)
    for source in as_list(sources):
        kind = kind_of(source)
        if kind is None:
            found.missing.append(source)
        elif kind == "manifest":
            manifest = read_manifest(source)
            where = str(Path(source))
            for a in manifest["adapters"]:
                meta = read_meta(a["path"], required=False)
                base = recorded_base(meta) or recorded_base(manifest)
                _add(found, AdapterEntry(a["name"], a["path"], base, where, bool(meta)))
            pieces.append(manifest)
        else:
            entry, manifest = _adapter_dir(source)
            _add(found, entry)
            if manifest is not None:
                pieces.append(manifest)
    for spec in extra:
        name, _, path = spec.partition("=") if "=" in spec else (None, "", spec)
        entry, _ = _adapter_dir(path, name)
        _add(found, entry)
    found.manifest = _combine(pieces) if pieces else None
    return found


def _add(found: AdapterSet, entry: AdapterEntry) -> None:
    for e in found.entries:
        if e.name == entry.name:
            if Path(e.path) == Path(entry.path):
                return  # the same adapter given twice
            raise ManifestError(f"adapter name {entry.name!r} is in both {e.origin} and {entry.origin}; names must "
                                "be unique on one server: re-run one fusion with fusion.name=<another name> (or "
                                "give a single adapter as name=path in adapters.extra)")
    found.entries.append(entry)


def _adapter_dir(path: str, name: str | None = None) -> tuple[AdapterEntry, dict | None]:
    """A `vlora train` adapter directory as an entry and its one-adapter manifest (None without meta.json)."""
    p = Path(path).expanduser().resolve()
    if not (p / PEFT_CONFIG).is_file():
        raise ManifestError(f"{path} is not an adapter directory: no {PEFT_CONFIG}")
    meta = read_meta(p, required=False)
    name = name or meta.get("name") or p.name
    entry = AdapterEntry(name, str(p), recorded_base(meta), str(path), bool(meta))
    domains = meta.get("domains") if isinstance(meta.get("domains"), dict) else {}
    order = [d for d in meta.get("order", list(domains)) if d in domains] or list(domains)
    if not order:
        return entry, None
    accs = {d: _accuracy(domains[d].get("accuracy")) for d in order}
    tasks = {d: {"adapter": name, "head": d if domains[d].get("head") else None, "task": domains[d].get("task"),
                 "accuracy": accs[d], "requirement": 0.0, "met": True, "question": domains[d].get("question"),
                 "media": domains[d].get("media")}
             for d in order}
    adapter = {"name": name, "path": str(p), "index": 0, "domains": order, "accuracies": accs, "met": True}
    return entry, {"adapters": [adapter], "tasks": tasks, "order": order, "created_by": CREATED_BY,
                   "sources": [str(path)]}


def _accuracy(x: Any) -> float:
    ok = isinstance(x, (int, float)) and not isinstance(x, bool) and 0.0 <= x <= 1.0
    return float(x) if ok else 0.0  # not evaluated: routable only with no accuracy target


def _combine(pieces: list[dict]) -> dict[str, Any]:
    """One manifest of several; a single piece comes back as it was read."""
    if len(pieces) == 1:
        return pieces[0]
    adapters, tasks, order, seen = [], {}, [], set()
    for m in pieces:
        for a in m["adapters"]:
            if a["name"] not in seen:
                seen.add(a["name"])
                adapters.append(a)
        for d, t in m["tasks"].items():
            if d not in tasks or t["accuracy"] > tasks[d]["accuracy"]:
                tasks[d] = t
        order += [d for d in m["order"] if d not in order]
    return {"adapters": adapters, "tasks": tasks, "order": order, "created_by": CREATED_BY,
            "sources": [s for m in pieces for s in m.get("sources", [])]}
