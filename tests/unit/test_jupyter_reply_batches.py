"""``jupyter.reply`` envelopes that carry several Jupyter messages (``more``): what one loop turn
of a local scheduler or the global scheduler had for the next hop goes in one envelope, in
order, and a malformed batch is refused at decoding like a malformed single message."""

from __future__ import annotations

from itertools import pairwise
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared import messages
from shared.envelope import Envelope, EnvelopeError, decode


def jupyter(n: int) -> list[bytes]:
    return [b"sig", f'{{"msg_id": "{n}"}}'.encode(), b"{}", b"{}", b"{}"]


channels = st.sampled_from(messages.CHANNELS)
replicas = st.sampled_from([("k1", "r1"), ("k1", "r2"), ("k2", "r1")])


@given(st.lists(st.tuples(replicas, channels), min_size=1, max_size=12))
def test_batches_keep_every_message_in_arrival_order_across_replicas(
    arrivals: list[tuple[tuple[str, str], str]],
) -> None:
    outgoing = [(who, channel, jupyter(n)) for n, (who, channel) in enumerate(arrivals)]
    bodies = [
        decode(Envelope(messages.JUPYTER_REPLY, b).encode()).body for b in messages.jupyter_replies(outgoing)
    ]
    received = [
        ((body["kernel_id"], body["replica_id"]), channel, frames)
        for body in bodies
        for channel, frames in messages.jupyter_messages(body)
    ]
    assert received == outgoing
    runs = 1 + sum(a[0] != b[0] for a, b in pairwise(arrivals))
    assert len(bodies) == runs  # one envelope per run of the same replica's messages


def test_a_single_message_is_the_plain_jupyter_reply_of_before() -> None:
    body = messages.jupyter_reply("k", [("iopub", jupyter(1))])
    assert body == {"kernel_id": "k", "channel": "iopub", "frames": jupyter(1)}


@pytest.mark.parametrize(
    "more",
    [
        "not a list",
        [["iopub"]],
        [["iopub", jupyter(2), "extra"]],
        [["nowhere", jupyter(2)]],
        [["iopub", [b"too", b"short"]]],
        [["iopub", ["not", "bytes", "at", "all", "!"]]],
        [("iopub", b"frames not a list")],
    ],
)
def test_a_malformed_batch_is_refused_at_decoding(more: Any) -> None:
    body = {"kernel_id": "k", "channel": "iopub", "frames": jupyter(1), "more": more}
    with pytest.raises(EnvelopeError):
        decode(Envelope(messages.JUPYTER_REPLY, body).encode())
