"""What a teacher's answers depend on beyond its config: the user's code and checkpoint files.

Distillation keys a dataset on this (train.distill_key), so editing a plug-in's module (a default
parameter, a helper it imports) or replacing a checkpoint the config names rebuilds the dataset:

    hashes = FileHashes(Path(".vlora/datasets/.work/file-hashes.json"))
    teacher_provenance(teacher, hashes)
    # {"code": {"my_models/people.py": "9f2c...", "my_models/util.py": "41ab..."},
    #  "checkpoints": {"weights/people.pt": "c0de..."}}

Code is the user's own: the module of a plug-in's `_target_` (or an entry point's object, or the
class of what a factory returned), the modules named by dotted-path arguments (`preprocess:
mypkg.features`), and, transitively, what those import from their own folder or package. The
standard library, installed packages and this project's own code are left out (an upgrade of
them does not invalidate every dataset). A checkpoint is a file or directory named by an argument
in FILE_ARGS, any other argument naming an existing file, or the teacher's `weights`; its bytes
are hashed once per (path, size, mtime), so a big checkpoint is not read again on every run.
"""
from __future__ import annotations

import ast
import functools
import hashlib
import json
import os
import sys
import sysconfig
from pathlib import Path
from typing import Any

FILE_ARGS = ("path", "weights", "checkpoint", "model_path")  # arguments naming a file or directory
MAX_CODE_FILES = 200  # a walk of imports that goes further has left the user's own code


class FileHashes:
    """sha256 of files' bytes, remembered in a JSON file by (absolute path, size, mtime_ns)."""

    def __init__(self, cache_file: str | os.PathLike | None = None):
        self.cache_file = Path(cache_file) if cache_file is not None else None
        self.known: dict[str, list] = {}
        self.changed = False
        if self.cache_file is not None and self.cache_file.is_file():
            try:
                self.known = dict(json.loads(self.cache_file.read_text()))
            except (ValueError, TypeError):
                self.known = {}  # a cache cut short: files are hashed again

    def file_digest(self, path: Path) -> str:
        path = Path(path).resolve()
        st = path.stat()
        stamp = [st.st_size, st.st_mtime_ns]
        hit = self.known.get(str(path))
        if hit is not None and hit[:2] == stamp:
            return hit[2]
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
        self.known[str(path)] = [*stamp, h.hexdigest()]
        self.changed = True
        return h.hexdigest()

    def digest(self, path: str | os.PathLike) -> str:
        """Of a file, or of a directory: every file under it with its relative path."""
        path = Path(path)
        if path.is_file():
            return self.file_digest(path)[:16]
        h = hashlib.sha256()
        for f in sorted(p for p in path.rglob("*") if p.is_file()):
            h.update(f"{f.relative_to(path).as_posix()}:{self.file_digest(f)}\n".encode())
        return h.hexdigest()[:16]

    def save(self) -> None:
        if self.cache_file is None or not self.changed:
            return
        tmp = self.cache_file.with_name(f".{self.cache_file.name}.{os.getpid()}")
        try:
            self.cache_file.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps(self.known, sort_keys=True))
            tmp.replace(self.cache_file)  # concurrent runs: the last complete write wins
        except OSError:
            return  # a read-only place: the files are hashed again next time, nothing else changes
        self.changed = False


# ----------------------------------------------------------------------------- the user's code
@functools.lru_cache(maxsize=1)
def _not_user_roots() -> tuple[Path, ...]:
    paths = sysconfig.get_paths()
    return tuple({Path(paths[k]).resolve() for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths})


@functools.lru_cache(maxsize=1)
def _project_packages() -> frozenset[str]:
    """Top-level names of this project's distribution (train, vlora, world, ...)."""
    from importlib.metadata import packages_distributions

    by_name = packages_distributions()
    ours = set(by_name.get(__name__.partition(".")[0], ()))
    return frozenset(top for top, dists in by_name.items() if ours & set(dists)) | {__name__.partition(".")[0]}


def _is_user_file(path: Path, top: str) -> bool:
    if top in _project_packages() or path.suffix != ".py":
        return False
    if {"site-packages", "dist-packages"} & set(path.parts):  # installed, wherever the environment is
        return False
    return not any(path.is_relative_to(root) for root in _not_user_roots())


def _root_of(module_name: str, path: Path) -> Path:
    """The folder a module's dotted name starts from (my_models/people.py -> the folder of my_models)."""
    depth = module_name.count(".") + (1 if path.name == "__init__.py" else 0)
    root = path.parent
    for _ in range(depth):
        root = root.parent
    return root


def _resolve(root: Path, parts: list[str]) -> Path | None:
    if not parts or not all(parts):
        return None
    base = root.joinpath(*parts)
    for f in (base.with_suffix(".py"), base / "__init__.py"):
        if f.is_file():
            return f
    return None


def _imports(path: Path, name: str) -> list[list[str]]:
    """Dotted names (as parts) that module `name` at `path` imports, relative imports resolved."""
    try:
        tree = ast.parse(path.read_bytes(), str(path))
    except (SyntaxError, ValueError):
        return []
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name.split(".") for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - (node.level - 1)] if node.level - 1 <= len(package) else None
                if base is None:
                    continue
            else:
                base = []
            mod = base + (node.module.split(".") if node.module else [])
            out.append(mod)
            out += [mod + [a.name] for a in node.names if a.name != "*"]  # `from pkg import submodule`
    return out


def module_files(module_name: str, file: Path | None = None) -> dict[str, Path]:
    """label (path from the module's root folder) -> file of the user's code behind a module: its
    own file (`file`, else the imported module's), its packages' __init__.py, and what it imports
    from the same folder or package, transitively."""
    if file is None:
        file = getattr(sys.modules.get(module_name), "__file__", None)
    if not file:
        return {}
    path, top = Path(file).resolve(), module_name.partition(".")[0]
    if not _is_user_file(path, top):
        return {}
    root = _root_of(module_name, path)
    parts = module_name.split(".")
    todo = [(parts, path)] + [(parts[:i], f) for i in range(1, len(parts)) if (f := _resolve(root, parts[:i]))]
    found: dict[str, Path] = {}
    while todo and len(found) < MAX_CODE_FILES:
        parts, f = todo.pop()
        label = f.relative_to(root).as_posix()
        if label in found or not _is_user_file(f, parts[0]):
            continue
        found[label] = f
        for imported in _imports(f, ".".join(parts)):
            target = _resolve(root, imported)
            if target is not None:
                todo.append((imported, target))
    return found


def locate_module(dotted: Any) -> tuple[str, Path] | None:
    """(module name, file) a dotted path (`pkg.mod.Name`, `pkg.mod:Name`) points into: an imported
    module, else a file on sys.path, found without importing it (a teacher run by another
    interpreter is not imported here)."""
    if not isinstance(dotted, str) or "/" in dotted or os.sep in dotted:
        return None
    module, sep, _ = dotted.partition(":")
    parts = module.split(".") if sep else dotted.split(".")[:-1]
    if not parts or not all(p.isidentifier() for p in parts):
        return None
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        file = getattr(sys.modules.get(name), "__file__", None)
        if file:
            return name, Path(file)
        if name in sys.modules:
            return None  # a namespace or built-in module: no file of its own
        for entry in sys.path:
            f = _resolve(Path(entry or "."), parts[:i])
            if f is not None:
                return name, f
    return None


def code_modules(teacher) -> dict[str, Path]:
    """module name -> file of the modules holding a teacher's own code: its `_target_` or entry
    point object, the class of the object it wraps, and modules named by dotted-path arguments."""
    spec = getattr(teacher, "spec", None)
    if not isinstance(spec, dict):
        return {}
    found = [locate_module(v) for v in spec.values()]
    wrapped = getattr(teacher, "obj", None)
    if wrapped is not None:
        found.append(locate_module(f"{getattr(wrapped, '__module__', None) or type(wrapped).__module__}.x"))
    return dict(sorted(m for m in found if m is not None))


def checkpoint_paths(teacher) -> list[str]:
    """Files and directories a teacher's answers are read from, as its config names them."""
    spec = getattr(teacher, "spec", None)
    found = []
    args = getattr(teacher, "arguments", None)  # a process teacher: its target's arguments, not its interpreter
    spec = args if isinstance(args, dict) else spec
    if isinstance(spec, dict):
        for key, value in spec.items():
            if not isinstance(value, (str, os.PathLike)) or key in ("_target_", "object", "entry_point"):
                continue
            if (key in FILE_ARGS and Path(value).exists()) or Path(value).is_file():
                found.append(str(value))
    weights = getattr(teacher, "weights", None)
    if isinstance(weights, (str, os.PathLike)) and Path(weights).exists() and str(weights) not in found:
        found.append(str(weights))
    return found


def teacher_provenance(teacher, hashes: FileHashes | None = None) -> dict[str, dict[str, str]]:
    """{"code": {label: digest}, "checkpoints": {path: digest}} of a teacher (see the docstring)."""
    hashes = hashes or FileHashes()
    code: dict[str, str] = {}
    # a teacher run by another interpreter names the files that interpreter loaded (process.py)
    files = teacher.code_files() if callable(getattr(teacher, "code_files", None)) else {
        label: f for name, file in code_modules(teacher).items() for label, f in module_files(name, file).items()}
    for label, f in files.items():
        code[label] = hashlib.sha256(f.read_bytes()).hexdigest()[:16]  # source: small, read each run
    return {"code": dict(sorted(code.items())),
            "checkpoints": {p: hashes.digest(p) for p in checkpoint_paths(teacher)}}


def update_with_model(h, teacher) -> None:
    """Feeds the parameters of a model the teacher holds (a fitted estimator, a torch module) to `h`."""
    for attr in ("estimator", "module"):
        obj = getattr(teacher, attr, None)
        if obj is None:
            continue
        if hasattr(obj, "state_dict"):
            import torch

            h.update(b"".join(t.detach().cpu().numpy().tobytes() for t in obj.state_dict().values()
                              if isinstance(t, torch.Tensor)))
        else:
            import pickle

            h.update(pickle.dumps(obj))


def legacy_teacher_fingerprint(teacher) -> str:
    """The teacher fingerprint as it was before code and cached checkpoint hashes were covered
    (every checkpoint byte fed to one hash). Only to recognise a dataset distilled then."""
    h = hashlib.sha256(repr(sorted(teacher.describe().items())).encode())
    spec = getattr(teacher, "spec", None)
    if spec is not None:
        h.update(json.dumps(spec, sort_keys=True, default=str).encode())
    files = [getattr(teacher, "weights", None)] + [spec.get(k) for k in FILE_ARGS if isinstance(spec, dict)]
    for path in files:
        if isinstance(path, (str, Path)) and Path(path).exists():
            for f in ([Path(path)] if Path(path).is_file() else sorted(p for p in Path(path).rglob("*") if p.is_file())):
                h.update(f.read_bytes())
    update_with_model(h, teacher)
    return h.hexdigest()[:16]


__all__ = ["FileHashes", "teacher_provenance", "module_files", "locate_module", "code_modules", "checkpoint_paths",
           "FILE_ARGS",
           "update_with_model", "legacy_teacher_fingerprint"]
