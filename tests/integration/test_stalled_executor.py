"""An executor whose user code stalls every Python thread of its replica keeps its cell.

JupyterLab's debugger: the front end's Debug Adapter Protocol session (``debug_request`` on the
control channel, ``debug_event`` on IOPub) reaches one replica's debugpy. Before, debugpy stopped
every thread of the replica at a breakpoint, its Raft thread too: after
``election.executor_silence_s`` the other replicas gave the cell up as lost, and the client got
``ExecutorLost`` for a cell that ran to its end once the user pressed continue.

A C call holding the GIL (a catastrophic regex, a huge integer, a pickle) stalls the Raft thread
just the same, and cannot be told apart from inside the process: the replicas ask the executor's
host, whose OS says the process runs. Before, such a cell was given up after the silence, and the
replica that ran it left the kernel, refusing the next cell on its way out.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _cluster import WITHOUT_HTTP_API, ClusterHandle, running_cluster
from _kernels import run, tandem_kernel
from jupyter_client import BlockingKernelClient

pytestmark = pytest.mark.integration

EXECUTOR_SILENCE_S = 1.5  # the standbys give up on a silent executor after this


@pytest.fixture(scope="module")
def debug_cluster(
    tmp_path_factory: pytest.TempPathFactory, tandem_kernelspec: Path
) -> Iterator[ClusterHandle]:
    with running_cluster(
        tmp_path_factory.mktemp("debugger-state"),
        "--hosts", "3",
        "--set", f"election.executor_silence_s={EXECUTOR_SILENCE_S}",
        "--set", "election.progress_interval_s=0.5",
        *WITHOUT_HTTP_API,
    ) as handle:  # fmt: skip
        yield handle


class DebugSession:
    """The requests JupyterLab's debugger sends, one at a time, each answered on control."""

    def __init__(self, kc: BlockingKernelClient) -> None:
        self.kc = kc
        self.seq = 0

    def __call__(self, command: str, arguments: dict[str, Any] | None = None) -> dict[str, Any]:
        self.seq += 1
        content = {"type": "request", "seq": self.seq, "command": command, "arguments": arguments or {}}
        msg = self.kc.session.msg("debug_request", content)
        self.kc.control_channel.send(msg)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            reply = self.kc.control_channel.get_msg(timeout=deadline - time.monotonic())
            if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
                answer = reply["content"]
                assert answer.get("success"), f"{command}: {answer.get('message')}"
                return dict(answer)
        raise AssertionError(f"no debug_reply to {command}")

    def wait_event(self, event: str, timeout: float = 30) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                msg = self.kc.get_iopub_msg(timeout=left)
            except queue.Empty:
                break
            if msg["msg_type"] == "debug_event" and msg["content"].get("event") == event:
                return dict(msg["content"].get("body") or {})
        raise AssertionError(f"no debug_event {event!r} in {timeout} s")


def _shell_reply(kc: BlockingKernelClient, msg_id: str, timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reply = kc.get_shell_msg(timeout=deadline - time.monotonic())
        if reply["parent_header"].get("msg_id") == msg_id:
            return dict(reply["content"])
    raise AssertionError("no execute_reply")


@pytest.mark.usefixtures("debug_cluster")
def test_a_breakpoint_held_past_the_executor_silence_keeps_the_cell_and_its_state() -> None:
    with tandem_kernel() as (_, kc):
        assert run(kc, "x = 20", timeout=60).status == "ok"
        debug = DebugSession(kc)
        debug("initialize", {"clientID": "test", "adapterID": "python", "pathFormat": "path"})
        debug("attach")
        code = "y = x + 1\nz = y * 2\nprint('z is', z)"
        path = debug("dumpCell", {"code": code})["body"]["sourcePath"]
        placed = debug("setBreakpoints", {"source": {"path": path}, "breakpoints": [{"line": 2}]})
        assert placed["body"]["breakpoints"][0]["verified"]
        debug("configurationDone")

        msg_id = kc.execute(code)
        stopped = debug.wait_event("stopped")
        time.sleep(3 * EXECUTOR_SILENCE_S)  # the user looks around; the replica's Raft goes on
        [frame, *_] = debug("stackTrace", {"threadId": stopped["threadId"]})["body"]["stackFrames"]
        assert frame["line"] == 2
        scopes = debug("scopes", {"frameId": frame["id"]})["body"]["scopes"]
        variables = {
            v["name"]: v["value"]
            for scope in scopes
            for v in debug("variables", {"variablesReference": scope["variablesReference"]})["body"][
                "variables"
            ]
        }
        assert variables["y"] == "21"
        debug("continue", {"threadId": stopped["threadId"]})

        reply = _shell_reply(kc, msg_id)
        assert reply["status"] == "ok", reply
        debug("disconnect", {"restart": False, "terminateDebuggee": True})
        after = run(kc, "print(z)", timeout=60)
        assert after.status == "ok", after.errors
        assert after.stdout.strip() == "42"


@pytest.mark.usefixtures("debug_cluster")
def test_a_c_call_holding_the_gil_past_the_executor_silence_keeps_the_cell_and_its_state() -> None:
    with tandem_kernel() as (_, kc):
        assert run(kc, "x = 1", timeout=60).status == "ok"
        # libc's sleep through ctypes.PyDLL, which keeps the GIL: no thread of the replica runs
        held = 4 * EXECUTOR_SILENCE_S
        cell = run(kc, f"import ctypes\nctypes.PyDLL(None).sleep({held:.0f})\nx = 2", timeout=60)
        assert cell.status == "ok", cell.errors
        for _ in range(3):  # the replica that ran it stays (it left, refusing cells, before)
            after = run(kc, "print(x)", timeout=60)
            assert after.status == "ok", after.errors
            assert after.stdout.strip() == "2"
