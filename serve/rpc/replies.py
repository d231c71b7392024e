"""What every exposed method of the service answers: one JSON string, `{"ok": true, ...}` or
`{"ok": false, "error": {...}}`, and the guard that turns any failure into such an error for the
calling client alone, without touching client objects or echoing internals."""

from __future__ import annotations

import inspect
import json
import logging

from .logs import clip
from .wire import RequestError

log = logging.getLogger("vlora.serve.rpc")


def reply(**fields) -> str:
    return json.dumps({"ok": True, **fields})


def error(kind: str, message: str) -> str:
    return json.dumps({"ok": False, "error": {"type": kind, "message": message}})


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

    def wrapper(self, *args, **kwargs):
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

    wrapper.__name__ = method.__name__
    wrapper.__doc__ = method.__doc__
    wrapper.__wrapped__ = method
    return wrapper
