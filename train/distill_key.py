"""Distillation's cache key: what a distilled dataset was made from, and why a re-run rebuilds it.

    key = domain_key(spec, teacher, prompts, source, FileHashes(cache_file))
    key.fingerprint                  # domain.json "fingerprint": a re-run with the same one keeps the dataset
    key.record                       # domain.json "key": the parts, so a later run can say what changed
    rebuild_reasons(old_meta, key)   # ["the teacher's code changed (my_models/people.py)", ...]

The key covers the dataset format's version, the domain's config (the teacher's arguments as
given among it), the teacher (its description and weights, and for a plug-in the user's code
behind it; the content of any checkpoint its config names: teachers.provenance), the model
and its chat template, and the files of a source other than the world. A dataset distilled
before the key covered code and hashed checkpoints by file is recognised by the key it had then
(`DomainKey.legacy`) and kept when its teacher has no code of the user's to check.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from .distill_io import DOMAIN_FILE
from .distill_spec import VERSION, DomainSpec, fingerprint
from .teachers import Teacher, teacher_fingerprint
from .teachers.provenance import FileHashes, legacy_teacher_fingerprint, teacher_provenance

UNSET = "(unset)"


@dataclass
class DomainKey:
    fingerprint: str
    record: dict[str, Any]      # JSON: version, config, teacher {fingerprint, code, checkpoints}, model, template, source
    legacy: Callable[[], str]   # the fingerprint the same inputs had before (reads every checkpoint byte)


def _json(value: Any) -> Any:
    return json.loads(json.dumps(value, sort_keys=True, default=str))


def domain_key(spec: DomainSpec, teacher: Teacher, prompts, source=None, hashes: FileHashes | None = None) -> DomainKey:
    provenance = teacher_provenance(teacher, hashes)
    teacher_fp = teacher_fingerprint(teacher, provenance=provenance)
    source_fp = None if spec.from_world else source.fingerprint()

    def parts(teacher_part: str) -> list:
        out = [VERSION, spec.to_dict(), teacher_part, prompts.model, prompts.template]
        # a world domain's fingerprint stays what it was before sources existed
        return out if source_fp is None else out + [source_fp]

    record = {"version": VERSION, "config": _json(spec.to_dict()),
              "teacher": {"fingerprint": teacher_fp, **provenance}, "model": prompts.model,
              "template": fingerprint(prompts.template), "source": source_fp}
    return DomainKey(fingerprint(*parts(teacher_fp)), record,
                     lambda: fingerprint(*parts(legacy_teacher_fingerprint(teacher))))


def matches(meta: dict[str, Any], key: DomainKey) -> bool:
    """Whether a finished dataset's domain.json was made with this key (or, before the key had its
    parts, with the same inputs and a teacher without code of the user's)."""
    if meta.get("fingerprint") == key.fingerprint:
        return True
    return "key" not in meta and not key.record["teacher"]["code"] and meta.get("fingerprint") == key.legacy()


def record_key(out_dir: Path, meta: dict[str, Any], key: DomainKey) -> None:
    """Writes the key into a kept dataset's domain.json that lacks it (or has an older form)."""
    if meta.get("key") == key.record and meta.get("fingerprint") == key.fingerprint:
        return
    meta = {**meta, "fingerprint": key.fingerprint, "key": key.record}
    file = Path(out_dir) / DOMAIN_FILE
    tmp = file.with_name(f".{DOMAIN_FILE}.{os.getpid()}")
    try:
        tmp.write_text(json.dumps(meta, indent=2) + "\n")
        tmp.replace(file)
    except OSError:
        pass  # a read-only datasets directory: the dataset is still kept; the next run checks again


def _short(value: Any) -> str:
    text = UNSET if value is UNSET else json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 40 else text[:37] + "..."


def _diff(old: dict, new: dict, skip: tuple = ()) -> str:
    """`key old -> new` for each key whose value differs (an absent one reads as (unset))."""
    keys = sorted((set(old) | set(new)) - set(skip))
    return ", ".join(f"{k} {_short(old.get(k, UNSET))} -> {_short(new.get(k, UNSET))}"
                     for k in keys if old.get(k, UNSET) != new.get(k, UNSET))


def _changed(old: dict, new: dict) -> list[str]:
    return sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))


def _teacher_config(old: Any, new: Any) -> list[str]:
    if old == new:
        return []
    if isinstance(old, dict) and isinstance(new, dict) and old.get("_target_") == new.get("_target_"):
        return [f"the teacher's arguments changed ({_diff(old, new)})"]
    shown = [t.get("_target_") if isinstance(t, dict) else t for t in (old, new)]
    return [f"the teacher changed ({shown[0]} -> {shown[1]})"]


def rebuild_reasons(meta: dict[str, Any], key: DomainKey) -> list[str]:
    """Why a finished dataset (its domain.json `meta`) is not what `key` asks for, in words."""
    new = key.record
    old = meta.get("key")
    if not isinstance(old, dict):
        code = ", ".join(new["teacher"]["code"])
        return ["the dataset was made before its key covered the teacher's code and checkpoints"
                + (f" ({code})" if code else "")]
    reasons = []
    if old.get("version") != new["version"]:
        reasons.append(f"the dataset format changed (version {old.get('version')} -> {new['version']})")
    old_cfg, new_cfg = old.get("config") or {}, new["config"]
    teacher_cfg = _teacher_config(old_cfg.get("teacher"), new_cfg.get("teacher"))
    reasons += teacher_cfg
    other = _diff(old_cfg, new_cfg, skip=("teacher",))
    if other:
        reasons.append(f"the domain's config changed ({other})")
    old_t, new_t = old.get("teacher") or {}, new["teacher"]
    code = _changed(old_t.get("code") or {}, new_t["code"])
    if code:
        reasons.append(f"the teacher's code changed ({', '.join(code)})")
    checkpoints = _changed(old_t.get("checkpoints") or {}, new_t["checkpoints"])
    if checkpoints:
        reasons.append(f"the teacher's checkpoint changed ({', '.join(checkpoints)})")
    if not (teacher_cfg or code or checkpoints) and old_t.get("fingerprint") != new_t["fingerprint"]:
        reasons.append("the teacher's weights or settings changed")
    if old.get("source") != new["source"]:
        reasons.append("the source's files changed")
    if old.get("model") != new["model"]:
        reasons.append(f"the model changed ({old.get('model')} -> {new['model']})")
    elif old.get("template") != new["template"]:
        reasons.append("the model's chat template changed")
    return reasons or ["its cache key changed"]


__all__ = ["DomainKey", "FileHashes", "domain_key", "matches", "record_key", "rebuild_reasons"]
