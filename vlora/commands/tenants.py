"""`vlora tenants`: the operator's tenants file (serve.rpc.tenants), without Hydra.

    vlora tenants add tenants.yaml traffic                 # prints traffic's new token, once
    vlora tenants add tenants.yaml ops --role operator
    vlora tenants add tenants.yaml retail --quota adapters=4 --quota queued=64
    vlora tenants list tenants.yaml

`add` on an existing name gives that tenant a new token (its old one stops working, and its open
connections are cut off at their next call). A running `vlora serve rpc.tenants=tenants.yaml` re-reads
the file within a second; the file holds only the tokens' SHA-256.
"""

from __future__ import annotations

import argparse
import sys


def _quota(text: str) -> tuple[str, int]:
    key, sep, value = text.partition("=")
    if not sep or not value.strip().isdigit():
        raise argparse.ArgumentTypeError(f"--quota takes KEY=INTEGER, got {text!r}")
    return key.strip(), int(value)


def main(argv: list[str]) -> int:
    from serve.rpc.tenants import ROLES, Quotas, add_tenant, parse_tenants

    parser = argparse.ArgumentParser(prog="vlora tenants", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    add = sub.add_parser("add", help="add a tenant (or give it a new token) and print its token")
    add.add_argument("file")
    add.add_argument("name")
    add.add_argument("--role", choices=ROLES, default="tenant")
    add.add_argument("--quota", type=_quota, action="append", default=[],
                     help=f"KEY=N, KEY one of {[f for f in Quotas.__dataclass_fields__]}")
    show = sub.add_parser("list", help="the tenants of a file, their roles and quotas (never tokens)")
    show.add_argument("file")
    args = parser.parse_args(argv)
    try:
        if args.verb == "add":
            token = add_tenant(args.file, args.name, args.role, dict(args.quota) or None)
            print(f"tenant {args.name} ({args.role}): token {token}")
            print("(shown once; the file keeps only its SHA-256)", file=sys.stderr)
        else:
            for tenant in parse_tenants(args.file).values():
                print(f"{tenant.name}\t{tenant.role}\tweight {tenant.weight:g}\t{tenant.quotas}")
    except (OSError, ValueError) as e:
        print(f"vlora tenants: {e}", file=sys.stderr)
        return 1
    return 0
