"""Whoever can write to the data store (its directory, the Redis server, the S3 bucket) ran code
in a kernel: a replica reading a namespace value checked the object only against the XXH3-128
checksum in its (authenticated) Raft record, and XXH3 is no cryptographic hash: an object with
the same size and checksum that starts with a pickle of the writer's choosing is a few
additions away (``_xxh3_forge``). A restarted replica loaded it and ran ``posix.system``. Every
read is now checked against the object's BLAKE3 address as well, the cryptographic hash its
name already is, so a rewritten object is refused (``CorruptObject``) and never unpickled."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest
import torch
from _cluster import ClusterHandle
from _kernels import run, tandem_kernel
from _xxh3_forge import forge

from kernel_replica.object_codec import EncodedGroup, ObjectCodec
from kernel_replica.state_image import StateImager
from shared.checkpoint.manifest import Manifest
from shared.datastore.keys import ChecksumVerifier, content_id
from shared.datastore.local_backend import LocalStore


def _payload(marker: Path) -> bytes:
    """A protocol-0 pickle that runs a shell command when loaded."""
    return f"cposix\nsystem\n(S'touch {marker}'\ntR.".encode()


def test_bytes_crafted_to_match_the_checksum_do_not_match_the_address() -> None:
    original = bytes(range(256)) * 40
    forged = forge(original, _payload(Path("/nonexistent")))
    assert forged != original and forged.startswith(b"cposix")
    cid = content_id([original])
    verifier = ChecksumVerifier()
    verifier.update(forged)
    assert "blake3" in str(verifier.mismatch(cid.checksum, cid.size, cid.digest))


@pytest.mark.integration
def test_a_store_object_rewritten_with_the_same_checksum_is_never_unpickled(
    tandem_cluster: ClusterHandle, tmp_path: Path
) -> None:
    marker = tmp_path / "ran-the-store-writers-code"
    objects = tandem_cluster.state_dir / "datastore" / "objects"
    before = set(objects.rglob("*"))
    with tandem_kernel() as (km, kc):
        seed = int.from_bytes(os.urandom(4), "little")  # content no other test stored (dedup)
        cell = f"import numpy as np\nforged_target = np.random.default_rng({seed}).random(400_000)"
        assert run(kc, cell).status == "ok"
        written: list[Path] = []
        deadline = time.monotonic() + 20  # the state is written after the reply
        while time.monotonic() < deadline and not written:
            written = [
                p for p in set(objects.rglob("*")) - before if p.is_file() and p.stat().st_size > 3_000_000
            ]
            time.sleep(0.1)
        assert len(written) == 1, written
        original = written[0].read_bytes()
        written[0].write_bytes(forge(original, _payload(marker)))

        status = tandem_cluster.status()
        kernel = next(k for k in status["kernels"] if k["id"] == km.kernel_id)
        follower = next(r["id"] for r in kernel["replicas"] if r["id"] != kernel["last_executor"])
        restarted = tandem_cluster.cli("replica", "restart", km.kernel_id, follower, timeout=120)
        assert restarted.returncode == 0, restarted.stderr + restarted.stdout
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not marker.exists():
            time.sleep(0.2)
        assert not marker.exists(), "a replica unpickled what the store's writer wrote"
        replica_logs = "".join(
            p.read_text(errors="replace")
            for p in tandem_cluster.state_dir.glob(f"hosts/*/{km.kernel_id}/*/replica.log")
        )
        assert "blake3" in replica_logs


def test_a_kernel_image_pack_rewritten_with_the_same_checksum_is_never_unpickled(tmp_path: Path) -> None:
    """The background image of a large group (kernel_replica/state_image.py) keeps the pickle in a
    pack the manifest names by its BLAKE3 address: a pack rewritten with the same size and
    XXH3 checksum is refused on the standby before anything in it is unpickled."""
    root, marker = tmp_path / "store", tmp_path / "ran-the-store-writers-code"

    async def attack() -> None:
        async def open_store() -> LocalStore:
            return LocalStore(root)

        imager = StateImager(open_store, kernel="k")
        codec = ObjectCodec(LocalStore(root), large_object_bytes=64 * 1024)
        try:
            encoded = await codec.encode({"t": torch.randn(600_000)}, ["t"], images=True)
            image = await asyncio.wrap_future(imager.begin(("t",), encoded.images[0], 1))
        finally:
            imager.close()
        manifest = Manifest.from_json((root / image.ref.key).read_bytes())
        first = manifest.record("part.0").pieces[0]  # the pickle, where the pack starts
        assert first.offset == 0
        pack = root / manifest.packs[first.pack].key
        pack.write_bytes(forge(pack.read_bytes(), _payload(marker)))
        group = EncodedGroup(encoded.groups[0].names, encoded.groups[0].sizes, image=image.ref.to_dict())
        with pytest.raises(Exception, match="blake3"):
            await ObjectCodec(LocalStore(root)).decode(group, {})

    asyncio.run(attack())
    assert not marker.exists(), "a replica unpickled what the store's writer wrote"
