"""Which server an application talks to, and with which token (conf/server/*.yaml).

    server.port given            -> that server (at server.host, default 127.0.0.1)
    server=auto (the default)    -> the server `vlora serve` started, found by its address file in
                                    ${paths.home} (vlora.commands.address); none there: an own one
    server=own                   -> an own server in this process, on a free loopback port

A server the app did not start needs its token, from VLORA_TOKEN (or server.token=...): there is
no default token, and a missing or refused one ends the app with one line naming VLORA_TOKEN. An
own server takes VLORA_TOKEN / rpc.token when set, else a token made up for this run (nobody else
needs to know it: the server lives and dies with the app).
"""

from __future__ import annotations

import secrets
import sys
from dataclasses import dataclass

from omegaconf import DictConfig

from .address import find_server

MODES = ("auto", "own")
DEFAULT_HOST = "127.0.0.1"


@dataclass
class ServerTarget:
    """Where the app connects. own: start a server here (host and port are set once it listens)."""

    host: str
    port: int | None
    own: bool
    how: str  # one line for the console: how this server was chosen
    token: str | None = None
    pid: int | None = None  # of the `vlora serve` process, when found by its address file


def fail(app: str, message: str):
    raise SystemExit(f"{app}: {message}")


def choose_server(cfg: DictConfig, app: str, log=None) -> ServerTarget:
    """The server of cfg.server (see the module docstring), decided without connecting to it."""
    log = log or sys.stderr
    server = cfg.server
    mode = server.get("mode", "auto")
    if mode not in MODES:
        fail(app, f"server.mode={mode!r}: use server=auto (the server `vlora serve` started, else an own one) or "
                  "server=own")
    host, port = server.get("host"), server.get("port")
    if port is not None:
        if not isinstance(port, int) or not 0 < port < 65536:
            fail(app, f"server.port={port!r}: a port number (the one `vlora serve` printed)")
        host = host or DEFAULT_HOST
        return ServerTarget(host, port, False, f"using the server at {host}:{port} (server.port)")
    if host is not None:
        fail(app, f"server.host={host} needs server.port=<port> too (the one `vlora serve` printed)")
    if mode == "auto":
        found = find_server(cfg.paths.home, log, app)
        if found is not None:
            return ServerTarget(found.host, found.port, False, f"using the server at {found} started by vlora serve "
                                                               f"(pid {found.pid}); server=own starts an own one",
                                pid=found.pid)
    why = "server=own" if mode == "own" else f"no `vlora serve` running for {cfg.paths.home}"
    return ServerTarget(DEFAULT_HOST, None, True, f"starting an own server ({why})")


def server_token(cfg: DictConfig, target: ServerTarget, app: str) -> str:
    """The token to present: server.token (VLORA_TOKEN by default) for a server the app did not start;
    for an own one that, else a token made up for this run."""
    token = cfg.server.get("token")
    if token:
        return str(token)
    if target.own:
        return secrets.token_urlsafe(24)
    fail(app, f"the server at {target.host}:{target.port} needs its token: set VLORA_TOKEN to the token "
              "`vlora serve` was started with" + ("; or pass server=own for a server of the app's own"
                                                  if target.pid is not None else ""))


def check_connection(target: ServerTarget, app: str) -> None:
    """Connects once, so that a wrong token or an unreachable server ends the app with one line
    before any stream or query starts (they would retry, then fail one by one)."""
    from serve.rpc import AuthError, Client

    where = f"{target.host}:{target.port}"
    try:
        client = Client(target.host, target.port, target.token, timeout_s=10.0, reconnect=False)
        try:  # a server still warming its engine up refuses work: wait here, once, not per stream
            client.wait_ready(on_wait=lambda h: print(f"{app}: the server at {where} is warming its engine up "
                                                      f"({h.get('warming_s', 0):.0f} s so far); waiting",
                                                      file=sys.stderr, flush=True))
        finally:
            client.close()
    except AuthError as e:
        if "refused the token" in str(e):
            fail(app, f"the server at {where} refused the token: set VLORA_TOKEN to the token `vlora serve` was "
                      "started with")
        fail(app, f"the server at {where}: {e}")
    except OSError as e:
        fail(app, f"cannot reach a server at {where} ({e.strerror or e}); start one with `vlora serve`, or "
                  "pass server=own")


def connect(cfg: DictConfig, app: str, log=None) -> ServerTarget:
    """The server an app talks to, checked: a server the app did not start has answered the token;
    an own one is left to the caller to start (target.own, target.token set)."""
    log = log or sys.stderr
    target = choose_server(cfg, app, log)
    target.token = server_token(cfg, target, app)
    if not target.own:
        check_connection(target, app)
    print(f"{app}: {target.how}", file=log, flush=True)
    return target
