"""The serving evaluation's traces, kept as the seeded specs that generate them.

A trace is a pure function of its WorkloadSpec (serve.orchestrator.generate is seeded), so a
results folder keeps one small `traces.json` instead of a JSONL file per point: per trace file
name, its spec, its request count and the sha256 of the file `write_trace` writes. Rebuilding
checks the digest, so a generator that drifted (a new numpy, a changed sampler) says so instead
of replaying a different workload.
    python -m bench.serving_traces results/serving/nvidia_h200/traces.json --out /tmp/traces
writes every trace file of that folder (for `vlora simulate trace=...`); `--name` picks one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
from dataclasses import asdict
from pathlib import Path

from serve.orchestrator import AppSpec, WorkloadSpec, generate, write_trace

INDEX = "traces.json"


def spec_of(values: dict) -> WorkloadSpec:
    """A WorkloadSpec from its asdict() form (apps as dicts, ranges as lists)."""
    values = dict(values)
    apps = tuple(AppSpec(**a) for a in values.pop("apps"))
    return WorkloadSpec(**values, apps=apps)


def write_one(path: Path, spec: WorkloadSpec) -> dict:
    """Writes the trace of `spec` to `path`; returns its index entry."""
    trace = generate(spec)
    write_trace(path, trace, spec)
    return {"spec": asdict(spec), "requests": len(trace), "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def record(out_dir: Path, name: str, spec: WorkloadSpec) -> dict:
    """Adds trace `name` of `spec` to out_dir/traces.json (rewritten whole, so a run stopped
    midway keeps the traces of the points it finished); returns its entry."""
    index_path = Path(out_dir) / INDEX
    index = json.loads(index_path.read_text()) if index_path.is_file() else {}
    with tempfile.TemporaryDirectory() as tmp:
        index[name] = write_one(Path(tmp) / name, spec)
    index_path.parent.mkdir(parents=True, exist_ok=True)
    lines = [f" {json.dumps(k)}: {json.dumps(index[k], sort_keys=True)}" for k in sorted(index)]  # a trace a line
    index_path.write_text("{\n" + ",\n".join(lines) + "\n}\n")
    return index[name]


def rebuild(index_path: str | Path, name: str, out_dir: str | Path) -> Path:
    """Writes trace `name` of the index to out_dir/name, byte for byte the file the run replayed."""
    index_path = Path(index_path)
    index = json.loads(index_path.read_text())
    if name not in index:
        raise ValueError(f"{index_path}: no trace {name!r}; it has {sorted(index)}")
    entry = index[name]
    path = Path(out_dir) / name
    got = write_one(path, spec_of(entry["spec"]))
    if got["sha256"] != entry["sha256"]:
        raise ValueError(f"{index_path}: trace {name!r} regenerated {got['requests']} requests with sha256 "
                         f"{got['sha256'][:12]}, the run replayed {entry['requests']} with {entry['sha256'][:12]}: "
                         "the workload generator changed since that run")
    return path


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.serving_traces", description=__doc__.split("\n")[0])
    ap.add_argument("index", help=f"a results folder's {INDEX}")
    ap.add_argument("--out", required=True, help="folder to write the trace files into")
    ap.add_argument("--name", action="append", help="a trace file name of the index (default: all)")
    args = ap.parse_args(argv)
    names = args.name or sorted(json.loads(Path(args.index).read_text()))
    for name in names:
        try:
            print(rebuild(args.index, name, args.out))
        except ValueError as e:
            raise SystemExit(str(e)) from None


if __name__ == "__main__":
    main()
