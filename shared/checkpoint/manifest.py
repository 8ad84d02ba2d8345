"""The checkpoint image's table of contents, and garbage collection as a function of manifests.

A manifest names every piece of every tensor by its XXH3 fingerprint and by where its bytes live:
an offset inside a *pack*, an object in the data store addressed by the BLAKE3 hash of its content.
Pieces are small (change detection at fine grain: a sparse embedding's few hot rows dirty few
pieces); packs are large (one store write per few MB, not per piece). A later checkpoint points
at the packs of earlier ones for pieces that did not change, so an increment writes only what
changed, and a pack's content address makes identical packs (the same frozen weights in two jobs)
stored once. Nothing here does I/O: the service keeps the manifests and decides what to delete.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from shared.datastore import ObjectRef

FORMAT_VERSION = 1


class ReadInterrupted(Exception):
    """A read of an image's pieces (``restore.PackReader.copy``) stopped because its reader asked
    it to: something else is read first. Here, not with the reader: catching it imports no torch."""


@dataclass(frozen=True, slots=True)
class PieceLocation:
    """Where one piece's bytes are: ``length`` bytes at ``offset`` of pack ``pack``."""

    pack: int
    offset: int
    length: int


@dataclass(frozen=True, slots=True)
class TensorRecord:
    """One tensor of the image: its layout and its pieces, in byte order."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    fingerprints: tuple[str, ...]
    pieces: tuple[PieceLocation, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "nbytes": self.nbytes,
            "fingerprints": list(self.fingerprints),
            "pieces": [[p.pack, p.offset, p.length] for p in self.pieces],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TensorRecord:
        return cls(
            name=str(data["name"]),
            dtype=str(data["dtype"]),
            shape=tuple(int(n) for n in data["shape"]),
            nbytes=int(data["nbytes"]),
            fingerprints=tuple(str(f) for f in data["fingerprints"]),
            pieces=tuple(PieceLocation(int(a), int(b), int(c)) for a, b, c in data["pieces"]),
        )


@dataclass(frozen=True, slots=True)
class Manifest:
    """A whole image: tensors, the small non-tensor state (``meta``), the packs they point into."""

    job: str
    step: int
    piece_bytes: int
    packs: tuple[ObjectRef, ...]
    meta: ObjectRef
    tensors: tuple[TensorRecord, ...]
    parent: str | None = None  # digest of the previous manifest of this job, for the service's lineage
    stats: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> bytes:
        """Canonical JSON: the manifest is itself stored content-addressed."""
        body = {
            "format": FORMAT_VERSION,
            "job": self.job,
            "step": self.step,
            "piece_bytes": self.piece_bytes,
            "packs": [p.to_dict() for p in self.packs],
            "meta": self.meta.to_dict(),
            "tensors": [t.to_dict() for t in self.tensors],
            "parent": self.parent,
            "stats": dict(self.stats),
        }
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def from_json(cls, raw: bytes | memoryview) -> Manifest:
        data = json.loads(bytes(raw))
        if data.get("format") != FORMAT_VERSION:
            raise ValueError(f"checkpoint manifest format {data.get('format')!r}, expected {FORMAT_VERSION}")
        manifest = cls(
            job=str(data["job"]),
            step=int(data["step"]),
            piece_bytes=int(data["piece_bytes"]),
            packs=tuple(ObjectRef.from_dict(p) for p in data["packs"]),
            meta=ObjectRef.from_dict(data["meta"]),
            tensors=tuple(TensorRecord.from_dict(t) for t in data["tensors"]),
            parent=data.get("parent"),
            stats={str(k): int(v) for k, v in data.get("stats", {}).items()},
        )
        manifest.check()
        return manifest

    def check(self) -> None:
        """Reject a manifest whose pieces do not tile their tensors or point outside their packs."""
        for record in self.tensors:
            if len(record.pieces) != len(record.fingerprints):
                raise ValueError(
                    f"{record.name}: {len(record.pieces)} pieces, {len(record.fingerprints)} fingerprints"
                )
            if sum(p.length for p in record.pieces) != record.nbytes:
                raise ValueError(f"{record.name}: pieces do not add up to {record.nbytes} bytes")
            for piece in record.pieces:
                if not 0 <= piece.pack < len(self.packs):
                    raise ValueError(f"{record.name}: pack {piece.pack} of {len(self.packs)}")
                if piece.offset < 0 or piece.offset + piece.length > self.packs[piece.pack].size:
                    raise ValueError(f"{record.name}: piece outside pack {piece.pack}")

    def record(self, name: str) -> TensorRecord:
        for record in self.tensors:
            if record.name == name:
                return record
        raise KeyError(name)

    def image_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def referenced_digests(manifest: Manifest) -> set[str]:
    """Every store object the image needs to be restored."""
    return {ref.digest for ref in manifest.packs} | {manifest.meta.digest}


def collectable(stored: Iterable[str], live: Iterable[Manifest], keep: Iterable[str] = ()) -> set[str]:
    """The digests among ``stored`` that no live manifest needs: safe to delete.

    ``keep`` protects objects of checkpoints still in flight (begun, not committed), whose packs
    are written before their manifest exists; the service passes what its open checkpoints reported.
    Manifest objects themselves are the service's roots: it lists them in ``keep`` or ``live``.
    """
    needed = set(keep)
    for manifest in live:
        needed |= referenced_digests(manifest)
    return set(stored) - needed
