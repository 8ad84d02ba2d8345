"""Migration, draining and recovery on a small cluster of 4 hosts x 1 GPU (NotebookOS §3.2.3, §3.2.5).

Four one-GPU kernels share four one-GPU hosts, so a kernel whose three hosts are busy with other
kernels' cells can only run its cell after one of its replicas moves to the fourth host. Which
host a cell lands on is steered with cordons (a cordoned host cannot bind GPUs), and the cells of
the other kernels run until the test removes a flag file, so nothing here depends on timing.
The tests share one cluster and its four notebooks and run in file order.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import queue
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _cluster import WITHOUT_HTTP_API, ClusterHandle, running_cluster
from _kernels import CellResult, run, tandem_kernel
from _signals import signal_ours
from jupyter_client import BlockingKernelClient, KernelManager

from shared import messages

pytestmark = pytest.mark.integration

MIGRATION_DEADLINE_S = 6.0
# local schedulers report their GPU ledgers this often: settle() waits for a report sent after a
# cell's reply, so a shorter interval (default 1 s) shortens every settle
HEARTBEAT_S = 0.25
FAST_HEARTBEAT = ("--set", f"scheduler.heartbeat_interval_s={HEARTBEAT_S}")
Notebook = tuple[KernelManager, BlockingKernelClient]


@pytest.fixture(scope="module")
def small_cluster(
    tmp_path_factory: pytest.TempPathFactory, tandem_kernelspec: Path
) -> Iterator[ClusterHandle]:
    state_dir = tmp_path_factory.mktemp("tandem-migration")
    with running_cluster(
        state_dir,
        "--hosts", "4", "--gpus-per-host", "1",
        "--set", f"scheduler.migration_deadline_s={MIGRATION_DEADLINE_S}",
        "--set", "scheduler.heartbeat_timeout_s=3.0",
        *FAST_HEARTBEAT,
        *WITHOUT_HTTP_API,
    ) as handle:  # fmt: skip
        yield handle


@pytest.fixture(scope="module")
def notebooks(small_cluster: ClusterHandle) -> Iterator[list[Notebook]]:
    """Four one-GPU kernels (the [kernel] default), each with a variable to check later."""
    with contextlib.ExitStack() as stack:
        books = [stack.enter_context(tandem_kernel()) for _ in range(4)]
        for n, (_km, kc) in enumerate(books):
            settle(small_cluster)  # one GPU per host: the previous cell's must be back
            cell = run(kc, f"value = {n}", timeout=60)
            assert cell.status == "ok", cell.reply["content"]
        yield books


# ---- helpers ----------------------------------------------------------------------------------


def cluster_status(cluster: ClusterHandle) -> dict[str, Any]:
    return cluster.ask_scheduler(messages.CLUSTER_STATUS, {}, timeout=10.0)


def kernel_view(cluster: ClusterHandle, kernel_id: str) -> dict[str, Any]:
    return next(k for k in cluster_status(cluster)["kernels"] if k["id"] == kernel_id)


def live_hosts(kernel: dict[str, Any]) -> set[str]:
    return {r["host"] for r in kernel["replicas"] if r["alive"]}


def wait_for(predicate: Callable[[], Any], what: str, timeout: float = 60.0, poll_s: float = 0.2) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll_s)


def busy_hosts(cluster: ClusterHandle) -> set[str]:
    return {h["id"] for h in cluster_status(cluster)["hosts"] if h["committed"] > 0}


def settle(cluster: ClusterHandle, heartbeat_s: float = HEARTBEAT_S) -> None:
    """Until every GPU is free in the local schedulers' own ledgers: a replica gives its GPU back
    just after its reply, so the next heartbeat (every ``heartbeat_s``, the cluster's
    scheduler.heartbeat_interval_s) must show the ledger after that; 0.5 s more for it to arrive."""
    time.sleep(heartbeat_s + 0.5)
    wait_for(lambda: not busy_hosts(cluster), "every GPU idle", poll_s=0.1)


def set_cordon(cluster: ClusterHandle, host: str, cordoned: bool) -> None:
    kind = messages.HOST_CORDON if cordoned else messages.HOST_UNCORDON
    cluster.ask_scheduler(kind, {"host_id": host}, timeout=10.0)


def run_counted(
    kc: BlockingKernelClient, code: str, timeout: float = 60.0
) -> tuple[CellResult, Counter[str]]:
    """Run a cell as a front end does and count what the client got for it: replies, busy and
    idle, including duplicates that arrive after the idle."""
    result = CellResult(reply={})
    seen: Counter[str] = Counter()

    def on_iopub(msg: dict[str, Any]) -> None:
        kind, content = msg["msg_type"], msg["content"]
        if kind == "status":
            seen[content["execution_state"]] += 1
        elif kind == "stream":
            result.stdout += content["text"]
        elif kind == "error":
            result.errors.append(content)

    result.reply = kc.execute_interactive(code, timeout=timeout, output_hook=on_iopub)
    seen["execute_reply"] += 1
    msg_id = result.reply["parent_header"]["msg_id"]
    settle = time.monotonic() + 1.0
    while time.monotonic() < settle:
        with contextlib.suppress(queue.Empty):
            msg = kc.iopub_channel.get_msg(timeout=0.1)
            if msg["parent_header"].get("msg_id") == msg_id:
                on_iopub(msg)
        with contextlib.suppress(queue.Empty):
            msg = kc.shell_channel.get_msg(timeout=0.1)
            if msg["parent_header"].get("msg_id") == msg_id:
                seen[msg["msg_type"]] += 1
    return result, seen


class BackgroundCell:
    """A cell that holds its GPU until ``release()``: it waits for a flag file to appear."""

    def __init__(self, kc: BlockingKernelClient, flag: Path) -> None:
        self.flag = flag
        code = f"import os, time\nwhile not os.path.exists({str(flag)!r}):\n    time.sleep(0.05)\nprint('released')"
        self.result: CellResult | None = None
        self.error: BaseException | None = None

        def work() -> None:
            try:
                self.result = run(kc, code, timeout=180)
            except BaseException as exc:
                self.error = exc

        self.thread = threading.Thread(target=work, daemon=True)
        self.thread.start()

    def release(self) -> CellResult:
        self.flag.touch()
        self.thread.join(timeout=120)
        assert self.error is None, repr(self.error)
        assert self.result is not None, "the background cell did not finish"
        return self.result


def occupy(
    cluster: ClusterHandle, books: list[Notebook], hosts: list[str], flag: Path
) -> list[BackgroundCell]:
    """Make each of ``hosts`` busy with a cell of a different notebook of ``books``: every other
    host is cordoned while a notebook's cell starts, so its executor can only be on that host."""
    views = {km.kernel_id: live_hosts(kernel_view(cluster, km.kernel_id)) for km, _ in books}
    plan = next(
        (
            order
            for order in itertools.permutations(books, len(hosts))
            if all(h in views[km.kernel_id] for (km, _), h in zip(order, hosts, strict=True))
        ),
        None,
    )
    assert plan is not None, f"no notebook has a replica on each of {hosts}: {views}"
    all_hosts = [h["id"] for h in cluster_status(cluster)["hosts"]]
    cells = []
    for (_km, kc), host in zip(plan, hosts, strict=True):
        others = [h for h in all_hosts if h != host]
        for other in others:
            set_cordon(cluster, other, True)
        try:
            cells.append(BackgroundCell(kc, flag))
            wait_for(lambda host=host: host in busy_hosts(cluster), f"a cell holding {host}'s GPU")
        finally:
            for other in others:
                set_cordon(cluster, other, False)
    return cells


# ---- tests ------------------------------------------------------------------------------------


def test_cell_runs_through_migration_when_every_replica_host_is_busy(
    small_cluster: ClusterHandle, notebooks: list[Notebook], tmp_path: Path
) -> None:
    mover_km, mover_kc = notebooks[0]
    mover = kernel_view(small_cluster, mover_km.kernel_id)
    own_hosts = sorted(live_hosts(mover))
    all_hosts = {h["id"] for h in cluster_status(small_cluster)["hosts"]}
    (free_host,) = all_hosts - set(own_hosts)
    settle(small_cluster)
    others = occupy(small_cluster, notebooks[1:], own_hosts, tmp_path / "release")
    try:
        cell, seen = run_counted(
            mover_kc, "import os; value += 10; print(value, os.environ['TANDEM_HOST_ID'])", timeout=120
        )
        assert cell.status == "ok", cell.reply["content"]
        assert cell.stdout.split() == ["10", free_host]  # state followed the replica to the new host
        assert seen == Counter({"execute_reply": 1, "busy": 1, "idle": 1}), seen
    finally:
        results = [c.release() for c in others]
    assert all(r.status == "ok" and r.stdout.strip() == "released" for r in results), [
        r.reply["content"] for r in results
    ]

    status = small_cluster.cli("status", "--json")
    assert status.returncode == 0, status.stderr
    report = json.loads(status.stdout)
    moved = next(k for k in report["kernels"] if k["id"] == mover_km.kernel_id)
    assert moved["migrations"] == 1
    assert moved["last_migration"]["to"] == free_host
    assert moved["last_migration"]["from"] in own_hosts
    assert len(moved["replicas"]) == 3 and live_hosts(moved) == set(own_hosts) - {
        moved["last_migration"]["from"]
    } | {free_host}
    assert report["migrations"] >= 1


def test_cell_fails_clearly_when_no_host_can_take_a_replica_before_the_deadline(
    small_cluster: ClusterHandle, notebooks: list[Notebook], tmp_path: Path
) -> None:
    settle(small_cluster)
    hosts = sorted(h["id"] for h in cluster_status(small_cluster)["hosts"])
    cells = occupy(small_cluster, notebooks, hosts, tmp_path / "release")
    try:
        with tandem_kernel() as (km, kc):
            # An interrupt ends a cell that waits for a migration, as it ends a running one.
            interrupted = kc.execute("print('ran')")
            wait_for(lambda: kernel_view(small_cluster, km.kernel_id)["held_requests"] == 1, "the cell held")
            km.interrupt_kernel()
            reply = kc.get_shell_msg(timeout=30)
            assert reply["parent_header"]["msg_id"] == interrupted
            assert reply["content"]["ename"] == "KeyboardInterrupt", reply["content"]
            while not (
                (msg := kc.get_iopub_msg(timeout=10))["msg_type"] == "status"
                and msg["parent_header"].get("msg_id") == interrupted
                and msg["content"]["execution_state"] == "idle"
            ):
                pass
            # Nowhere to go until the deadline: the cell fails, saying why.
            started = time.monotonic()
            cell, seen = run_counted(kc, "print('ran')", timeout=60)
            waited = time.monotonic() - started
            assert cell.status == "error"
            assert cell.reply["content"]["ename"] == "MigrationFailed", cell.reply["content"]
            assert "deadline" in cell.reply["content"]["evalue"]
            assert "ran" not in cell.stdout
            assert seen == Counter({"execute_reply": 1, "busy": 1, "idle": 1}), seen
            assert waited < MIGRATION_DEADLINE_S + 30
    finally:
        results = [c.release() for c in cells]
    assert all(r.status == "ok" for r in results), [r.reply["content"] for r in results]


def test_drain_moves_every_replica_off_the_host(
    small_cluster: ClusterHandle, notebooks: list[Notebook]
) -> None:
    settle(small_cluster)
    counts = Counter(
        r["host"] for k in cluster_status(small_cluster)["kernels"] for r in k["replicas"] if r["alive"]
    )
    host = counts.most_common(1)[0][0]
    unknown = small_cluster.cli("host", "drain", "no-such-host")
    assert unknown.returncode == 1 and "unknown host 'no-such-host'" in unknown.stderr, unknown.stderr
    drained = small_cluster.cli("host", "drain", host, timeout=240)
    try:
        assert drained.returncode == 0, drained.stdout + drained.stderr
        assert "0 replicas left" in drained.stdout
        report = cluster_status(small_cluster)
        assert next(h for h in report["hosts"] if h["id"] == host)["cordoned"]
        for km, kc in notebooks:
            view = next(k for k in report["kernels"] if k["id"] == km.kernel_id)
            assert host not in live_hosts(view) and len(live_hosts(view)) == 3, view
            settle(small_cluster)
            cell = run(kc, "print(value)", timeout=60)
            assert cell.status == "ok", cell.reply["content"]
    finally:
        set_cordon(small_cluster, host, False)


def test_killing_a_local_scheduler_re_places_its_replicas(
    small_cluster: ClusterHandle, notebooks: list[Notebook]
) -> None:
    settle(small_cluster)
    report = cluster_status(small_cluster)
    counts = Counter(r["host"] for k in report["kernels"] for r in k["replicas"] if r["alive"])
    victim = counts.most_common(1)[0][0]
    pid = json.loads((small_cluster.state_dir / "cluster.json").read_text())["processes"][victim]
    before = {}
    for km, kc in notebooks:
        settle(small_cluster)
        before[km.kernel_id] = int(run(kc, "print(value)").stdout)
    assert signal_ours(pid, signal.SIGKILL)

    def re_placed() -> bool:
        kernels = {k["id"]: k for k in cluster_status(small_cluster)["kernels"]}
        return all(
            victim not in live_hosts(kernels[km.kernel_id]) and len(live_hosts(kernels[km.kernel_id])) == 3
            for km, _ in notebooks
        )

    wait_for(re_placed, f"the replicas of {victim} to be re-placed", timeout=120)
    for km, kc in notebooks:
        settle(small_cluster)
        cell = run(kc, "value += 1; print(value)", timeout=60)
        assert cell.status == "ok", cell.reply["content"]
        assert int(cell.stdout) == before[km.kernel_id] + 1
    moved = [k for k in cluster_status(small_cluster)["kernels"] if k["id"] in before and k["migrations"]]
    assert moved, "status shows no replacement"


def signal_hosts(pids: list[int], signum: int) -> None:
    for pid in pids:
        signal_ours(pid, signum)  # not a host killed by an earlier test: its pid may be anyone's now


def test_restarting_the_global_scheduler_loses_no_kernel(
    small_cluster: ClusterHandle, notebooks: list[Notebook], tmp_path: Path
) -> None:
    before = {}
    for km, kc in notebooks:
        settle(small_cluster)
        before[km.kernel_id] = int(run(kc, "print(value)").stdout)
    cluster_file = small_cluster.state_dir / "cluster.json"
    old_pid = json.loads(cluster_file.read_text())["processes"]["global-scheduler"]
    settle(small_cluster)
    running = BackgroundCell(notebooks[0][1], tmp_path / "release")  # runs across the restart
    wait_for(lambda: busy_hosts(small_cluster), "the cell running")
    host_pids = [
        pid
        for name, pid in json.loads(cluster_file.read_text())["processes"].items()
        if name.startswith("host-")
    ]
    assert signal_ours(old_pid, signal.SIGKILL)  # a host died earlier: the restart must not mind
    # A cell sent before the kernel's hosts have registered with the new scheduler: it is kept
    # until the kernel is adopted, then run. The hosts' local schedulers are held stopped from
    # before the new scheduler exists, or they may register with it (a heartbeat is 0.25 s) before
    # the cell is sent, and the cell takes the ordinary path.
    signal_hosts(host_pids, signal.SIGSTOP)
    sent_meanwhile: queue.Queue[CellResult] = queue.Queue()
    try:

        def restarted() -> bool:
            with contextlib.suppress(OSError, ValueError, KeyError):
                return json.loads(cluster_file.read_text())["processes"]["global-scheduler"] != old_pid
            return False

        wait_for(restarted, "tandem up to restart the global scheduler")
        threading.Thread(
            target=lambda: sent_meanwhile.put(run(notebooks[1][1], "print(value * 10)", timeout=90)),
            daemon=True,
        ).start()
        wait_for(
            lambda: "request_kept_until_adopted" in small_cluster.log_text("global-scheduler"),
            "the new scheduler to keep the cell of a kernel it has not adopted yet",
            timeout=20,
        )
    finally:
        signal_hosts(host_pids, signal.SIGCONT)

    def every_kernel_back() -> bool:
        with contextlib.suppress(Exception):
            kernels = {k["id"]: k for k in cluster_status(small_cluster)["kernels"]}
            return all(
                km.kernel_id in kernels and len(live_hosts(kernels[km.kernel_id])) == 3 for km, _ in notebooks
            )
        return False

    wait_for(every_kernel_back, "the hosts to re-register every kernel's replicas")
    finished = running.release()  # its output and reply reach the client through the new scheduler
    assert finished.status == "ok" and finished.stdout.strip() == "released", finished.reply["content"]
    meanwhile = sent_meanwhile.get(timeout=90)
    assert meanwhile.status == "ok", meanwhile.reply["content"]
    assert int(meanwhile.stdout) == before[notebooks[1][0].kernel_id] * 10
    for km, kc in notebooks:
        assert km.is_alive()
        settle(small_cluster)
        cell = run(kc, "value += 100; print(value)", timeout=60)
        assert cell.status == "ok", cell.reply["content"]
        assert int(cell.stdout) == before[km.kernel_id] + 100


def test_a_cell_held_for_a_migration_survives_a_scheduler_restart(
    small_cluster: ClusterHandle, notebooks: list[Notebook], tmp_path: Path
) -> None:
    """Every host busy: a new kernel's cell is held for a migration, and only the scheduler knows
    it. The scheduler is killed; its successor reads the held queue back (held_journal.py) when
    it adopts the kernel and runs the cell once a GPU is free, exactly once."""
    settle(small_cluster)
    hosts = sorted(h["id"] for h in cluster_status(small_cluster)["hosts"] if h["alive"])
    occupiers = occupy(small_cluster, notebooks, hosts, tmp_path / "release")
    cluster_file = small_cluster.state_dir / "cluster.json"
    released = False
    try:
        with tandem_kernel() as (km, kc):
            held_msg = kc.execute("print('ran once')")
            wait_for(lambda: kernel_view(small_cluster, km.kernel_id)["held_requests"] == 1, "the cell held")
            held_log = small_cluster.state_dir / "scheduler" / "held" / f"{km.kernel_id}.held.log"
            wait_for(held_log.exists, "the held cell written (in the background) to the journal")
            old_pid = json.loads(cluster_file.read_text())["processes"]["global-scheduler"]
            assert signal_ours(old_pid, signal.SIGKILL)

            def restored() -> bool:
                with contextlib.suppress(Exception):
                    if json.loads(cluster_file.read_text())["processes"]["global-scheduler"] == old_pid:
                        return False
                    return kernel_view(small_cluster, km.kernel_id)["held_requests"] == 1
                return False

            wait_for(restored, "the new scheduler to hold the cell again")
            results = [c.release() for c in occupiers]
            released = True
            assert all(r.status == "ok" for r in results), [r.reply["content"] for r in results]
            reply = kc.get_shell_msg(timeout=90)
            assert reply["parent_header"]["msg_id"] == held_msg
            assert reply["content"]["status"] == "ok", reply["content"]
            printed = ""
            while True:
                msg = kc.get_iopub_msg(timeout=30)
                if msg["parent_header"].get("msg_id") != held_msg:
                    continue
                if msg["msg_type"] == "stream":
                    printed += msg["content"]["text"]
                if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                    break
            assert printed == "ran once\n"
            again = run(kc, "print('next')", timeout=60)
            assert again.status == "ok" and again.stdout == "next\n", again.reply["content"]
    finally:
        if not released:
            for cell in occupiers:
                cell.release()
