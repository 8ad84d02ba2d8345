"""The one envelope every internal message travels in.

A msgpack map ``{"v": version, "type": str, "id": str, "body": map}``. Decoding validates the
envelope and the body against the schema registered for its type in ``shared.messages``, so a
service's handlers only ever see well-formed messages; anything else becomes an ``EnvelopeError``
that names the problem and is logged and answered, never raised into the service's loop.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from typing import Any

import msgpack

from shared import messages

VERSION = 1

_id_prefix = f"{os.getpid():x}-{os.urandom(3).hex()}-"
_id_counter = itertools.count(1)


def new_request_id() -> str:
    """Unique per process without a syscall per message (the hot path sends many)."""
    return f"{_id_prefix}{next(_id_counter):x}"


class EnvelopeError(ValueError):
    """A message that cannot be accepted; ``str(exc)`` says why."""


@dataclass(slots=True)
class Envelope:
    type: str
    body: dict[str, Any] = field(default_factory=dict)
    id: str = field(default_factory=new_request_id)
    v: int = VERSION

    def encode(self) -> bytes:
        return msgpack.packb(
            {"v": self.v, "type": self.type, "id": self.id, "body": self.body}, use_bin_type=True
        )

    def reply(self, body: dict[str, Any] | None = None) -> Envelope:
        return Envelope(messages.REPLY, body or {}, id=self.id)

    def error(self, reason: str, code: str = "error") -> Envelope:
        return Envelope(
            messages.ERROR, {"code": code, "reason": reason, "request_type": self.type}, id=self.id
        )


def decode(data: bytes) -> Envelope:
    """Parse and validate one envelope; raises ``EnvelopeError`` with the reason."""
    try:
        raw = msgpack.unpackb(data, raw=False)
    except Exception as exc:  # msgpack raises several unrelated types for garbage input
        raise EnvelopeError(f"not msgpack: {exc.__class__.__name__}: {exc}") from exc
    if not isinstance(raw, dict):
        raise EnvelopeError(f"envelope must be a map, got {type(raw).__name__}")
    version = raw.get("v")
    if version != VERSION:
        raise EnvelopeError(f"unsupported envelope version {version!r} (expected {VERSION})")
    msg_type = raw.get("type")
    if not isinstance(msg_type, str):
        raise EnvelopeError("envelope 'type' must be a string")
    msg_id = raw.get("id")
    if not isinstance(msg_id, str) or not msg_id:
        raise EnvelopeError("envelope 'id' must be a non-empty string")
    body = raw.get("body")
    if not isinstance(body, dict):
        raise EnvelopeError(f"envelope 'body' of {msg_type!r} must be a map")
    problem = messages.validate(msg_type, body)
    if problem:
        raise EnvelopeError(f"{msg_type}: {problem}")
    return Envelope(msg_type, body, id=msg_id, v=version)
