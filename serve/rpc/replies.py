"""What every exposed method of the service answers: one JSON string, `{"ok": true, ...}` or
`{"ok": false, "error": {...}}`, and the guard that turns any failure into such an error for the
calling client alone, without touching client objects or echoing internals.

No reply is larger than MAX_REPLY_BYTES whatever the request: an error's message is clipped to
MAX_ERROR_CHARS characters (a message that quotes a client's 63 MB argument would otherwise send it
back whole), a list in a reply (events, adapters) is cut to what fits and the reply says how many
items were left out (`"truncated": {field: count}`), and any other reply over the bound is refused.
"""

from __future__ import annotations

import inspect
import json
import logging

from .gate import GATE
from .logs import clip
from .wire import RequestError

log = logging.getLogger("vlora.serve.rpc")
# JSON is written ASCII-only (json.dumps' default), so characters and bytes of a reply are one.
# 4 MiB: a poll's events of a 1,024-token request take some 0.4 MB at worst (each token twice,
# as its delta and in the final text, every character escaped)
MAX_REPLY_BYTES = 4 << 20
MAX_ERROR_CHARS = 512  # of an error's message; its type is one of the server's own short names
MAX_KIND_CHARS = 64


def reply(**fields) -> str:
    text = json.dumps({"ok": True, **fields})
    if len(text) <= MAX_REPLY_BYTES:
        return text
    lists = [k for k, v in fields.items() if isinstance(v, (list, tuple))]
    rest = {k: v for k, v in fields.items() if k not in lists}
    # the frame of the reply with every list empty and the largest count of left-out items it could say
    room = MAX_REPLY_BYTES - len(json.dumps({"ok": True, **rest, **{k: [] for k in lists},
                                             "truncated": {k: 10**12 for k in lists}}))
    if room < 0:
        log.warning("a reply of %d bytes (fields %s) is over the bound of %d bytes", len(text), sorted(fields),
                    MAX_REPLY_BYTES)
        return error("too_large", f"the reply of {len(text)} bytes is over the server's bound of {MAX_REPLY_BYTES} "
                                  "bytes")
    kept: dict[str, list] = {}
    for k in lists:
        kept[k] = []
        for item in fields[k]:
            size = len(json.dumps(item)) + 2  # with its ", "
            if size > room:
                break
            room -= size
            kept[k].append(item)
    truncated = {k: len(fields[k]) - len(kept[k]) for k in lists if len(kept[k]) < len(fields[k])}
    return json.dumps({"ok": True, **rest, **kept, "truncated": truncated})


def error(kind: str, message: str) -> str:
    return json.dumps({"ok": False, "error": {"type": clip(str(kind), MAX_KIND_CHARS),
                                              "message": clip(str(message), MAX_ERROR_CHARS)}})


def _plain(value, depth: int = 0) -> bool:
    """A value the server may touch: bytes, str, numbers, None, or tuples of them. Anything else
    arrives as a reference to the client's object, and reading it (repr, ==, len) would run the
    client's code: such arguments are refused by their type alone."""
    if type(value) in (str, bytes, int, float, bool, type(None)):
        return True
    return type(value) is tuple and depth < 2 and all(_plain(v, depth + 1) for v in value)


def _signature(method) -> str:
    params = list(inspect.signature(method).parameters.values())[1:]  # without self
    return f"{method.__name__[len('exposed_'):]}({', '.join(p.name for p in params)})"


def guarded(method):
    """Turn any failure into an error reply for this client alone. Replies name the method and what
    was wrong, never the server's internals (reprs, exception text) or the client's arguments."""

    def checked(self, args, kwargs):
        if kwargs or not all(_plain(a) for a in args):
            self.state.count("errors_bad_argument")
            return error("bad_argument", f"{_signature(method)} takes plain values (str, bytes, numbers, tuples) "
                                          "by position; references to client objects are refused")
        try:
            return method(self, *args)
        except RequestError as e:
            self.state.count(f"errors_{e.kind}")
            return error(e.kind, str(e))
        except TypeError:  # wrong number of arguments and the like
            self.state.count("errors_bad_argument")
            return error("bad_argument", f"wrong arguments; the call is {_signature(method)}")
        except Exception as e:
            incident = f"{self.conn_id}-{next(self.state.ids)}"
            log.error("internal error %s in %s: %s", incident, method.__name__, clip(f"{type(e).__name__}: {e}"),
                      exc_info=True)
            self.state.count("errors_internal")
            return error("internal", f"the server failed on this call (incident {incident}, in its log)")

    def wrapper(self, *args, **kwargs):
        # connection threads take turns with the engine's, tenants with each other (serve/rpc/gate.py)
        tenant = getattr(self, "tenant", None)
        with GATE.call(self.conn_id, getattr(tenant, "name", None), getattr(tenant, "weight", 1.0)):
            return checked(self, args, kwargs)

    wrapper.__name__ = method.__name__
    wrapper.__doc__ = method.__doc__
    wrapper.__wrapped__ = method
    return wrapper
