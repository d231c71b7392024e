"""A connection admitted at its handshake holds its place until its service counts it (serve.rpc.state)."""

from __future__ import annotations

import pytest

from serve.rpc import state as state_module
from serve.rpc.state import ServerState
from serve.rpc.tenants import Quotas, Tenant
from serve.rpc.wire import Limits

Q = Tenant("q", "tenant", "0" * 64, Quotas(connections=2))
B = Tenant("b", "tenant", "1" * 64, Quotas(connections=2))


def _state(max_connections: int = 64) -> ServerState:
    return ServerState(loop=object(), limits=Limits(), max_connections=max_connections)


def test_admitted_connections_count_against_the_quota_before_their_service_starts():
    state = _state()
    assert state.admit(Q) and state.admit(Q)  # both handshakes done, neither service started yet
    assert not state.admit(Q)  # before: a third got in, as neither had counted itself
    assert state.admit(B)  # another tenant's quota is its own
    state.connected(Q), state.connected(Q)
    assert not state.admit(Q) and state.usage["q"].connections == 2 and not [a for a in state.admitted if a[1] == "q"]
    state.disconnected(Q)
    assert state.admit(Q)


def test_admitted_connections_count_against_the_server_limit():
    state = _state(max_connections=2)
    assert state.admit(Q) and state.admit(B)
    assert not state.admit(B)
    state.connected(Q), state.connected(B)
    assert state.connections == 2 and not state.admitted and not state.admit(B)


def test_a_place_held_by_a_client_gone_before_its_service_started_is_given_back(monkeypatch):
    state = _state()
    clock = [100.0]
    monkeypatch.setattr(state_module.time, "monotonic", lambda: clock[0])
    assert state.admit(Q) and state.admit(Q) and not state.admit(Q)
    clock[0] += state_module.ADMITTED_S + 0.1  # neither ever connected
    assert state.admit(Q)
    assert len(state.admitted) == 1


@pytest.mark.parametrize("connections", [1, 3])
def test_a_tenant_of_n_connections_gets_exactly_n_places(connections):
    tenant = Tenant("t", "tenant", "2" * 64, Quotas(connections=connections))
    state = _state()
    assert [state.admit(tenant) for _ in range(connections + 2)] == [True] * connections + [False, False]
