"""CURVE on the control plane: who may connect, and who sent each message.

Every socket that binds (a stage's inbox, the launcher's PULL and PUB) is a CURVE server with its
owner's key pair; every socket that connects is a CURVE client with its own key pair and the
server's public key. :class:`PipelineAuthenticator` (ZeroMQ's ZAP, in a thread of each process)
admits only the pipeline's own public keys and names each peer by its identity, which every
message it sends then carries (ZeroMQ's ``User-Id`` property): a receiver knows which replica sent
a message, whatever the message says. A peer without a key of the pipeline is refused during the
handshake, before any of its bytes reach us.
"""

from __future__ import annotations

import logging

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from pdflow.security.keys import StageKeys

ZAP_DOMAIN = b"pdflow"


class PipelineAuthenticator(ThreadAuthenticator):
    """Admits the keys in ``keys.publics``; counts (and logs, once per key) the others."""

    def __init__(self, ctx: zmq.Context, keys: StageKeys):
        super().__init__(ctx, log=logging.getLogger("pdflow.zap"))
        self._names = {public: name for name, public in keys.publics.items()}
        self.refused = 0
        self._refused_keys: set[bytes] = set()
        self.configure_curve_callback(ZAP_DOMAIN.decode(), credentials_provider=self)

    def callback(self, domain: str, z85_key: bytes) -> bool:
        if z85_key in self._names:
            return True
        self.refused += 1
        if z85_key not in self._refused_keys and len(self._refused_keys) < 1000:
            self._refused_keys.add(z85_key)
            import structlog

            structlog.get_logger().warning("control.peer.refused", reason="not a key of this pipeline")
        return False

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self._names.get(z85.encode(client_public_key), "")


def as_server(sock: zmq.Socket, keys: StageKeys) -> None:
    """Make ``sock`` (before it binds) a CURVE server that only the pipeline's keys can reach."""
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no ZAP handler: refuse, never admit
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.own.secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.own.public)


def as_client(sock: zmq.Socket, keys: StageKeys, server: str) -> None:
    """Make ``sock`` (before it connects) a CURVE client of the peer named ``server``."""
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.own.secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.own.public)
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.public_of(server))


def sender_of(frame: zmq.Frame) -> str | None:
    """The identity the authenticator gave the peer that sent ``frame`` (None without CURVE)."""
    try:
        name = frame.get("User-Id")
    except zmq.ZMQError:
        return None
    return name or None
