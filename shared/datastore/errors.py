"""Errors of the data store, each naming the backend and the key so an operator can find the object."""

from __future__ import annotations


class DataStoreError(Exception):
    """Base of every data store failure."""


class DataStoreUnavailable(DataStoreError):
    """The backend service cannot be reached or refused the configured credentials/bucket."""


class ObjectNotFound(DataStoreError, KeyError):
    """No object under this key: never written, deleted, or written to another backend."""

    def __init__(self, backend: str, key: str) -> None:
        super().__init__(f"datastore {backend}: no object {key!r}")
        self.backend = backend
        self.key = key

    def __str__(self) -> str:  # KeyError would quote the message again
        return str(self.args[0])


class CorruptObject(DataStoreError):
    """Stored bytes do not match the reference's size or checksum; the bytes are never handed out."""

    def __init__(self, backend: str, key: str, reason: str) -> None:
        super().__init__(f"datastore {backend}: object {key!r} is corrupt: {reason}")
        self.backend = backend
        self.key = key
        self.reason = reason
