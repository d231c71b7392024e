"""Tenants who cannot hurt each other, against a real `vlora serve` started with a tenants file: each
sees, uses, replaces and unloads only its own adapters (and the operator's shared ones), never a
server path; quotas hold over all of a tenant's connections; a token taken away stops working."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from rpc_server import ServerProcess

from serve.rpc import AuthError, Client, ServerError, add_tenant

NAME = "qwen2_vl_tiny"
FRAME = np.full((32, 32, 3), 90, np.uint8)


@pytest.fixture(scope="module")
def roots(tiny_zoo, tmp_path_factory):
    from adapter_cases import build_adapters

    root = tmp_path_factory.mktemp("adapter_root")
    build_adapters(tiny_zoo[NAME], root / "a", ("qv8",))
    build_adapters(tiny_zoo[NAME], root / "b", ("qv8", "all16"))
    shared = build_adapters(tiny_zoo[NAME], tmp_path_factory.mktemp("shared"), ("all16",))["all16"]
    return root, shared


@pytest.fixture(scope="module")
def tenants(tmp_path_factory):
    path = tmp_path_factory.mktemp("tenants") / "tenants.yaml"
    tokens = {"ops": add_tenant(path, "ops", "operator"),
              "a": add_tenant(path, "a", quotas={"adapters": 2}),
              "b": add_tenant(path, "b"),
              "q": add_tenant(path, "q", quotas={"connections": 2, "queued": 2})}
    return path, tokens


@pytest.fixture(scope="module")
def server(tiny_zoo, vlora_home, roots, tenants):
    root, shared = roots
    proc = ServerProcess(tiny_zoo[NAME], vlora_home, f"rpc.tenants={tenants[0]}", f"rpc.adapter_root={root}",
                         "adapters.manifest=null", f"adapters.extra=['shared={shared}']", "engine.max_batch_size=4")
    yield proc
    proc.stop()


def _client(server, tenants, who: str) -> Client:
    return Client("127.0.0.1", server.port, tenants[1][who], reconnect=False)


def _tokens(client: Client, adapter: str | None) -> list[int]:
    out = client.submit_image("How many cars?", [FRAME], adapter=adapter,
                              sampling={"max_tokens": 6, "ignore_eos": True}).result(60)
    return out["token_ids"]


def test_the_single_token_is_refused_once_a_tenants_file_is_given(server):
    from rpc_server import TOKEN

    with pytest.raises(AuthError, match="refused the token"):
        Client("127.0.0.1", server.port, TOKEN, reconnect=False)


def test_a_tenant_sees_uses_and_unloads_only_its_own_and_the_shared_adapters(server, tenants, roots):
    root, shared = roots
    with _client(server, tenants, "a") as a, _client(server, tenants, "b") as b, \
            _client(server, tenants, "ops") as ops:
        a.load_adapter("mine", "qv8")  # from a's own folder: <root>/a/qv8
        b.load_adapter("mine", "qv8")  # the same name in b's namespace: no clash, no hint of a's
        listed_a = a.list_adapters()
        assert sorted((x["name"], x["owner"]) for x in listed_a) == [("mine", "a"), ("shared", "shared")]
        assert sorted((x["name"], x["owner"]) for x in ops.list_adapters()) == \
            [("mine@a", "a"), ("mine@b", "b"), ("shared", "shared")]
        for listing in (listed_a, b.list_adapters(), ops.list_adapters()):
            text = json.dumps(listing)
            assert "path" not in listing[0] and str(root) not in text and str(shared.parent) not in text
        before = _tokens(a, "mine")
        assert before != _tokens(a, None), "the adapter must change the answer, or the swap below proves nothing"

        # b replaces its own "mine" with other weights: a's "mine" is untouched
        b.unload_adapter("mine")
        b.load_adapter("mine", "all16")
        assert _tokens(a, "mine") == before
        assert _tokens(b, "mine") != before

        # nothing of the other tenant's or the operator's can be unloaded, replaced or read by path
        with pytest.raises(ServerError) as shared_unload:
            a.unload_adapter("shared")
        assert shared_unload.value.kind == "forbidden"
        with pytest.raises(ServerError) as shadow:
            a.load_adapter("shared", "qv8")
        assert shadow.value.kind == "rejected"
        with pytest.raises(ServerError) as spelled:
            a.unload_adapter("mine@b")
        assert spelled.value.kind == "bad_argument"
        with pytest.raises(ServerError) as other_folder:
            a.load_adapter("stolen", "../b/all16")
        assert other_folder.value.kind == "forbidden"
        with pytest.raises(ServerError) as twice:
            a.load_adapter("mine", "qv8")
        assert twice.value.kind == "rejected" and str(root) not in twice.value.message
        with pytest.raises(ServerError) as missing:
            a.load_adapter("x", "nope")
        assert str(root) not in missing.value.message and "nope" in missing.value.message

        # the quota: a may own 2 adapters
        a.load_adapter("second", "qv8")
        with pytest.raises(ServerError) as full:
            a.load_adapter("third", "qv8")
        assert full.value.kind == "too_many_adapters"

        # the operator may unload a tenant's adapter; the tenant then finds it gone
        ops.unload_adapter("mine@b")
        with pytest.raises(ServerError) as gone:
            b.submit_image("Describe.", [FRAME], adapter="mine").result(30)
        assert gone.value.kind == "unknown_adapter"
        a.unload_adapter("mine")
        a.unload_adapter("second")
        assert [x["name"] for x in a.list_adapters()] == ["shared"]


def test_quotas_hold_across_a_tenants_connections(server, tenants):
    first, second = _client(server, tenants, "q"), _client(server, tenants, "q")
    try:
        with pytest.raises(AuthError, match="connection limit"):
            _client(server, tenants, "q")
        long = {"max_tokens": 200, "ignore_eos": True}
        streams = [first.submit_image("Describe.", [FRAME], sampling=long),
                   second.submit_image("Describe.", [FRAME], sampling=long)]
        with pytest.raises(ServerError) as full:
            first.submit_image("Describe.", [FRAME], sampling=long).result(30)
        assert full.value.kind == "too_many_requests" and "tenant" in full.value.message
        with _client(server, tenants, "b") as other:  # another tenant is not held to q's quota
            assert len(_tokens(other, None)) == 6
        for stream in streams:
            stream.abort()
    finally:
        first.close()
        second.close()


def test_a_new_token_cuts_off_the_old_one_without_a_restart(server, tenants):
    path, tokens = tenants
    old = add_tenant(path, "c")
    deadline = time.monotonic() + 5  # the server re-reads the file within a second of a change
    while True:
        try:
            client = Client("127.0.0.1", server.port, old, reconnect=False)
            break
        except AuthError:
            assert time.monotonic() < deadline, "the added tenant was never accepted"
            time.sleep(0.2)
    try:
        assert client.health()["healthy"]
        new = add_tenant(path, "c")
        time.sleep(1.2)
        with pytest.raises(ServerError) as revoked:
            client.list_adapters()
        assert revoked.value.kind == "unauthorized"
        with pytest.raises(AuthError):
            Client("127.0.0.1", server.port, old, reconnect=False)
        with Client("127.0.0.1", server.port, new, reconnect=False) as fresh:
            assert fresh.health()["healthy"]
    finally:
        client.close()
