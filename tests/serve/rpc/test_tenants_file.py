"""The tenants file: what it accepts, what it refuses (naming the file and the fault), how a change is
picked up, and the `vlora tenants` command that writes it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from serve.rpc.tenants import TenantRegistry, add_tenant, parse_tenants, token_hash

DIGEST = "ab" * 32


def _write(path, doc) -> None:
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize("doc, fault", [
    ({"tenants": {"a": {"role": "admin", "token_sha256": DIGEST}}}, "role 'admin'"),
    ({"tenants": {"a": {"token_sha256": "secret"}}}, "needs token_sha256"),
    ({"tenants": {"A b": {"token_sha256": DIGEST}}}, "tenant name 'A b'"),
    ({"tenants": {"a": {"token_sha256": DIGEST}, "b": {"token_sha256": DIGEST}}}, "share one token"),
    ({"tenants": {"a": {"token_sha256": DIGEST, "quotas": {"gpus": 1}}}}, "unknown quota 'gpus'"),
    ({"tenants": {"a": {"token_sha256": DIGEST, "quotas": {"queued": 0}}}}, "quota 'queued'"),
    ({"tenants": {"a": {"token_sha256": DIGEST, "weight": float("inf")}}}, "weight"),
    ({"tenants": {"a": {"token_sha256": DIGEST, "token": "x"}}}, "unknown key 'token'"),
    ({"tenants": {}}, "no tenants"),
    ({"people": {}}, "needs a mapping `tenants:"),
])
def test_a_bad_tenants_file_is_refused_naming_the_file_and_the_fault(tmp_path, doc, fault):
    path = tmp_path / "tenants.json"
    _write(path, doc)
    with pytest.raises(ValueError) as refused:
        parse_tenants(path)
    assert fault in str(refused.value) and str(path) in str(refused.value)


def test_defaults_and_a_folder_of_tenants(tmp_path):
    folder = tmp_path / "tenants"
    folder.mkdir()
    (folder / "_defaults.yaml").write_text("quotas: {connections: 3}\n")
    (folder / "cams.yaml").write_text(f"role: tenant\ntoken_sha256: {DIGEST}\nquotas: {{adapters: 2}}\n")
    (folder / "ops.yaml").write_text(f"role: operator\ntoken_sha256: {'cd' * 32}\n")
    tenants = parse_tenants(folder)
    assert tenants["cams"].quotas.adapters == 2 and tenants["cams"].quotas.connections == 3
    assert tenants["ops"].operator and not tenants["cams"].operator


def test_the_registry_follows_the_file_and_keeps_the_last_good_one(tmp_path, monkeypatch):
    monkeypatch.setattr("serve.rpc.tenants.RELOAD_CHECK_S", 0.0)
    path = tmp_path / "tenants.yaml"
    first = add_tenant(path, "a")
    registry = TenantRegistry.from_file(path)
    tenant = registry.identify(first.encode())
    assert tenant.name == "a" and registry.identify(b"not-a-token") is None
    second = add_tenant(path, "a")  # a new token: the old one stops working
    assert registry.identify(first.encode()) is None and registry.current(tenant) is None
    assert registry.identify(second.encode()).name == "a"
    path.write_text("tenants: [broken")
    assert registry.identify(second.encode()).name == "a", "a file that does not parse keeps the previous tenants"
    assert oct(os.stat(tmp_path / "tenants.yaml").st_mode & 0o777) != "0o777"


def test_the_single_token_is_the_operator():
    registry = TenantRegistry.single("single-token-123")
    assert registry.identify(b"single-token-123").operator
    assert registry.identify(b"single-token-124") is None
    # the only tenant: bounded by the server's limits, not a share of them (a 17th camera was refused)
    assert registry.identify(b"single-token-123").quotas.connections >= 1 << 20
    with pytest.raises(ValueError, match="8 to"):
        TenantRegistry.single("short")


def test_vlora_tenants_adds_lists_and_never_stores_the_token(tmp_path):
    path = tmp_path / "tenants.yaml"
    run = lambda *args: subprocess.run([sys.executable, "-m", "vlora.cli", "tenants", *args],  # noqa: E731
                                       capture_output=True, text=True, timeout=60)
    added = run("add", str(path), "traffic", "--quota", "adapters=4")
    assert added.returncode == 0, added.stderr
    token = added.stdout.split("token ")[1].strip()
    assert token not in path.read_text() and token_hash(token) in path.read_text()
    listed = run("list", str(path))
    assert "traffic\ttenant" in listed.stdout and "adapters=4" in listed.stdout
    bad = run("add", str(path), "Traffic!")
    assert bad.returncode == 1 and "tenant name 'Traffic!'" in bad.stderr
    assert parse_tenants(path)["traffic"].quotas.adapters == 4
