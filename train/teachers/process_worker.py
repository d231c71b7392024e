"""The worker of a process teacher: runs a user's teacher class in another Python interpreter.

Run as a script by that interpreter (`<python> .../process_worker.py`), never imported there as part
of this project: it needs only the standard library, numpy, and what the user's target imports, so
an environment with OpenCV 4 or an old framework can teach without this project's packages (the
parent side is `train.teachers.process`). Written for Python 3.6 and later.

The frame protocol, over the worker's stdin (requests) and stdout (replies); the teacher's own
prints go to stderr, which the parent keeps the tail of for its errors:

    message   = u32 big-endian header length | header (UTF-8 JSON) | payload
    header    = {"op": ..., "arrays": [{"shape": [H, W, 3], "dtype": "|u1"}, ...], ...}
    payload   = the arrays' raw C-order bytes, one after another, in the order of "arrays"

    parent -> {"op": "hello", "protocol": 1, "target": "mod.Class", "args": {...}}
    worker <- {"op": "ready", "python": "3.8.10", "executable": ..., "numpy": ..., "methods": [...],
               "classes": [...] | null, "labels": [...] | null, "name": ..., "modules": {name: file}}
    parent -> {"op": "call", "method": "detect", "items": [null, null, 8], "arrays": [...]}
              (an item is one frame (null) or a clip of n frames (n); frames in item order)
    worker <- {"op": "result", "results": [...]}     one JSON answer per item
    worker <- {"op": "error", "error": "ValueError: ...", "traceback": "..."}   (to hello or call)
    parent -> {"op": "bye"}                          the worker exits 0
"""
import importlib
import inspect
import json
import os
import struct
import sys
import sysconfig
import traceback

import numpy as np

PROTOCOL = 1
METHODS = ("detect", "count", "classify", "exists", "direction", "__call__")
HEADER = struct.Struct(">I")


def message_parts(header, arrays=()):
    """One message as buffers to write in turn: the length, the header with each array's shape and
    dtype, then each array's bytes (views, not copies: a batch of frames is megabytes)."""
    arrays = [np.ascontiguousarray(a) for a in arrays]
    header = dict(header, arrays=[{"shape": list(a.shape), "dtype": a.dtype.str} for a in arrays])
    head = json.dumps(header).encode("utf-8")
    return [HEADER.pack(len(head)), head] + [memoryview(a.reshape(-1).view(np.uint8)) for a in arrays if a.size]


def pack_message(header, arrays=()):
    """One message as one bytes object."""
    return b"".join(message_parts(header, arrays))


def payload_sizes(header):
    """Bytes of each array the header announces."""
    return [int(np.prod(a["shape"], dtype=np.int64)) * np.dtype(a["dtype"]).itemsize for a in header.get("arrays", [])]


def read_exact(stream, n):
    data = stream.read(n)
    if data is None or len(data) < n:
        raise EOFError("the parent closed the pipe")
    return data


def read_message(stream):
    """(header, arrays) of the next message; arrays are writable (a teacher may draw on a frame)."""
    (size,) = HEADER.unpack(read_exact(stream, HEADER.size))
    header = json.loads(read_exact(stream, size).decode("utf-8"))
    arrays = []
    for spec, nbytes in zip(header.get("arrays", []), payload_sizes(header)):
        buf = bytearray(nbytes)
        stream.readinto_exact(memoryview(buf))
        arrays.append(np.frombuffer(buf, dtype=np.dtype(spec["dtype"])).reshape(spec["shape"]))
    return header, arrays


def jsonable(value):
    """A teacher's answer as JSON: numpy scalars and arrays, tuples and dicts of them."""
    if isinstance(value, (np.generic,)):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    fields = getattr(value, "__dict__", None)  # a small record class (cls, score, box)
    if isinstance(fields, dict) and fields:
        return {k: jsonable(v) for k, v in fields.items() if not k.startswith("_")}
    raise TypeError("an answer of type {} cannot be sent back (use str, int, float, bool, lists, dicts)"
                    .format(type(value).__name__))


def load_target(path, args):
    """The teacher `path` names (`pkg.module.Name` or `pkg.module:Name`), built with `args`."""
    module, sep, attr = path.partition(":")
    if not sep:
        module, _, attr = path.rpartition(".")
    if not module or not attr:
        raise ValueError("target {!r} is not a dotted path (module.Class)".format(path))
    obj = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if inspect.isclass(obj) or args:  # a class, or a factory given arguments
        return obj(**args), module
    return obj, module  # a plain function is the teacher itself


def user_modules(target_module):
    """name -> file of the modules loaded from neither the standard library nor an installed
    package (the user's own code), the target's module always: what the parent's cache key hashes."""
    paths = sysconfig.get_paths()
    roots = [os.path.realpath(paths[k]) for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths]
    me = os.path.realpath(__file__)
    found = {}
    for name, mod in list(sys.modules.items()):
        file = getattr(mod, "__file__", None)
        if not file or not file.endswith(".py"):
            continue
        real = os.path.realpath(file)
        installed = any(real.startswith(r + os.sep) for r in roots) or "site-packages" in real.split(os.sep)
        if name == target_module or not (installed or real == me):
            found[name] = os.path.abspath(file)
    return found


def labels_of(obj, attr):
    value = getattr(obj, attr, None)
    return [str(v) for v in value] if value else None


def call(teacher, header, arrays):
    method = header["method"]
    if method not in METHODS:
        raise ValueError("unknown method {!r}; one of {}".format(method, list(METHODS)))
    fn = teacher if method == "__call__" else getattr(teacher, method)
    results, at = [], 0
    for item in header["items"]:
        if item is None:
            arg, at = arrays[at], at + 1
        else:
            arg, at = list(arrays[at:at + item]), at + item
        results.append(jsonable(fn(arg)))
    return results


def serve(inp, out):
    header, _ = read_message(inp)
    if header.get("op") != "hello" or header.get("protocol") != PROTOCOL:
        raise ValueError("expected hello of protocol {}, got {}".format(PROTOCOL, header))
    try:
        teacher, module = load_target(header["target"], header.get("args") or {})
    except Exception as e:
        out.write(pack_message({"op": "error", "error": "{}: {}".format(type(e).__name__, e),
                                "traceback": traceback.format_exc()}))
        out.flush()
        return 1
    methods = [m for m in METHODS[:-1] if callable(getattr(teacher, m, None))]
    if callable(teacher) and not inspect.isclass(teacher):
        methods.append("__call__")
    name = getattr(teacher, "name", None)
    out.write(pack_message({
        "op": "ready", "protocol": PROTOCOL, "python": ".".join(str(v) for v in sys.version_info[:3]),
        "executable": sys.executable, "prefix": sys.prefix, "numpy": np.__version__, "methods": methods,
        "classes": labels_of(teacher, "classes"), "labels": labels_of(teacher, "labels"),
        "name": name if isinstance(name, str) else None, "modules": user_modules(module)}))
    out.flush()
    while True:
        try:
            header, arrays = read_message(inp)
        except EOFError:
            return 0  # the parent went away: nothing left to answer
        if header.get("op") == "bye":
            return 0
        try:
            reply = {"op": "result", "results": call(teacher, header, arrays)}
        except Exception as e:  # the teacher's own error: reported, and the worker answers the next call
            reply = {"op": "error", "error": "{}: {}".format(type(e).__name__, e), "traceback": traceback.format_exc()}
        out.write(pack_message(reply))
        out.flush()


def main():
    # the script's folder (this project's teachers) must not shadow the user's modules
    here = os.path.dirname(os.path.realpath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.realpath(p or ".") != here]
    # the protocol owns the original stdin / stdout; the teacher's prints (and C libraries') go to stderr
    inp = os.fdopen(os.dup(0), "rb", buffering=0)
    out = os.fdopen(os.dup(1), "wb")
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    inp = _Buffered(inp)
    sys.exit(serve(inp, out))


class _Buffered:
    """read(n) that returns n bytes unless the pipe ends (a raw pipe read may return fewer)."""

    def __init__(self, raw):
        self.raw = raw

    def read(self, n):
        buf = bytearray(n)
        got = self._readinto(memoryview(buf))
        return bytes(buf[:got])

    def readinto_exact(self, view):
        if self._readinto(view) < len(view):
            raise EOFError("the parent closed the pipe")

    def _readinto(self, view):
        got = 0
        while got < len(view):
            k = self.raw.readinto(view[got:])
            if not k:
                break
            got += k
        return got


if __name__ == "__main__":
    main()
