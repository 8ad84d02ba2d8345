"""The provisioner and kernelspec through jupyter_client's own KernelManager.

The cluster behind the gateway is the scheduler test double, so what is checked here is the
provisioner's contract with jupyter_client: start, is_alive, restart, interrupt, shutdown, and a
kernel that died for good reported dead instead of silently auto-restarted.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from _gateway_double import Harness
from jupyter_client import KernelManager

from services import kernelspec
from services.provisioner import (
    TandemConfigError,
    forget_session,
    read_session,
    recorded_kernels,
    resource_request,
    session_path,
)


@pytest.fixture
def cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Harness]:
    harness = Harness()
    state = tmp_path / "state"
    state.mkdir()
    (state / "cluster.json").write_text(
        json.dumps(
            {
                "gateway": harness.api_address,
                "scheduler": "tcp://127.0.0.1:1",
                "pid": os.getpid(),
                "keys_dir": str(harness.keys_dir),
            }
        )
    )
    kernelspec.install(prefix=str(tmp_path / "prefix"))
    monkeypatch.setenv("TANDEM_STATE_DIR", str(state))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "prefix" / "share" / "jupyter"))
    for var in ("TANDEM_GPUS", "TANDEM_MILLICPUS", "TANDEM_MEMORY_MB", "TANDEM_VRAM_GB"):
        monkeypatch.delenv(var, raising=False)
    yield harness
    harness.close()


def test_resource_request_env_overrides_spec_config() -> None:
    spec = {"gpus": 1, "millicpus": 1000, "memory_mb": 2048, "vram_gb": 8}
    got = resource_request(spec, {"TANDEM_GPUS": "2", "TANDEM_VRAM_GB": "12.5"})
    assert (got.gpus, got.millicpus, got.memory_mb, got.vram_gb) == (2, 1000, 2048, 12.5)


@pytest.mark.parametrize(
    ("var", "value", "message"),
    [
        ("TANDEM_GPUS", "two", "TANDEM_GPUS='two': must be a whole number"),
        ("TANDEM_MILLICPUS", "1.5", "must be a whole number"),
        ("TANDEM_MEMORY_MB", "-5", "memory_mb must be >= 0"),
        ("TANDEM_VRAM_GB", "lots", "must be a number"),
    ],
)
def test_bad_resource_variables_are_refused_clearly(var: str, value: str, message: str) -> None:
    with pytest.raises(TandemConfigError, match=message):
        resource_request({"gpus": 1}, {var: value})


def test_kernelspec_shape() -> None:
    spec = kernelspec.kernel_json()
    assert spec["display_name"] == "Tandem (replicated)"
    assert spec["interrupt_mode"] == "message"
    assert spec["language"] == "python"
    assert spec["metadata"]["kernel_provisioner"] == {
        "provisioner_name": "tandem-provisioner",
        "config": {"gpus": 1, "millicpus": 1000, "memory_mb": 2048, "vram_gb": 8},
    }


def test_no_cluster_gives_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kernelspec.install(prefix=str(tmp_path / "prefix"))
    monkeypatch.setenv("TANDEM_STATE_DIR", str(tmp_path / "nowhere"))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "prefix" / "share" / "jupyter"))
    km = KernelManager(kernel_name="tandem")
    with pytest.raises(RuntimeError, match=r"no Tandem cluster is running.*tandem up"):
        km.start_kernel()


def test_bad_env_gives_a_clear_error(cluster: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_GPUS", "many")
    km = KernelManager(kernel_name="tandem")
    with pytest.raises(RuntimeError, match="TANDEM_GPUS='many'"):
        km.start_kernel()


def test_start_execute_restart_shutdown(cluster: Harness, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_GPUS", "2")
    km = KernelManager(kernel_name="tandem")
    km.start_kernel()
    try:
        assert km.is_alive()
        kernel_id = km.kernel_id
        assert cluster.scheduler.started == [kernel_id]
        assert cluster.scheduler.start_bodies[-1]["resources"]["gpus"] == 2
        client = km.client()
        client.start_channels()
        client.wait_for_ready(timeout=10)
        assert client.execute_interactive("1 + 1", timeout=10)["content"]["status"] == "ok"
        ports = km.get_connection_info()["shell_port"]
        km.interrupt_kernel()  # interrupt_mode message: an interrupt_request on control
        km.restart_kernel()
        assert cluster.scheduler.started == [kernel_id, kernel_id]
        assert km.get_connection_info()["shell_port"] == ports  # clients keep working across restarts
        assert client.execute_interactive("2 + 2", timeout=10)["content"]["status"] == "ok"
        client.stop_channels()
    finally:
        km.shutdown_kernel()
    assert not km.is_alive()
    status = cluster.call(cluster.api("kernel.status", {"kernel_id": kernel_id})).body
    assert status["state"] == "stopped"
    msg_types = [_msg_type(r) for r in cluster.scheduler.requests if r["channel"] == "control"]
    assert "interrupt_request" in msg_types and "shutdown_request" in msg_types


def test_dead_kernel_is_reported_dead_not_auto_restarted(cluster: Harness) -> None:
    km = KernelManager(kernel_name="tandem")
    km.start_kernel()
    dead_events: list[str] = []
    try:
        assert km._restarter is None or km._restarter.restart_limit > 0
        cluster.scheduler.dead = True  # the gateway's liveness poll learns it
        deadline = time.time() + 5
        while time.time() < deadline and km.is_alive():
            time.sleep(0.1)
        assert not km.is_alive()
        restarter: Any = km._restarter
        if restarter is not None:
            restarter.add_callback(lambda: dead_events.append("dead"), "dead")
            restarter.poll()
            assert dead_events == ["dead"]
        assert cluster.scheduler.started == [km.kernel_id]  # no auto-restart
    finally:
        km.shutdown_kernel(now=True)


def _msg_type(request: dict[str, Any]) -> str:
    return json.loads(request["frames"][1])["msg_type"]


def test_a_kernel_the_operator_stopped_is_not_auto_restarted(cluster: Harness) -> None:
    from jupyter_client.ioloop import IOLoopKernelManager

    km = IOLoopKernelManager(kernel_name="tandem")
    km.start_kernel()
    events: list[str] = []
    try:
        restarter: Any = km._restarter
        assert restarter is not None and restarter.restart_limit > 0
        restarter.add_callback(lambda: events.append("dead"), "dead")
        cluster.call(cluster.api("kernel.shutdown", {"kernel_id": km.kernel_id, "by": "operator"}))
        restarter.poll()  # what its periodic callback does
        assert events == ["dead"] and restarter.restart_limit == 0
        assert cluster.scheduler.started == [km.kernel_id]  # not started again
    finally:
        km.shutdown_kernel(now=True)


def test_session_records_are_read_only_when_they_name_their_kernel(tmp_path: Path) -> None:
    sessions = str(tmp_path / "sessions")
    assert read_session(sessions, "k1") is None and recorded_kernels(sessions) == []
    (tmp_path / "sessions").mkdir()
    session_path(sessions, "k1").write_text('{"kernel_id": "k1", "key": "s"}')
    session_path(sessions, "k2").write_text('{"kernel_id": "k9"}')  # copied under another name
    session_path(sessions, "k3").write_text("not json")
    assert recorded_kernels(sessions) == ["k1", "k2", "k3"]
    assert read_session(sessions, "k1") == {"kernel_id": "k1", "key": "s"}
    assert read_session(sessions, "k2") is None and read_session(sessions, "k3") is None
    forget_session(sessions, "k1")
    forget_session(sessions, "k1")  # already gone: nothing to do
    assert recorded_kernels(sessions) == ["k2", "k3"]
