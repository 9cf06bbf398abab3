"""The data plane's proof of the pipeline secret: a mutual HMAC challenge in each connection's
handshake, before any region can be written.

Both ends send a fresh random nonce with their HELLO. The receiver answers with
``HMAC(key, "receiver" + sender's nonce + its nonce)``, which the sender checks before it sends
anything more; the sender then answers with ``HMAC(key, "sender" + receiver's nonce + its
nonce)``, which the receiver checks before it reads a single frame. ``key`` is the pipeline's
data-plane key (:class:`~pdflow.security.keys.StageKeys`); neither the key nor anything derived
from it without a fresh nonce crosses the wire, so a recorded handshake cannot be replayed.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

NONCE_BYTES = 16
MAC_BYTES = 32


def nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def receiver_mac(key: bytes, sender_nonce: bytes, receiver_nonce: bytes) -> bytes:
    return hmac.new(key, b"pdflow-kv-receiver" + sender_nonce + receiver_nonce, hashlib.sha256).digest()


def sender_mac(key: bytes, sender_nonce: bytes, receiver_nonce: bytes) -> bytes:
    return hmac.new(key, b"pdflow-kv-sender" + receiver_nonce + sender_nonce, hashlib.sha256).digest()


def same(a: bytes, b: bytes) -> bool:
    return hmac.compare_digest(a, b)
