"""Lazy package faces (PEP 562): a package names its public API without importing it.

`from serve.rpc import Client` must not load the engine (torch, triton, transformers) for an
application that only talks to a server, and the torch-free parts (scheduler, block manager,
orchestrator) must import without the rest. A face built here imports a name's module the first
time the name is read.
"""

from __future__ import annotations

import importlib
import sys


def lazy_face(package: str, exports: dict[str, str]):
    """(__getattr__, __dir__) for `package`'s __init__: exports maps each public name to the module
    (relative to the package, e.g. ".engine") that defines it."""
    def __getattr__(name: str):
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module, package), name)
        setattr(sys.modules[package], name, value)  # later reads skip this hook
        return value

    def __dir__():
        return sorted(set(exports) | set(vars(sys.modules[package])))

    return __getattr__, __dir__
