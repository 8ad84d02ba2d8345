"""The Jupyter wire protocol's framing and HMAC signing, shared by every hop that touches it.

Tandem forwards Jupyter messages as their raw frames (signature, header, parent header, metadata,
content, buffers) so that most hops never parse JSON; only the hops that must look inside (the
gateway checking signatures, the scheduler routing by msg_id and rewriting execute_request into
yield_request) call into here. One implementation, so signing cannot drift between services.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any

DELIMITER = b"<IDS|MSG>"

_DIGESTS = {"hmac-sha256": hashlib.sha256, "hmac-sha1": hashlib.sha1, "hmac-md5": hashlib.md5}


class WireError(ValueError):
    """A Jupyter message that cannot be accepted (bad framing or signature); says why."""


class Signer:
    """HMAC over header, parent, metadata and content, as the Jupyter protocol specifies."""

    def __init__(self, key: bytes, scheme: str = "hmac-sha256") -> None:
        digest = _DIGESTS.get(scheme)
        if digest is None:
            raise WireError(f"unsupported signature scheme {scheme!r}")
        self._key = key
        self._digest = digest

    def sign(self, parts: list[bytes]) -> bytes:
        if not self._key:
            return b""
        mac = hmac.new(self._key, digestmod=self._digest)
        for part in parts[:4]:
            mac.update(part)
        return mac.hexdigest().encode()

    def verify(self, signature: bytes, parts: list[bytes]) -> bool:
        if not self._key:
            return True
        return hmac.compare_digest(signature, self.sign(parts))


def split_identities(frames: list[bytes]) -> tuple[list[bytes], list[bytes]]:
    """[ids..., DELIM, sig, header, parent, metadata, content, *buffers] -> (ids, msg frames)."""
    try:
        at = frames.index(DELIMITER)
    except ValueError:
        raise WireError("no <IDS|MSG> delimiter in message") from None
    msg = frames[at + 1 :]
    if len(msg) < 5:
        raise WireError(f"message has {len(msg)} frames after the delimiter, needs at least 5")
    return frames[:at], msg


def header_of(msg_frames: list[bytes]) -> dict[str, Any]:
    """Parse the header of [sig, header, parent, metadata, content, ...]."""
    try:
        header = json.loads(msg_frames[1])
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise WireError(f"header is not JSON: {exc}") from exc
    if not isinstance(header, dict) or not isinstance(header.get("msg_id"), str):
        raise WireError("header must be a JSON object with a msg_id")
    if not isinstance(header.get("msg_type"), str):
        raise WireError("header has no msg_type")
    return header


def parent_msg_id(msg_frames: list[bytes]) -> str | None:
    try:
        parent = json.loads(msg_frames[2])
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if isinstance(parent, dict):
        msg_id = parent.get("msg_id")
        return msg_id if isinstance(msg_id, str) else None
    return None


def json_part(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), default=str).encode()


# What a request's content must hold for the kernel to answer it at all (ipykernel reads these
# keys unguarded: a request without them is logged and never answered, stalling the client).
# key -> allowed JSON types; "?" prefix: optional, checked only when present.
_REQUEST_FIELDS: dict[str, dict[str, tuple[type, ...]]] = {
    "execute_request": {
        "code": (str,),
        "?silent": (bool,),
        "?store_history": (bool,),
        "?user_expressions": (dict,),
        "?allow_stdin": (bool,),
        "?stop_on_error": (bool,),
    },
    "complete_request": {"code": (str,), "cursor_pos": (int,)},
    "inspect_request": {"code": (str,), "cursor_pos": (int,), "?detail_level": (int,)},
    "is_complete_request": {"code": (str,)},
    "history_request": {"?hist_access_type": (str,), "?output": (bool,), "?raw": (bool,)},
    "shutdown_request": {"?restart": (bool,)},
    "input_reply": {"value": (str,)},
}


def content_problem(msg_type: str, content: bytes) -> str | None:
    """Why a request's content cannot be answered by a kernel, or None. Every request's content
    must be a JSON object; the fields of the common requests are checked by type."""
    try:
        parsed = json.loads(content)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return f"{msg_type} content is not JSON: {exc}"
    if not isinstance(parsed, dict):
        return f"{msg_type} content must be a JSON object, got {type(parsed).__name__}"
    for key, types in _REQUEST_FIELDS.get(msg_type, {}).items():
        optional = key.startswith("?")
        name = key.removeprefix("?")
        if name not in parsed:
            if optional:
                continue
            return f"{msg_type} content lacks the field {name!r}"
        value = parsed[name]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            return f"{msg_type} field {name!r} must be {'/'.join(t.__name__ for t in types)}, got {type(value).__name__}"
    return None
