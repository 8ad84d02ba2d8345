"""Widgets keep working across executor changes: the comm registry and the widget models are
replicated, and the front end's comm messages reach whichever replica executes now.

A real ``ipywidgets.IntSlider`` is made on one replica; the next cell is forced onto another
(every other host cordoned). The test then does what JupyterLab does when the user drags the
slider: a ``comm_msg`` ``update`` on the shell channel. The new executor must hold the comm (it
echoes the update, and lists it in ``comm_info_reply``), the value must be 7 in the next cell
there and on the first replica too (the update, handled between cells, was replicated), and a
cell that sets the value on the first replica again must send the front end its update.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
from _cluster import ClusterHandle
from _kernels import CellResult, run, tandem_kernel
from jupyter_client import BlockingKernelClient

from shared import messages

pytestmark = pytest.mark.integration


def _replica_hosts(cluster: ClusterHandle, kernel_id: str) -> list[str]:
    deadline = time.monotonic() + 30
    while True:
        status = cluster.ask_scheduler(messages.CLUSTER_STATUS, {})
        kernel = next(k for k in status["kernels"] if k["id"] == kernel_id)
        hosts = sorted({r["host"] for r in kernel["replicas"] if r.get("host")})
        if len(hosts) >= 2 or time.monotonic() > deadline:
            return hosts
        time.sleep(0.2)


def _on(cluster: ClusterHandle, kc: BlockingKernelClient, host: str, code: str) -> CellResult:
    with cluster.only_host_open(host):
        result = run(kc, code, timeout=60)
    assert result.status == "ok", (code, result.errors)
    assert result.tandem.get("host_id") == host, (code, result.tandem, host)
    return result


def _iopub_until_idle(kc: BlockingKernelClient, parent_id: str, timeout: float = 20.0) -> list[dict[str, Any]]:
    """The IOPub messages of request ``parent_id`` up to its idle."""
    seen: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = kc.get_iopub_msg(timeout=max(0.05, deadline - time.monotonic()))
        except Exception:
            break
        if msg.get("parent_header", {}).get("msg_id") != parent_id:
            continue
        seen.append(msg)
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return seen
    raise AssertionError(f"no idle for {parent_id}: {[m['msg_type'] for m in seen]}")


def test_slider_moved_after_an_executor_change_reaches_the_new_executor_and_is_replicated(
    tandem_cluster: ClusterHandle,
) -> None:
    with tandem_kernel() as (km, kc):
        hosts = _replica_hosts(tandem_cluster, km.kernel_id)
        assert len(hosts) >= 2, f"replicas on {hosts}: an executor change needs two hosts"
        first, second = hosts[0], hosts[1]
        made = _on(
            tandem_cluster,
            kc,
            first,
            "import ipywidgets as widgets\nslider = widgets.IntSlider(value=3, max=10)\nprint(slider.model_id)",
        )
        model_id = made.stdout.strip()
        assert _on(tandem_cluster, kc, second, "print(slider.value, slider.model_id)").stdout.split() == [
            "3",
            model_id,
        ]

        # the user drags the slider to 7: JupyterLab's comm_msg, routed to the new executor
        drag = kc.session.msg(
            "comm_msg",
            {"comm_id": model_id, "data": {"method": "update", "state": {"value": 7}, "buffer_paths": []}},
        )
        kc.shell_channel.send(drag)
        echoed = [
            m["content"]["data"]
            for m in _iopub_until_idle(kc, drag["header"]["msg_id"])
            if m["msg_type"] == "comm_msg" and m["content"]["comm_id"] == model_id
        ]
        assert echoed and echoed[0]["method"] == "echo_update" and echoed[0]["state"] == {"value": 7}

        info = kc.comm_info(target_name="jupyter.widget", reply=True, timeout=20)
        assert model_id in info["content"]["comms"], info["content"]

        assert _on(tandem_cluster, kc, second, "print(slider.value)").stdout.strip() == "7"
        # the first replica got the drag through the log, and takes the comm over as it executes
        moved = _on(tandem_cluster, kc, first, "print(slider.value)\nslider.value = 9")
        assert moved.stdout.strip() == "7"
        assert _on(tandem_cluster, kc, second, "print(slider.value)").stdout.strip() == "9"
