"""Who may use the server: tenants, their roles, tokens and quotas.

One server is shared by teams. Each team is a *tenant* with its own token; the *operator* runs the
server. An operator-managed file (YAML or JSON) or a directory of them (one tenant a file, named
after it) maps tenant names to the SHA-256 of their token, a role and optional quotas:

    tenants:
      ops:     {role: operator, token_sha256: 9f86d0...}
      traffic: {role: tenant,   token_sha256: 60303a..., quotas: {adapters: 4, queued: 64}}
    quotas: {connections: 8}          # defaults for every tenant (each key optional)

`vlora tenants add FILE NAME` writes an entry and prints its new token once; the file never holds
a token itself. The server re-reads the file when it changes (checked at most once a second on a
new connection or call): a tenant removed, or given a new token, loses its open connections at
their next call. A file that does not parse keeps the previous tenants and says why in the log.
Without a file, the one token of `VLORA_TOKEN` / `rpc.token` is the operator (a single-tenant
server, as before tenants existed).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import threading
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

log = logging.getLogger("vlora.serve.rpc")

ROLES = ("operator", "tenant")
TENANT_NAME = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}")
SINGLE_TENANT = "operator"  # the name of the single token's holder
RELOAD_CHECK_S = 1.0


@dataclass(frozen=True)
class Quotas:
    """What one tenant may hold at once, over all of its connections."""

    adapters: int = 16  # adapters it loaded itself (shared ones do not count)
    queued: int = 256  # requests submitted and not finished (waiting or running)
    in_flight: int = 64  # requests running in the engine's batch at once
    pixels: int = 1 << 27  # decoded frame pixels of its requests held by the server
    connections: int = 16  # RPyC connections; on the HTTP port, apart, requests in progress at once

    @classmethod
    def sole(cls) -> "Quotas":
        """The single token's: its holder shares the server with nobody, so what bounds it is the
        server's own limits (max_connections, max_pixels_in_flight, the per-connection queues), not
        a tenant's share of them (16 connections refused the 17th camera of a one-team server)."""
        return cls(queued=1 << 40, in_flight=1 << 40, pixels=1 << 40, connections=1 << 40)

    @classmethod
    def parse(cls, raw: Any, where: str, base: "Quotas | None" = None) -> "Quotas":
        base = base or cls()
        if raw is None:
            return base
        if not isinstance(raw, dict):
            raise ValueError(f"{where}: quotas must be a mapping of {[f.name for f in fields(cls)]} to integers")
        known = {f.name for f in fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"{where}: unknown quota {sorted(unknown)[0]!r}; known: {sorted(known)}")
        for key, value in raw.items():
            if type(value) is not int or not 1 <= value <= 1 << 40:
                raise ValueError(f"{where}: quota {key!r} must be an integer in [1, 2^40], got {value!r}")
        return replace(base, **raw)


@dataclass(frozen=True)
class Tenant:
    name: str
    role: str
    token_sha256: str = field(repr=False)
    quotas: Quotas = Quotas()
    weight: float = 1.0  # its share of the engine's tokens against other tenants' (fair admission)

    @property
    def operator(self) -> bool:
        return self.role == "operator"


def token_hash(token: str | bytes) -> str:
    return hashlib.sha256(token if isinstance(token, bytes) else token.encode()).hexdigest()


def check_token(token: Any, what: str = "the server token") -> str:
    if not isinstance(token, str) or len(token) < 8 or len(token.encode()) > 1000:
        raise ValueError(f"{what} must be a string of 8 to ~1000 characters "
                         "(set rpc.token or the VLORA_TOKEN environment variable, or rpc.tenants=<file>)")
    return token


def _tenant(name: Any, raw: Any, default_quotas: Quotas, where: str) -> Tenant:
    if not isinstance(name, str) or not TENANT_NAME.fullmatch(name):
        raise ValueError(f"{where}: tenant name {name!r} must be 1-64 lower-case letters, digits, '_' or '-'")
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: tenant {name!r} must be a mapping with role and token_sha256")
    unknown = set(raw) - {"role", "token_sha256", "quotas", "weight"}
    if unknown:
        raise ValueError(f"{where}: tenant {name!r} has unknown key {sorted(unknown)[0]!r} "
                         "(role, token_sha256, quotas, weight)")
    role, digest = raw.get("role", "tenant"), raw.get("token_sha256")
    if role not in ROLES:
        raise ValueError(f"{where}: tenant {name!r} has role {role!r}; roles are {ROLES}")
    if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise ValueError(f"{where}: tenant {name!r} needs token_sha256, 64 lower-case hex digits "
                         "(`vlora tenants add` writes it)")
    weight = raw.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0.01 <= weight <= 100:
        raise ValueError(f"{where}: tenant {name!r} weight must be a number in [0.01, 100], got {weight!r}")
    quotas = Quotas.parse(raw.get("quotas"), f"{where}: tenant {name!r}", default_quotas)
    return Tenant(name, role, digest, quotas, float(weight))


def _read_document(path: Path) -> Any:
    import yaml  # comes with omegaconf

    text = path.read_text()
    try:
        return json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as e:  # a file being edited by hand: say where, keep the old tenants
        raise ValueError(f"{path}: not valid {'JSON' if path.suffix == '.json' else 'YAML'} "
                         f"({' '.join(str(e).split())[:200]})") from None


def parse_tenants(path: str | Path) -> dict[str, Tenant]:
    """The tenants of a file (`tenants:` and default `quotas:`) or a directory (NAME.yaml / NAME.json,
    each one tenant's mapping; an optional `_defaults.yaml` holds `quotas:`). Raises ValueError naming
    the file and what is wrong."""
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix in (".yaml", ".yml", ".json"))
        defaults = next((p for p in files if p.stem == "_defaults"), None)
        quotas = Quotas.parse((_read_document(defaults) or {}).get("quotas"), str(defaults)) if defaults else Quotas()
        entries = [(p.stem, _read_document(p), str(p)) for p in files if p.stem != "_defaults"]
    elif path.is_file():
        doc = _read_document(path) or {}
        if not isinstance(doc, dict) or not isinstance(doc.get("tenants"), dict):
            raise ValueError(f"{path}: needs a mapping `tenants: {{name: {{role, token_sha256}}}}`")
        unknown = set(doc) - {"tenants", "quotas"}
        if unknown:
            raise ValueError(f"{path}: unknown top-level key {sorted(unknown)[0]!r} (tenants, quotas)")
        quotas = Quotas.parse(doc.get("quotas"), str(path))
        entries = [(name, raw, str(path)) for name, raw in doc["tenants"].items()]
    else:
        raise ValueError(f"tenants file {path} does not exist")
    tenants: dict[str, Tenant] = {}
    seen: dict[str, str] = {}
    for name, raw, where in entries:
        tenant = _tenant(name, raw, quotas, where)
        if tenant.token_sha256 in seen:
            raise ValueError(f"{where}: tenants {seen[tenant.token_sha256]!r} and {name!r} share one token")
        seen[tenant.token_sha256] = name
        tenants[name] = tenant
    if not tenants:
        raise ValueError(f"{path}: no tenants")
    return tenants


def sole_operator(token_sha256: str = "") -> Tenant:
    """The single token's holder (or, on a server built without the token check, whoever connects):
    the operator, bounded by the server's limits alone (Quotas.sole)."""
    return Tenant(SINGLE_TENANT, "operator", token_sha256, Quotas.sole())


class TenantRegistry:
    """token -> Tenant, from one token or from a tenants file (reloaded when it changes)."""

    def __init__(self, tenants: dict[str, Tenant], path: Path | None = None):
        self._tenants = tenants
        self._by_hash = {t.token_sha256: t for t in tenants.values()}
        self.path = path
        self._stamp = self._file_stamp() if path is not None else None
        self._checked = time.monotonic()
        self._lock = threading.Lock()
        self.reloads = 0

    @classmethod
    def single(cls, token: str) -> "TenantRegistry":
        check_token(token)
        return cls({SINGLE_TENANT: sole_operator(token_hash(token))})

    @classmethod
    def from_file(cls, path: str | Path) -> "TenantRegistry":
        path = Path(path).resolve()
        return cls(parse_tenants(path), path)

    def _file_stamp(self) -> tuple:
        """Changes whenever the file (or a file of the directory) is written, renamed or removed."""
        try:
            if self.path.is_dir():
                return tuple(sorted((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in self.path.iterdir()))
            st = self.path.stat()
            return (st.st_mtime_ns, st.st_size, st.st_ino)
        except OSError:
            return ()

    def refresh(self, force: bool = False) -> None:
        if self.path is None:
            return
        now = time.monotonic()
        if not force and now - self._checked < RELOAD_CHECK_S:
            return
        with self._lock:
            self._checked = now
            stamp = self._file_stamp()
            if stamp == self._stamp and not force:
                return
            self._stamp = stamp
            try:
                tenants = parse_tenants(self.path)
            except (OSError, ValueError) as e:
                log.error("tenants file not reloaded, the previous tenants stay: %s", e)
                return
            self._tenants, self._by_hash = tenants, {t.token_sha256: t for t in tenants.values()}
            self.reloads += 1
            log.warning("tenants reloaded from %s: %d tenant(s)", self.path.name, len(tenants))

    def identify(self, token: bytes) -> Tenant | None:
        """The tenant holding `token`, or None. The comparison is of SHA-256 digests in constant time."""
        self.refresh()
        digest = token_hash(token)
        tenant = self._by_hash.get(digest)
        if tenant is None or not hmac.compare_digest(tenant.token_sha256, digest):
            return None
        return tenant

    def current(self, tenant: Tenant) -> Tenant | None:
        """`tenant` as the registry knows it now (new quotas), or None when it was removed or its token changed."""
        self.refresh()
        now = self._tenants.get(tenant.name)
        return now if now is not None and now.token_sha256 == tenant.token_sha256 else None

    def names(self) -> list[str]:
        return sorted(self._tenants)

    def members(self) -> list[Tenant]:
        return [self._tenants[n] for n in sorted(self._tenants)]


def add_tenant(path: str | Path, name: str, role: str = "tenant", quotas: dict | None = None) -> str:
    """Adds (or gives a new token to) tenant `name` in the tenants file `path`; returns the new token.
    The file is replaced atomically, so a running server never reads half of it."""
    import yaml

    path = Path(path)
    doc = (_read_document(path) or {}) if path.exists() else {}
    doc.setdefault("tenants", {})
    token = "vlora-" + secrets.token_urlsafe(32)
    entry = {"role": role, "token_sha256": token_hash(token)}
    if quotas:
        entry["quotas"] = dict(quotas)
    _tenant(name, entry, Quotas(), str(path))  # the same checks as the server's
    doc["tenants"][name] = entry
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=2) if path.suffix == ".json" else yaml.safe_dump(doc, sort_keys=False))
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
    return token
