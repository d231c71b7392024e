"""manifest.json: which fused adapter and head serve each domain, and how accurately.

    {"adapters": [{"name": "fused_0", "path": "fused_0", "index": 0, "domains": [...],
                   "accuracies": {...}, "met": true}, ...],
     "tasks": {"plate": {"adapter": "fused_0", "head": "plate", "task": "detect",
                         "accuracy": 0.91, "requirement": 0.8, "met": true}, ...},
     "order": ["plate", ...], "created_by": "vlora fusion", ...extra keys}

Written by fusion, read by the server (adapters to load at start) and the applications
(routing). Adapter paths under the manifest's directory are stored relative to it, so the folder can be
moved; `read_manifest` returns them resolved. Applications pick an adapter with
`select_adapter` instead of hard-coding names.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .files import write_json_atomic
from .layout import MANIFEST

CREATED_BY = "vlora fusion"
_RESERVED = ("adapters", "tasks", "order", "created_by")


class ManifestError(ValueError):
    """A manifest that is missing, malformed or inconsistent; the message lists every problem."""


def write_manifest(result, out_dir: str | os.PathLike, adapter_paths: dict[int, str] | None = None,
                   extra: dict | None = None, questions: dict[str, str | None] | None = None,
                   media: dict[str, str] | None = None) -> Path:
    """Write out_dir/manifest.json of a fusion result (fusion.FusionResult: its adapters with their
    domains, accuracies and requirements, and the domains' order). Paths default to
    out_dir/<adapter name> (see fusion.export_adapters). `questions`: domain -> the one question its
    items ask (domain.json's), recorded so that routing sends a head only the question it answers.
    `media`: domain -> "image" or "clip", what its head was trained on, so that an app sends it the
    same (a video app sends an image head one frame of its chunk)."""
    out = Path(out_dir)
    if adapter_paths is not None:
        missing = [a.index for a in result.adapters if a.index not in adapter_paths]
        if missing:
            raise ValueError(f"write_manifest: adapter_paths has no path for adapter index(es) {missing}")
    clash = sorted(set(extra or {}) & set(_RESERVED))
    if clash:
        raise ValueError(f"write_manifest: extra may not set the reserved keys {clash}")
    tasks_of = {d.name: d.task for d in result.order}
    adapters, tasks = [], {}
    for a in result.adapters:
        path = Path(adapter_paths[a.index]) if adapter_paths is not None else out / a.name
        adapters.append({"name": a.name, "path": _relative(path, out), "index": a.index, "domains": list(a.domains),
                         "accuracies": dict(a.accuracies), "met": a.met})
        for d in a.domains:
            # One head per domain: an adapter fusing several domains carries one head for each.
            tasks[d] = {"adapter": a.name, "head": d, "task": tasks_of[d], "accuracy": a.accuracies[d],
                        "requirement": a.requirements[d], "met": a.accuracies[d] >= a.requirements[d]}
            if (questions or {}).get(d):
                tasks[d]["question"] = questions[d]
            if (media or {}).get(d):
                tasks[d]["media"] = media[d]
    manifest = {"adapters": adapters, "tasks": tasks, "order": [d.name for d in result.order],
                "created_by": CREATED_BY, **(extra or {})}
    _validate(manifest, out / MANIFEST)
    out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / MANIFEST, manifest)
    return out / MANIFEST


def _relative(path: Path, base: Path) -> str:
    try:
        return path.resolve().relative_to(base.resolve()).as_posix()
    except ValueError:
        return str(path)  # outside the manifest's folder: kept as given


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """Read and validate a manifest (the file or its directory); adapter paths come back absolute."""
    p = Path(path)
    if p.is_dir():
        p = p / MANIFEST
    if not p.exists():
        raise ManifestError(f"no fusion manifest at {p}")
    try:
        manifest = json.loads(p.read_text())
    except ValueError as e:
        raise ManifestError(f"{p} is not valid JSON: {e}") from e
    _validate(manifest, p)
    for a in manifest["adapters"]:
        a["path"] = str((p.parent / a["path"]).resolve())
    return manifest


def _is_acc(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and 0.0 <= x <= 1.0


def _validate(m: Any, where: Path) -> None:
    if not isinstance(m, dict):
        raise ManifestError(f"{where}: expected a JSON object, got {type(m).__name__}")
    problems = [f"missing key {k!r}" for k in _RESERVED if k not in m]
    if problems:
        raise ManifestError(f"{where}: " + "; ".join(problems))
    if m["created_by"] != CREATED_BY:
        problems.append(f"created_by is {m['created_by']!r}, expected {CREATED_BY!r}")
    adapters, tasks = m["adapters"], m["tasks"]
    if not isinstance(adapters, list) or not isinstance(tasks, dict) or not isinstance(m["order"], list):
        raise ManifestError(f"{where}: 'adapters' must be a list, 'tasks' an object and 'order' a list")
    members: dict[str, list[str]] = {}
    for i, a in enumerate(adapters):
        if not isinstance(a, dict) or not all(isinstance(a.get(k), str) for k in ("name", "path")):
            problems.append(f"adapters[{i}] needs string 'name' and 'path'")
            continue
        if a["name"] in members:
            problems.append(f"adapters[{i}]: name {a['name']!r} is repeated")
        doms = a.get("domains")
        if not isinstance(doms, list) or not doms or not all(isinstance(d, str) for d in doms):
            problems.append(f"adapters[{i}] ({a['name']}): 'domains' must be a non-empty list of names")
            doms = []
        members[a["name"]] = doms
    for dom, t in tasks.items():
        if not isinstance(t, dict):
            problems.append(f"tasks[{dom!r}] must be an object")
            continue
        missing = [k for k in ("adapter", "head", "task", "accuracy", "requirement", "met") if k not in t]
        if missing:
            problems.append(f"tasks[{dom!r}] lacks {missing}")
            continue
        if t["adapter"] not in members:
            problems.append(f"tasks[{dom!r}].adapter {t['adapter']!r} names no adapter (have {sorted(members)})")
        elif dom not in members[t["adapter"]]:
            problems.append(f"tasks[{dom!r}]: adapter {t['adapter']!r} does not list this domain")
        for k in ("accuracy", "requirement"):
            if not _is_acc(t[k]):
                problems.append(f"tasks[{dom!r}].{k} must be a number in [0, 1], got {t[k]!r}")
        if t.get("question") is not None and not isinstance(t["question"], str):
            problems.append(f"tasks[{dom!r}].question must be a string or null, got {t['question']!r}")
        if t.get("media") not in (None, "image", "clip"):
            problems.append(f"tasks[{dom!r}].media must be 'image', 'clip' or null, got {t['media']!r}")
    listed = {d for doms in members.values() for d in doms}
    if listed - tasks.keys():
        problems.append(f"domains in adapters but not in tasks: {sorted(listed - tasks.keys())}")
    if problems:
        raise ManifestError(f"{where}: " + "; ".join(problems))


@dataclass(frozen=True)
class Selection:
    adapter: str  # adapter name
    path: str
    head: str  # the head to run: the domain's own head
    domain: str
    task: str
    accuracy: float
    media: str | None = None  # what the head was trained on ("image" | "clip"); None: not recorded


def same_question(a: str, b: str) -> bool:
    """Equal up to case, spacing and the closing punctuation."""
    def norm(q: str) -> str:
        return " ".join(q.lower().split()).rstrip("?.! ")

    return norm(a) == norm(b)


def answers(entry: dict[str, Any], question: str | None) -> bool:
    """Whether a manifest task entry serves `question`: a domain answers the one question its items
    asked (a count head trained on "How many cars are there?" counts cars whatever it is asked).
    Entries that record no question (older manifests, per-item questions such as lm's) serve any."""
    return question is None or not entry.get("question") or same_question(entry["question"], question)


def domains_for(manifest: dict[str, Any], task_type_or_domain: str, question: str | None = None) -> list[str]:
    """The domains a key names: the domain itself, or every domain of that task type that `answers`
    `question` (possibly none). Raises KeyError when the manifest knows neither such a domain nor
    such a task type."""
    tasks = manifest["tasks"]
    if task_type_or_domain in tasks:
        return [task_type_or_domain]
    domains = [d for d, t in tasks.items() if t["task"] == task_type_or_domain]
    if not domains:
        types = sorted({t["task"] for t in tasks.values()})
        raise KeyError(f"select_adapter: {task_type_or_domain!r} is neither a domain ({sorted(tasks)}) "
                       f"nor a task type ({types}) of this manifest")
    return [d for d in domains if answers(tasks[d], question)]


def select_adapter(manifest: dict[str, Any], task_type_or_domain: str, accuracy_target: float,
                   question: str | None = None) -> Selection | None:
    """The cheapest adapter whose recorded accuracy on the domain reaches `accuracy_target` and
    that meets the domain's own requirement.

    The key is a domain name, or else a task type (any domain of that type that `answers` the
    request's `question` qualifies); cheapest is fewest fused domains, then name, then highest
    accuracy. An entry whose `met` is false (fusion could not reach the domain's requirement) is
    never selected, however low the caller's target: the next entry that meets its requirement
    serves instead. Returns None when no adapter qualifies, so the caller can fall back (e.g. to
    the base model and LM head); raises KeyError when the manifest knows neither such a domain
    nor such a task type.
    """
    if not _is_acc(accuracy_target):  # NaN fails the range check too
        raise ValueError(f"select_adapter: accuracy_target must be in [0, 1], got {accuracy_target!r}")
    tasks, by_name = manifest["tasks"], {a["name"]: a for a in manifest["adapters"]}
    domains = domains_for(manifest, task_type_or_domain, question)
    fits = [(len(by_name[tasks[d]["adapter"]]["domains"]), tasks[d]["adapter"], -tasks[d]["accuracy"], d)
            for d in domains if tasks[d]["accuracy"] >= accuracy_target and tasks[d]["met"] is not False]
    if not fits:
        return None
    _, name, _, d = min(fits)
    t = tasks[d]
    return Selection(name, by_name[name]["path"], t["head"], d, t["task"], t["accuracy"], t.get("media"))
