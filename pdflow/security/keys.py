"""The pipeline secret and every key derived from it.

One secret (32 random bytes) per pipeline: read from ``[security] secret_file`` or ``secret_env``
(hex, as ``pdflow keys new`` writes it; shared by the launchers of every host), or made fresh for
each run when neither is set (one host: no other process can learn it). Every key is derived
from it with keyed BLAKE2b under a label, so nothing but the secret ever has to be shared:

- each replica's CURVE key pair (``curve:<stage>/<replica>``) and the launcher's
  (``curve:launcher``): the control plane's identities;
- the data-plane key (``data-plane``) that both ends of a KV connection prove they hold.

A stage process is handed its :class:`StageKeys` (its own CURVE secret, every public key, the
data-plane key, and the HTTP API key for ingress) through the launcher's spawn pipe, never on a
command line, in the environment or in a file; the pipeline secret stays in the launcher.
Nothing here has a ``repr`` that shows a secret.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path

import zmq
from zmq.utils import z85

SECRET_BYTES = 32
LAUNCHER = "launcher"


class SecretError(ValueError):
    """The pipeline secret (or API key) could not be read; the message says where and why."""


def identity(stage: str, replica: int) -> str:
    """The control-plane identity of one replica: ``"decode/0"``."""
    return f"{stage}/{replica}"


def parse_identity(name: str) -> tuple[str, int] | None:
    """``"decode/0"`` -> ``("decode", 0)``; None for the launcher or anything else."""
    stage, sep, replica = name.rpartition("/")
    return (stage, int(replica)) if sep and stage and replica.isdigit() else None


def new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def encode_secret(secret: bytes) -> str:
    return secret.hex()


def decode_secret(text: str, where: str) -> bytes:
    text = text.strip()
    try:
        secret = bytes.fromhex(text)
    except ValueError:
        raise SecretError(f"{where}: expected {SECRET_BYTES * 2} hex digits (see `pdflow keys new`)") from None
    if len(secret) < SECRET_BYTES:
        raise SecretError(f"{where}: the secret has {len(secret)} bytes; at least {SECRET_BYTES} are needed "
                          "(see `pdflow keys new`)")
    return secret


def read_secret_file(path: Path, what: str = "secret") -> str:
    """The text of a secret file that only its owner can read (as ssh insists for its keys)."""
    try:
        st = path.stat()
    except OSError as exc:
        raise SecretError(f"{path}: cannot read the {what}: {exc.strerror}") from None
    if st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SecretError(f"{path}: the {what} file is readable by others (mode {stat.S_IMODE(st.st_mode):o}); "
                          f"run `chmod 600 {path}`")
    return path.read_text()


def write_secret_file(path: Path, secret: bytes) -> None:
    """Create ``path`` (mode 0600; never overwrites) holding ``secret`` in hex."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(encode_secret(secret) + "\n")


def _derive(secret: bytes, label: str) -> bytes:
    return hashlib.blake2b(label.encode(), key=secret, digest_size=32, person=b"pdflow-keys").digest()


@dataclass(frozen=True, slots=True)
class KeyPair:
    public: bytes  # z85, 40 bytes
    secret: bytes = field(repr=False)  # z85, 40 bytes

    @classmethod
    def derive(cls, pipeline_secret: bytes, label: str) -> KeyPair:
        secret = z85.encode(_derive(pipeline_secret, "curve:" + label))
        return cls(zmq.curve_public(secret), secret)


@dataclass(frozen=True, slots=True)
class StageKeys:
    """What one process needs to speak on the planes (see the module doc)."""

    identity: str
    own: KeyPair
    publics: dict[str, bytes]  # identity -> z85 public key, the launcher's included
    data_key: bytes = field(repr=False)
    api_key: str | None = field(default=None, repr=False)

    def public_of(self, name: str) -> bytes:
        return self.publics[name]

    def identity_of(self, public: bytes) -> str | None:
        for name, key in self.publics.items():
            if key == public:
                return name
        return None


class PipelineKeys:
    """Derives the keys of every replica of a pipeline from its secret (the launcher holds one)."""

    def __init__(self, secret: bytes, replicas: list[tuple[str, int]], api_key: str | None = None):
        self._secret = secret
        self.api_key = api_key
        names = [identity(*r) for r in replicas] + [LAUNCHER]
        self.pairs = {name: KeyPair.derive(secret, name) for name in names}
        self.publics = {name: pair.public for name, pair in self.pairs.items()}
        self.data_key = _derive(secret, "data-plane")

    def __repr__(self) -> str:
        return f"PipelineKeys({len(self.pairs)} identities)"

    def for_identity(self, name: str) -> StageKeys:
        api_key = self.api_key if name.startswith("ingress/") or name == LAUNCHER else None
        return StageKeys(name, self.pairs[name], dict(self.publics), self.data_key, api_key)

    def for_replica(self, stage: str, replica: int) -> StageKeys:
        return self.for_identity(identity(stage, replica))

    def launcher(self) -> StageKeys:
        return self.for_identity(LAUNCHER)


def load_pipeline_secret(security) -> bytes:
    """The secret ``security`` (a :class:`~pdflow.config.pipeline.SecurityConfig`) names, or a
    fresh one when it names none; SecretError saying where and why when it cannot be read."""
    if security.secret_file is not None:
        path = Path(security.secret_file)
        return decode_secret(read_secret_file(path), str(path))
    if security.secret_env:
        text = os.environ.get(security.secret_env)
        if text is None:
            raise SecretError(f"security.secret_env: the environment variable {security.secret_env} is not set")
        return decode_secret(text, f"the environment variable {security.secret_env}")
    return new_secret()


def load_api_key(security, given: str | None = None) -> str | None:
    """The HTTP API key: ``given`` (``pdflow run --api-key``) or what ``security`` names; None
    when the API is open."""
    if given:
        return given
    if security.api_key_file is not None:
        key = read_secret_file(Path(security.api_key_file), "API key").strip()
        where = str(security.api_key_file)
    elif security.api_key_env:
        key = os.environ.get(security.api_key_env, "").strip()
        where = f"the environment variable {security.api_key_env}"
    else:
        return None
    if not key:
        raise SecretError(f"{where}: the API key is empty or not set")
    return key


def pipeline_keys(pipeline, api_key: str | None = None) -> PipelineKeys:
    """Every key of ``pipeline``'s replicas, from the secret its ``[security]`` names."""
    return PipelineKeys(load_pipeline_secret(pipeline.security), pipeline.replicas(),
                        load_api_key(pipeline.security, api_key))
