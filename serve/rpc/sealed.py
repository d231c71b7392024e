"""RPyC's connection with its introspection closed: a client learns the exposed method names, nothing else.

RPyC's restricted mode still answers questions about the objects it hands out: `repr(conn.root)`
named the service's class, module and memory address, `dir(conn.root)` and HANDLE_INSPECT listed
every internal method (with docstrings), every reference carried an id pack of the class's
dotted name and two addresses, `hash()` gave an address away, and the safe-attribute list let
`conn.root.__doc__`, `__repr__`, `__new__`... through. Here, request by request:

- references carry opaque id packs (a neutral name and a per-connection counter);
- GETATTR / CALLATTR reach only the service's own exposed methods (`poll` or `exposed_poll`);
  no underscore name, no attribute of anything else; a client holds at most MAX_REFERENCES
  method references at once (RPyC kept every one until the client released it);
- CALL runs only such an exposed method; DIR and INSPECT list only exposed names (no docstrings);
- REPR / STR answer a fixed text, HASH the opaque id's hash;
- every other request (setattr, delattr, cmp, instancecheck, pickle, iteration, slicing,
  context exit) is refused;
- an exception crosses the wire as a builtin type with a fixed message (the refusals above say
  which name was refused, clipped), so neither a server class nor a client's long argument comes back.
"""

from __future__ import annotations

import itertools
import types

from rpyc.core import brine, consts
from rpyc.core.protocol import Connection
from rpyc.core.service import Service

from .logs import clip

ROOT_NAME = "vlora_service"  # what the client sees as the root's class name: resolves to nothing there
METHOD_NAME = "builtins.method"  # a plain method: the client's built-in proxy class, no INSPECT round trip
MAX_REFERENCES = 1024  # objects a client holds by reference at once (each getattr of a method makes one)
OWN_EXPOSED = frozenset(n for n in dir(Service) if n.startswith("exposed_"))  # RPyC's, not ours
PLAIN_ERRORS = (AttributeError, TypeError, ValueError, KeyError, IndexError, LookupError, RuntimeError,
                TimeoutError, NotImplementedError)


class Refused(AttributeError):
    """A request the sealed connection does not answer."""


class SealedConnection(Connection):
    def __init__(self, root, channel, config):
        self._packs: dict[int, tuple] = {}  # id(obj) -> its opaque id pack, while the peer holds it
        self._pack_ids = itertools.count(1)
        super().__init__(root, channel, config)
        prefix = self._config["exposed_prefix"]
        self._exposed = tuple(sorted(n[len(prefix):] for n in dir(type(root))
                                     if n.startswith(prefix) and n not in OWN_EXPOSED))

    @classmethod
    def _request_handlers(cls):
        handlers = dict.fromkeys(Connection._request_handlers(), cls._handle_refused)
        handlers.update({
            consts.HANDLE_PING: cls._handle_ping, consts.HANDLE_CLOSE: cls._handle_close,
            consts.HANDLE_GETROOT: cls._handle_getroot, consts.HANDLE_DEL: cls._handle_del,
            consts.HANDLE_GETATTR: cls._handle_getattr, consts.HANDLE_CALL: cls._handle_call,
            consts.HANDLE_CALLATTR: cls._handle_callattr, consts.HANDLE_DIR: cls._handle_dir,
            consts.HANDLE_INSPECT: cls._handle_inspect, consts.HANDLE_REPR: cls._handle_repr,
            consts.HANDLE_STR: cls._handle_repr, consts.HANDLE_HASH: cls._handle_hash,
        })
        return handlers

    # ---- opaque references ---------------------------------------------------------------------
    def _box(self, obj):
        if brine.dumpable(obj):
            return consts.LABEL_VALUE, obj
        if type(obj) is tuple:
            return consts.LABEL_TUPLE, tuple(self._box(item) for item in obj)
        pack = self._packs.get(id(obj))  # the object stays alive (in _local_objects) while mapped
        if pack is None:
            name = METHOD_NAME if type(obj) is types.MethodType else ROOT_NAME
            pack = self._packs[id(obj)] = (name, 0, next(self._pack_ids))
        self._local_objects.add(pack, obj)
        return consts.LABEL_REMOTE_REF, pack

    def _handle_del(self, obj, count=1):
        pack = self._packs.get(id(obj))
        if pack is None:
            return
        self._local_objects.decref(pack, count)
        try:
            self._local_objects[pack]
        except KeyError:  # the peer let go of its last reference
            del self._packs[id(obj)]

    # ---- the exposed methods and nothing else ---------------------------------------------------
    def _exposed_name(self, obj, name) -> str:
        if type(name) is bytes:
            name = name.decode("utf-8", "replace")
        prefix = self._config["exposed_prefix"]
        short = name[len(prefix):] if type(name) is str and name.startswith(prefix) else name
        if obj is not self._local_root or type(short) is not str or short not in self._exposed:
            raise Refused(f"no such method: {clip(str(name), 64)!r}")
        return prefix + short

    def _is_exposed_method(self, obj) -> bool:
        # exact types: a proxy of a client object passes no isinstance check here
        return (type(obj) is types.MethodType and obj.__self__ is self._local_root
                and obj.__name__.startswith(self._config["exposed_prefix"])
                and obj.__name__[len(self._config["exposed_prefix"]):] in self._exposed)

    def _handle_getattr(self, obj, name):
        name = self._exposed_name(obj, name)
        if len(self._packs) >= MAX_REFERENCES:  # a client that never lets go must not grow the server
            raise Refused(f"this connection holds {len(self._packs)} references to the server's methods; "
                          "release some (call methods by name) before asking for more")
        return getattr(obj, name)

    def _handle_callattr(self, obj, name, args, kwargs=()):
        return self._handle_call(self._handle_getattr(obj, name), args, kwargs)

    def _handle_call(self, obj, args, kwargs=()):
        if not self._is_exposed_method(obj):
            raise Refused("only the service's methods can be called")
        return obj(*args, **dict(kwargs))

    def _handle_dir(self, obj):
        return self._exposed if obj is self._local_root else ()

    def _handle_inspect(self, id_pack):
        obj = self._local_objects[id_pack]
        return tuple((name, None) for name in self._exposed) if obj is self._local_root else ()

    def _handle_repr(self, obj):
        if obj is self._local_root:
            return "<V-LoRA service>"
        return f"<V-LoRA method {obj.__name__[len(self._config['exposed_prefix']):]}>" \
            if self._is_exposed_method(obj) else "<V-LoRA object>"

    def _handle_hash(self, obj):
        return hash(self._packs.get(id(obj), 0))

    def _handle_refused(self, *args):
        raise Refused("not available over this connection")

    # ---- errors that say nothing of the server ---------------------------------------------------
    def _box_exc(self, typ, val, tb):
        if typ is StopIteration:
            return super()._box_exc(typ, val, tb)
        if isinstance(val, Refused):  # our own words, with at most 64 characters of the client's
            typ, val = AttributeError, AttributeError(clip(str(val), 200))
        else:  # a builtin type's name at most: its text could name a server class or echo an argument
            typ = typ if typ in PLAIN_ERRORS else RuntimeError
            val = typ("the server could not answer that request")
        return super()._box_exc(typ, val, None)
