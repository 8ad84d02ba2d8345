"""``kernel.start`` with a path for a kernel id rmtree'd ``<path>/r1..r3``: ids are checked on arrival."""

from __future__ import annotations

from pathlib import Path

import msgpack
import pytest
from _cluster import ClusterHandle

from shared import messages
from shared.envelope import Envelope, EnvelopeError, decode

pytestmark = pytest.mark.integration

BAD_IDS = ["/tmp/victim", "../up", "..", "a/b", ".hidden", "", "x" * 200, "semi;colon", "nul\x00"]


@pytest.mark.parametrize("bad", BAD_IDS)
def test_envelope_with_a_path_like_kernel_id_is_rejected_naming_the_field(bad: str) -> None:
    raw = Envelope(messages.KERNEL_STATUS, {"kernel_id": bad}).encode()
    with pytest.raises(EnvelopeError, match="kernel_id"):
        decode(raw)


def test_uuid_and_simple_ids_are_accepted() -> None:
    for good in ("6f1f1d1e-1111-4222-8333-123456789abc", "k1", "r2", "kernel.v2_x"):
        assert (
            decode(Envelope(messages.KERNEL_STATUS, {"kernel_id": good}).encode()).body["kernel_id"] == good
        )


@pytest.mark.parametrize("service", ["gateway", "global-scheduler"])
def test_kernel_start_with_a_path_kernel_id_touches_nothing(
    tandem_cluster: ClusterHandle, tmp_path: Path, service: str
) -> None:
    victim = tmp_path / "victim"
    for replica in ("r1", "r2", "r3"):
        (victim / replica).mkdir(parents=True)
        (victim / replica / "keep").write_text("precious")
    sock = tandem_cluster.dealer(service)  # the operator's key: allowed to start kernels
    try:
        for verb in (messages.KERNEL_START, messages.KERNEL_SHUTDOWN):
            body = {"kernel_id": str(victim), "key": "k", "resources": {}}
            if verb == messages.KERNEL_SHUTDOWN:
                body = {"kernel_id": str(victim)}
            sock.send(Envelope(verb, body).encode())
            assert sock.poll(10_000), "no answer"
            answer = msgpack.unpackb(sock.recv())
            assert answer["type"] == "error"
            assert "kernel_id" in answer["body"]["reason"]
    finally:
        sock.close()
    for replica in ("r1", "r2", "r3"):
        assert (victim / replica / "keep").read_text() == "precious"
