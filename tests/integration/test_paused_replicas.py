"""At most once under pauses: SIGSTOP the replica a cell goes to (the last executor, often also
the Raft leader) for longer than the takeover timeouts, then SIGCONT it. The others run the cell;
the resumed replica must learn that from the committed log and never run it too. Before the fix a
designated Raft leader started the cell before its LEAD committed, and each paused cell ran twice
(3 of 3 runs), after the client already had ``ok``."""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from _cluster import WITHOUT_HTTP_API, ClusterHandle, running_cluster
from _kernels import run, tandem_kernel
from _signals import signal_ours
from jupyter_client import BlockingKernelClient

pytestmark = pytest.mark.integration

PAUSED_CELLS = 20
KERNELS = 2  # the paused cells are split between kernels that run side by side
CANDIDATE_SILENCE_S = 0.5  # the scheduler gives the cell to the others after this much silence
PAUSE_S = 1.5  # longer than that, a Raft election and the takeover's own election together
EXECUTOR_SILENCE_S = 2.5  # standbys give up on a silent executor's running cell after this


@pytest.fixture(scope="module")
def pausing_cluster(
    tmp_path_factory: pytest.TempPathFactory, tandem_kernelspec: Path
) -> Iterator[ClusterHandle]:
    """One cluster for both tests: each pauses the replicas of a kernel of its own (and resumes
    every one it paused), so neither leaves the other anything but an idle cluster."""
    with running_cluster(
        tmp_path_factory.mktemp("pausing-state"),
        "--hosts", "3",
        "--set", f"scheduler.candidate_silence_s={CANDIDATE_SILENCE_S}",
        "--set", f"election.executor_silence_s={EXECUTOR_SILENCE_S}",
        *WITHOUT_HTTP_API,
    ) as handle:  # fmt: skip
        yield handle


def _append(path: Path, line: str) -> str:
    return f"import os\nopen({str(path)!r}, 'a').write({line!r} + '\\n')\nprint(os.getpid())"


def _paused(pid: int, seconds: float) -> threading.Timer:
    assert signal_ours(pid, signal.SIGSTOP)
    timer = threading.Timer(seconds, signal_ours, (pid, signal.SIGCONT))
    timer.start()
    return timer


def _cells_sent_to_paused_executors(kc: BlockingKernelClient, ledger: Path, count: int) -> dict[str, str]:
    """``count`` cells, each sent while the kernel's last executor is paused for ``PAUSE_S``; each
    cell's status by the line it appends to ``ledger`` when it runs."""
    answered: dict[str, str] = {}
    first = run(kc, _append(ledger, "warm-up"), timeout=30)
    assert first.status == "ok", first.errors
    executor = int(first.stdout.strip())
    for i in range(count):
        timer = _paused(executor, PAUSE_S)
        try:
            cell = run(kc, _append(ledger, f"cell-{i}"), timeout=60)
        finally:
            timer.join()
            signal_ours(executor, signal.SIGCONT)  # never leave a process stopped
        answered[f"cell-{i}"] = cell.status
        if cell.status == "ok":
            executor = int(cell.stdout.strip())
        time.sleep(0.2)  # the resumed replica reads the cell it was sent, and the log
    time.sleep(PAUSE_S)  # anything a resumed replica might still run would be written by now
    after = run(kc, _append(ledger, "after"), timeout=30)
    assert after.status == "ok", after.errors
    return answered


def test_a_cell_sent_to_a_paused_replica_runs_exactly_once(
    pausing_cluster: ClusterHandle, tmp_path: Path
) -> None:
    """PAUSED_CELLS in all, split between KERNELS kernels side by side: a pause is mostly waiting."""
    ledgers = [tmp_path / f"ledger-{n}.txt" for n in range(KERNELS)]
    with contextlib.ExitStack() as stack:
        clients = [stack.enter_context(tandem_kernel())[1] for _ in ledgers]
        with ThreadPoolExecutor(len(clients)) as pool:
            each = list(
                pool.map(
                    _cells_sent_to_paused_executors, clients, ledgers, [PAUSED_CELLS // KERNELS] * KERNELS
                )
            )
    for ledger, answered in zip(ledgers, each, strict=True):
        lines = Counter(ledger.read_text().split())
        duplicates = {line: n for line, n in lines.items() if n > 1}
        assert duplicates == {}, f"cells ran more than once: {duplicates}"
        for line, status in answered.items():
            # ok means it ran (once); an error reply means it did not run at all
            assert lines[line] == (1 if status == "ok" else 0), (line, status)
    statuses = [status for answered in each for status in answered.values()]
    assert len(statuses) == PAUSED_CELLS and statuses.count("ok") >= PAUSED_CELLS // 2, each


def test_a_cell_whose_executor_is_paused_inside_it_runs_once_and_the_kernel_goes_on(
    pausing_cluster: ClusterHandle, tmp_path: Path
) -> None:
    ledger = tmp_path / "ledger.txt"
    started = tmp_path / "started"
    with tandem_kernel() as (_km, kc):
        assert run(kc, "n = 0").status == "ok"
        for i in range(1):  # one: the paused replica then leaves and is replaced (no quorum to pause again)
            started.unlink(missing_ok=True)
            code = (
                f"import os, time\nopen({str(started)!r}, 'w').write(str(os.getpid()))\n"
                f"open({str(ledger)!r}, 'a').write('inside-{i}\\n')\ntime.sleep(1.0)\nn += 1"
            )
            result: dict[str, object] = {}
            worker = threading.Thread(target=lambda r=result, c=code: r.update(cell=run(kc, c, timeout=60)))
            worker.start()
            deadline = time.monotonic() + 30
            while not started.exists() or not started.read_text():
                assert time.monotonic() < deadline, "the cell never started"
                time.sleep(0.01)
            pid = int(started.read_text())
            timer = _paused(pid, EXECUTOR_SILENCE_S + 2.0)
            worker.join(60)
            timer.join()
            signal_ours(pid, signal.SIGCONT)
            cell = result["cell"]
            assert cell.status == "error" and cell.reply["content"]["ename"] == "ExecutorLost", cell.reply
            # no pause before the next cell: the resumed executor, leaving, declines what reaches it
        nxt = run(kc, "print(n)", timeout=30)
        assert nxt.status == "ok", nxt.errors
        assert nxt.stdout.strip() == "0"  # the lost cells' changes are not the group's state
    lines = Counter(ledger.read_text().split())
    assert lines == Counter({"inside-0": 1})
