"""Authenticated, encrypted worker links: ZMQ CURVE on every tandem socket, from one cluster key.

Every member of a cluster (router, prefill and decode workers) holds the same CURVE key pair: the
one a directory made by `tandem keys DIR` holds (`--link-keys DIR`, env TANDEM_LINK_KEYS), or one
derived from a shared secret (`--link-secret-file F`, env TANDEM_LINK_SECRET). A binding socket is
a CURVE server with that pair; a connecting socket is a CURVE client presenting it; each context's
ZAP handler admits only client keys the cluster knows (the pair's own public key, plus any other
`*.key` public certificate in the directory). A peer without the secret key cannot finish the
handshake, so it cannot register, submit, or push a byte of KV: its frames never reach tandem code.

Links are secured process-wide, once, at start-up (`configure`); every socket factory calls
`server(sock)` / `client(sock)` before bind/connect, which do nothing while no keys are configured.
"""

from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import structlog
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

log = structlog.get_logger(__name__)

KEYS_ENV = "TANDEM_LINK_KEYS"
SECRET_ENV = "TANDEM_LINK_SECRET"
CLUSTER_CERT = "cluster"  # DIR/cluster.key (public) and DIR/cluster.key_secret (secret)
ZAP_DOMAIN = "tandem"
S = TypeVar("S", bound=zmq.Socket)  # plain or zmq.asyncio sockets


@dataclass(frozen=True)
class LinkKeys:
    public: bytes  # z85
    secret: bytes  # z85
    allowed: frozenset[bytes]  # z85 client public keys the ZAP handler admits
    source: str  # what they came from, for logs (never the secret itself)


def from_directory(path: str | os.PathLike) -> LinkKeys:
    directory = Path(path)
    secret_file = directory / f"{CLUSTER_CERT}.key_secret"
    if not secret_file.is_file():
        raise ValueError(f"link keys: {secret_file} not found (create the directory with `tandem keys {path}`)")
    public, secret = zmq.auth.load_certificate(secret_file)
    if secret is None:
        raise ValueError(f"link keys: {secret_file} holds no secret key")
    allowed = {public}
    for cert in sorted(directory.glob("*.key")):
        allowed.add(zmq.auth.load_certificate(cert)[0])
    return LinkKeys(public, secret, frozenset(allowed), f"directory {directory}")


def from_secret(secret: str | bytes) -> LinkKeys:
    """The same secret gives every process the same key pair (a Curve25519 secret key is any 32 bytes)."""
    raw = secret.encode() if isinstance(secret, str) else secret
    raw = raw.strip()
    if len(raw) < 16:
        raise ValueError("link secret: use at least 16 characters (e.g. `openssl rand -hex 32`)")
    secret_key = zmq.utils.z85.encode(hashlib.blake2b(raw, digest_size=32, person=b"tandem-link-v1").digest())
    public_key = zmq.curve_public(secret_key)
    return LinkKeys(public_key, secret_key, frozenset({public_key}), "shared secret")


def from_options(keys_dir: str | None = None, secret_file: str | None = None) -> LinkKeys | None:
    """Flags first, then the environment; None: links are not secured."""
    keys_dir = keys_dir or os.environ.get(KEYS_ENV) or None
    if keys_dir and secret_file:
        raise ValueError("give --link-keys or --link-secret-file, not both")
    if keys_dir:
        return from_directory(keys_dir)
    if secret_file:
        try:
            return from_secret(Path(secret_file).read_bytes())
        except OSError as exc:
            raise ValueError(f"--link-secret-file: cannot read {secret_file}: {exc.strerror}") from None
    if os.environ.get(SECRET_ENV):
        return from_secret(os.environ[SECRET_ENV])
    return None


def create_directory(path: str | os.PathLike, force: bool = False) -> tuple[Path, Path]:
    """`tandem keys DIR`: a fresh cluster key pair, the secret readable by its owner only."""
    directory = Path(path)
    if (directory / f"{CLUSTER_CERT}.key_secret").exists() and not force:
        raise ValueError(f"{directory} already holds cluster keys (--force replaces them)")
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    for stale in (directory / f"{CLUSTER_CERT}.key", directory / f"{CLUSTER_CERT}.key_secret"):
        stale.unlink(missing_ok=True)
    public_file, secret_file = zmq.auth.create_certificates(directory, CLUSTER_CERT)
    os.chmod(secret_file, 0o600)
    return Path(public_file), Path(secret_file)


# ---- the process-wide configuration ----------------------------------------------------------------
_keys: LinkKeys | None = None
_lock = threading.Lock()
_authenticators: dict[int, ThreadAuthenticator] = {}


def configure(keys: LinkKeys | None) -> None:
    global _keys
    _keys = keys
    if keys is not None:
        log.info("worker links authenticated and encrypted (ZMQ CURVE)", keys=keys.source,
                 public_key=keys.public.decode())


def configure_from_options(keys_dir: str | None = None, secret_file: str | None = None) -> LinkKeys | None:
    keys = from_options(keys_dir, secret_file)
    configure(keys)
    return keys


def enabled() -> bool:
    return _keys is not None


def server(sock: S) -> S:
    """Make a binding socket a CURVE server (before bind); its context gets the ZAP handler."""
    if _keys is not None:
        _ensure_authenticator(sock.context, _keys)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, _keys.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, _keys.secret)
    return sock


def client(sock: S) -> S:
    """Make a connecting socket a CURVE client of a cluster member (before connect)."""
    if _keys is not None:
        sock.setsockopt(zmq.CURVE_SERVERKEY, _keys.public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, _keys.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, _keys.secret)
    return sock


_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


class HandshakeWatch:
    """Tells a connecting side, once, that its peer refused the link (e.g. a worker given another
    cluster's keys would otherwise retry its registration forever in silence)."""

    def __init__(self, sock: zmq.Socket, peer: str) -> None:
        self.peer = peer
        self.reported = False
        self.monitor = sock.get_monitor_socket(_HANDSHAKE_FAILED) if _keys is not None else None

    def check(self) -> None:
        if self.monitor is None:
            return
        from zmq.utils.monitor import recv_monitor_message

        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)
            if not self.reported:
                self.reported = True
                log.error("the peer refused this link: are both given the same cluster keys "
                          "(--link-keys / --link-secret-file)?", peer=self.peer, zmq_event=event["event"])

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close(0)


class _ClusterKeys:
    """ZAP credentials provider: admits cluster keys; logs each refused key once."""

    def __init__(self, allowed: frozenset[bytes]) -> None:
        self.allowed = allowed
        self.refused: set[bytes] = set()

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.allowed:
            return True
        if key not in self.refused and len(self.refused) < 1024:  # bounded: a scan must not grow memory
            self.refused.add(key)
            log.warning("refused a link peer: its CURVE key is not the cluster's", key=key.decode(errors="replace"))
        return False


def _ensure_authenticator(ctx: zmq.Context, keys: LinkKeys) -> None:
    # ZAP is per libzmq context: one handler thread each (the router's asyncio context included).
    ident = ctx.underlying
    with _lock:
        if ident in _authenticators:
            return
        auth = ThreadAuthenticator(zmq.Context.shadow(ident))
        auth.start()
        auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=_ClusterKeys(keys.allowed))
        _authenticators[ident] = auth


def release(ctx: zmq.Context) -> None:
    """Stop a context's ZAP handler before the context is terminated (else term() waits on it)."""
    with _lock:
        auth = _authenticators.pop(ctx.underlying, None)
    if auth is not None:
        auth.stop()
