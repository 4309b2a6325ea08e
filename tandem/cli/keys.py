"""`tandem keys DIR`: make a cluster's CURVE key pair; and the link-security flags every service takes.

Every router and worker of one cluster is given the same `--link-keys DIR` (or the same secret:
`--link-secret-file F` / env TANDEM_LINK_SECRET); then each worker link — registration, control,
KV transfer — is authenticated and encrypted, and a peer without the key is refused at the ZMQ
handshake (tandem/protocol/security.py).
"""

from __future__ import annotations

import argparse

from tandem.protocol import security


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("keys", help="create the CURVE key pair that authenticates a cluster's worker links",
                       description="Write DIR/cluster.key (public) and DIR/cluster.key_secret (owner-only). "
                                   "Copy DIR to every host of the cluster and start each service with "
                                   "--link-keys DIR (or env TANDEM_LINK_KEYS=DIR).")
    p.add_argument("directory", help="where to write the keys (created with mode 0700)")
    p.add_argument("--force", action="store_true", help="replace keys already in DIR")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    public, secret = security.create_directory(args.directory, force=args.force)
    print(f"wrote {public} and {secret}")
    print(f"start every service of the cluster with --link-keys {args.directory} (or TANDEM_LINK_KEYS)")
    return 0


def add_link_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("worker-link security (ZMQ CURVE)")
    g.add_argument("--link-keys", default=None, metavar="DIR",
                   help=f"cluster keys made by `tandem keys DIR`: authenticate and encrypt every worker link "
                        f"(env {security.KEYS_ENV})")
    g.add_argument("--link-secret-file", default=None, metavar="FILE",
                   help=f"derive the cluster keys from the secret in FILE instead (env {security.SECRET_ENV})")


def apply_link_args(args: argparse.Namespace) -> security.LinkKeys | None:
    """Secure this process's links as the flags/environment say (before any socket is made)."""
    return security.configure_from_options(args.link_keys, args.link_secret_file)
