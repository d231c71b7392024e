"""The service's adapter methods: list, load and unload, each as the connection's tenant may
(serve.rpc.ownership). A tenant loads only from its own folder under the adapter root
(`<rpc.adapter_root>/<tenant>/...`), so it cannot read another tenant's weights by path either; the
operator loads from anywhere under the root. No reply names a server path."""

from __future__ import annotations

import re
from operator import methodcaller
from pathlib import Path

from . import ownership
from .replies import guarded, reply
from .wire import RequestError

# a path in an error the engine raised: scrubbed before it reaches a client (load errors quote the
# directory they read, "already loaded (from /path)" quoted another tenant's)
_ABSOLUTE_PATH = re.compile(r"(?<![\w.])/[^\s'\"),:]+")


def scrub(message: str, *known: tuple[str, str]) -> str:
    """`message` with each known (server path, client's name for it) replaced, in its str and repr
    forms, and any other absolute path replaced by `<path>`."""
    for server_path, shown in known:
        for form in (server_path, repr(server_path)[1:-1]):
            message = message.replace(form, shown)
    return _ABSOLUTE_PATH.sub("<path>", message)


class AdapterCalls:
    """Mixed into VLoRAService: needs `self.state` (ServerState) and `self._who()`."""

    @guarded
    def exposed_list_adapters(self):
        """The adapters this token may use: its own and the shared ones (the operator: all), without paths."""
        tenant = self._who()
        engine = self.state.loop.engine
        entries = self.state.loop.call(methodcaller("list_adapters")) if hasattr(engine, "list_adapters") else []
        return reply(adapters=ownership.visible(tenant, entries))

    @guarded
    def exposed_load_adapter(self, name, path):
        """Loads the adapter directory `path` (relative to the tenant's folder under the server's adapter
        root; the operator's: the root) as `name`."""
        tenant = self._who()
        if type(path) is not str:
            raise RequestError("bad_argument", "load_adapter takes a name and a directory path under the server's "
                                               "adapter root (strings)")
        target = ownership.engine_name(tenant, name)
        if not hasattr(self.state.loop.engine, "load_adapter"):
            raise RequestError("unsupported", "this engine serves the base model only; it cannot load adapters")
        directory, root = self._under_root(path, tenant)
        loaded = self.state.loaded_adapters(refresh=True)
        if target in loaded:
            raise RequestError("rejected", f"adapter {name!r} is already loaded; unload it first to replace it")
        if not tenant.operator:
            if name in loaded:
                raise RequestError("rejected", f"a shared adapter is named {name!r}; load yours under another name")
            if ownership.owned(tenant, loaded) >= tenant.quotas.adapters:
                raise RequestError("too_many_adapters", f"this tenant has {tenant.quotas.adapters} adapters loaded, "
                                                        "its limit; unload one first")
        try:
            self.state.loop.call(methodcaller("load_adapter", target, str(directory)))
        except (OSError, ValueError) as e:  # name what the caller gave, never the server's own paths
            raise RequestError("rejected", scrub(str(e).replace(target, name), (str(directory), path),
                                                 (str(root), "<adapter root>"))) from None
        finally:
            self.state.loaded_adapters(refresh=True)
        return reply(adapter=name)

    def _under_root(self, path: str, tenant) -> tuple[Path, Path]:
        """The directory `path` names under the tenant's root (rpc.adapter_root, and for a tenant its own
        folder there), and that root; a path that would leave it (.., an absolute path elsewhere, a
        symbolic link out) is refused the same way whether it exists or not."""
        root = self.state.limits.adapter_root
        if not root:
            raise RequestError("forbidden", "this server loads no adapters at run time; its operator can allow it "
                                            "from one directory with rpc.adapter_root=<dir>")
        if "\0" in path or len(path) > 4096:
            raise RequestError("bad_argument", "the adapter path must be a plain path of at most 4096 characters")
        base = Path(root).resolve()
        if not tenant.operator:
            base = base / tenant.name
        directory = (base / path).resolve()
        if directory != base and base not in directory.parents:
            raise RequestError("forbidden", "the adapter path must lie under the server's adapter root" +
                               ("" if tenant.operator else ", in this tenant's own folder there"))
        return directory, base

    @guarded
    def exposed_unload_adapter(self, name):
        """Unloads `name`: a tenant its own adapters, the operator any (a tenant's as `name@tenant`)."""
        tenant = self._who()
        if not hasattr(self.state.loop.engine, "unload_adapter"):
            raise RequestError("unsupported", "this engine serves the base model only; it has no adapters to unload")
        target = self.state.with_adapters(lambda loaded: ownership.may_unload(tenant, name, loaded))
        try:
            self.state.loop.call(methodcaller("unload_adapter", target))
        except (ValueError, RuntimeError) as e:  # in use: the caller's to retry, not the server's failure
            raise RequestError("rejected", scrub(str(e).replace(target, name))) from None
        finally:
            self.state.loaded_adapters(refresh=True)
        return reply(adapter=name)
