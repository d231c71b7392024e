"""Which adapters a tenant sees, uses and may unload.

The engine knows one flat set of adapter names. Ownership is written into the name, so it cannot
drift from what the engine holds: an adapter a tenant loads as `plates` is `plates@traffic` in the
engine (wire names never contain `@`, so no tenant can spell another's, and two tenants may both
have a `plates`); a name without `@` is *shared*: loaded at start, or at run time by the operator.

- a tenant sees and uses its own adapters (by the name it gave) and the shared ones, loads only
  into its own names, and unloads or replaces only its own;
- the operator sees every adapter (a tenant's as `name@tenant`), loads shared ones and may unload
  any;
- no list or reply carries a server path.
"""

from __future__ import annotations

from typing import Any

from .tenants import TENANT_NAME, Tenant
from .wire import ADAPTER_NAME, RequestError, check_adapter_name

SEP = "@"
# what list_adapters shows of an adapter: its shape and state, never where it was read from
LISTED = ("rank", "ranks", "targets", "layers", "bytes", "heads", "tasks", "pinned", "resident", "merged", "in_host_cache",
          "running", "swaps", "version")


def owner_of(engine_name: str) -> str | None:
    """The tenant owning an engine adapter name; None for a shared adapter."""
    return engine_name.rsplit(SEP, 1)[1] if SEP in engine_name else None


def engine_name(tenant: Tenant, name: str) -> str:
    """The engine's name for adapter `name` as `tenant` loads it (the operator's loads are shared)."""
    check_adapter_name(name)
    return name if tenant.operator else f"{name}{SEP}{tenant.name}"


def shown_name(tenant: Tenant, engine: str) -> str:
    """How `tenant` sees the engine adapter `engine` (its own without the suffix)."""
    return engine[: -len(SEP + tenant.name)] if owner_of(engine) == tenant.name and not tenant.operator else engine


def check_operator_name(name: Any) -> str:
    """The operator may also name a tenant's adapter as `name@tenant` (to unload it)."""
    if type(name) is str and SEP in name:
        base, _, owner = name.rpartition(SEP)
        if ADAPTER_NAME.fullmatch(base) and TENANT_NAME.fullmatch(owner):
            return name
    return check_adapter_name(name)


def resolve(tenant: Tenant, name: str, loaded) -> str:
    """The engine adapter a request of `tenant` naming `name` runs on: its own first, then a shared
    one. `loaded`: the engine's adapter names. Unknown (or another tenant's) is one error."""
    if tenant.operator:
        if name in loaded:
            return name
    else:
        own = f"{name}{SEP}{tenant.name}"
        if own in loaded:
            return own
        if name in loaded and owner_of(name) is None:
            return name
    raise RequestError("unknown_adapter", f"no adapter {name!r} is available to this token: list_adapters() shows "
                                          "yours and the shared ones; adapter=None runs the base model")


def may_unload(tenant: Tenant, name: str, loaded) -> str:
    """The engine name `tenant` may unload as `name`, or RequestError (unknown, or not its own)."""
    if tenant.operator:
        check_operator_name(name)
        if name in loaded:
            return name
        raise RequestError("unknown_adapter", f"no adapter {name!r} is loaded")
    check_adapter_name(name)
    own = f"{name}{SEP}{tenant.name}"
    if own in loaded:
        return own
    if name in loaded and owner_of(name) is None:
        raise RequestError("forbidden", f"adapter {name!r} is shared by the operator; only the operator unloads it")
    raise RequestError("unknown_adapter", f"no adapter {name!r} of this token is loaded")


def owned(tenant: Tenant, loaded) -> int:
    return sum(owner_of(n) == tenant.name for n in loaded)


def visible(tenant: Tenant, entries: list[dict]) -> list[dict]:
    """The engine's list_adapters entries `tenant` may see, renamed for it, without paths."""
    out = []
    for entry in entries:
        name = entry.get("name")
        owner = owner_of(name) if isinstance(name, str) else None
        if not tenant.operator and owner not in (None, tenant.name):
            continue
        shown = {"name": shown_name(tenant, name), "owner": owner or "shared"}
        shown.update({k: entry[k] for k in LISTED if k in entry})
        out.append(shown)
    return out
