"""Refused handshakes are logged: the source address and the reason (never the token), at most one
line per address per window, the next line counting the refusals in between."""

from __future__ import annotations

import logging
import socket
import time

import pytest
from rpyc.utils.authenticators import AuthenticationError

from serve.rpc.auth import MAGIC, RefusalLog, TokenAuthenticator

TOKEN = "auth-log-token-0123456789"


def _refuse(auth: TokenAuthenticator, line: bytes) -> bytes:
    """Sends `line` over a real loopback connection to the authenticator; returns its reply."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server_side, _ = listener.accept()
        with client, server_side:
            client.sendall(line + b"\n")
            with pytest.raises(AuthenticationError):
                auth(server_side)
            return client.recv(16)


@pytest.fixture
def logged(caplog):
    caplog.set_level(logging.WARNING, logger="vlora.serve.rpc.auth")
    return lambda: [r.getMessage() for r in caplog.records if r.name == "vlora.serve.rpc.auth"]


def test_a_wrong_token_is_logged_once_per_window_with_a_count_of_the_rest(logged):
    auth = TokenAuthenticator(TOKEN, refusals=RefusalLog(every_s=0.5))
    for _ in range(3):
        assert _refuse(auth, MAGIC + b"guessed-token-1") == b"DENIED\n"
    assert logged() == ["refused a connection from 127.0.0.1: wrong token"]
    time.sleep(0.6)
    _refuse(auth, MAGIC + b"guessed-token-2")
    assert logged()[1] == ("refused a connection from 127.0.0.1: wrong token (2 more refused from it in the last "
                           "0.5 s, not logged)")
    assert not any("guessed" in m for m in logged())


def test_a_line_that_is_no_handshake_is_logged_without_its_content(logged):
    auth = TokenAuthenticator(TOKEN, refusals=RefusalLog(every_s=10))
    assert _refuse(auth, TOKEN.encode()) == b"DENIED\n"  # a bare token: the protocol's magic is missing
    assert logged() == ["refused a connection from 127.0.0.1: not a V-LoRA handshake (a 25-byte line without "
                        "VLORA-AUTH/1)"]
    assert TOKEN not in logged()[0]


def test_the_log_remembers_a_bounded_number_of_addresses():
    log = RefusalLog(logging.getLogger("vlora.test.refusals"), every_s=60, max_addresses=3)
    assert all(log.refused(f"10.0.0.{i}", "wrong token") for i in range(5))
    assert len(log._seen) == 3 and not log.refused("10.0.0.4", "wrong token")
