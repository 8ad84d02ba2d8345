"""Log entry encoding: round trips, and malformed bytes rejected with a reason (never a crash)."""

from __future__ import annotations

import contextlib

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kernel_replica.log_entries import (
    Done,
    Lead,
    LogEntryError,
    Progress,
    State,
    Vote,
    Votes,
    Yield,
    decode,
    encode,
)


@pytest.mark.parametrize(
    "entry",
    [
        Lead("m1", "r1"),
        Yield("m1", "r2", "r1"),
        Vote("m1", "r3", "r1"),
        Votes("r3", (("m1", "r1"), ("m2", "r2"))),
        Progress("m1", "r1"),
        Done("m1", "r1", {"status": "ok", "execution_count": 4}, 5, code="x = 1"),
        Done("m1", "r1", {"status": "ok", "execution_count": 4, "payload": []}, 5),
        Done("m1", "r1", {"status": "error", "ename": "E"}, 5, state_follows=False),
        Done("m1", "r1", {"status": "ok", "execution_count": 4}, 5, code="x = 1", claims_lead=True),
        State("m1", "r1", {"x": b"\x01" * 16}, b"\x80\x05}\x94.", ("y",), {"f": "not picklable"}),
        State("m1", "r1", gpu_resident=(("model", (), "module"), ("d", ("w", 0), "tensor"))),
        State(
            "comm-1",
            "r1",
            repair=True,
            comms={"c1": {"target": "jupyter.widget", "class": ["m", "W"], "state": {"value": 7}}},
            comms_closed=("c0",),
        ),
    ],
)
def test_round_trip(entry: object) -> None:
    assert decode(encode(entry)) == entry  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("raw", "why"),
    [
        (b"\xc1", "not msgpack"),
        (msgpack.packb([1, 2]), "must be a map"),
        (msgpack.packb({"t": 9, "k": "LEAD"}), "version"),
        (msgpack.packb({"t": 1, "k": "NOPE", "m": "a", "r": "b"}), "unknown entry kind"),
        (msgpack.packb({"t": 1, "k": "LEAD", "m": "", "r": "b"}), "'m'"),
        (msgpack.packb({"t": 1, "k": "DONE", "m": "a", "r": "b", "c": {}, "n": 1}), "status"),
        (msgpack.packb({"t": 1, "k": "DONE", "m": "a", "r": "b", "c": {"status": "ok"}, "n": -1}), "count"),
        (msgpack.packb({"t": 1, "k": "STATE", "m": "a", "r": "b", "dg": {"x": "str"}}), "bytes"),
        (msgpack.packb({"t": 1, "k": "STATE", "m": "a", "r": "b", "ns": "str"}), "'ns'"),
        (msgpack.packb({"t": 1, "k": "STATE", "m": "a", "r": "b", "gr": [["x", [], "blob"]]}), "'gr'"),
        (msgpack.packb({"t": 1, "k": "STATE", "m": "a", "r": "b", "gr": [["x", [1.5], "tensor"]]}), "'gr'"),
        (msgpack.packb({"t": 1, "k": "STATE", "m": "a", "r": "b", "cm": {"c": {"state": {}}}}), "'cm'"),
        (msgpack.packb({"t": 1, "k": "STATE", "m": "a", "r": "b", "cc": [1]}), "'cc'"),
        (msgpack.packb({"t": 1, "k": "VOTES", "m": "a", "r": "b", "v": []}), "pairs"),
        (msgpack.packb({"t": 1, "k": "VOTES", "m": "a", "r": "b", "v": [["a"]]}), "pairs"),
        (
            msgpack.packb({"t": 1, "k": "DONE", "m": "a", "r": "b", "c": {"status": "ok"}, "n": 1, "h": 3}),
            "code",
        ),
        (
            msgpack.packb({"t": 1, "k": "DONE", "m": "a", "r": "b", "c": {"status": "ok"}, "n": 1, "l": 1}),
            "claims the LEAD",
        ),
    ],
)
def test_malformed_entries_are_rejected_with_reason(raw: bytes, why: str) -> None:
    with pytest.raises(LogEntryError, match=why):
        decode(raw)


@given(st.binary(max_size=200))
def test_garbage_never_raises_anything_but_log_entry_error(data: bytes) -> None:
    with contextlib.suppress(LogEntryError):
        decode(data)
