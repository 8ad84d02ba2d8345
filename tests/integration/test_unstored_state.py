"""No ``ok`` without durability: a cell whose state the data store would not take says so.

The cluster's local data store is made unwritable the way a root test process can (root ignores
``chmod``): its ``tmp/`` directory, where every write starts, is replaced by a regular file, so
each write fails with ``NotADirectoryError`` as it would on a read-only or vanished volume. The
replicas opened the store before, as they would have in a session whose disk went bad.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from _cluster import ClusterHandle
from _kernels import run, tandem_kernel
from _signals import signal_ours

pytestmark = pytest.mark.integration

FIVE_MB_ARRAY = "big = np.arange(5 * 2**20 // 8, dtype=np.float64)"
BIG_SUM = float(sum(range(5 * 2**20 // 8)))


@contextmanager
def unwritable_store(cluster: ClusterHandle) -> Iterator[Path]:
    """The cluster's data store refuses every write until the block ends (or ``restore``)."""
    tmp = cluster.state_dir / "datastore" / "tmp"
    assert tmp.is_dir(), f"the local data store is not at {tmp.parent}"
    for _ in range(50):  # a replica opening the store meanwhile creates tmp/ again: once more
        aside = tmp.with_name(f"tmp.{uuid.uuid4().hex}")
        with contextlib.suppress(FileNotFoundError):
            os.rename(tmp, aside)
        shutil.rmtree(aside, ignore_errors=True)
        try:
            os.close(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            break
        except FileExistsError:
            continue
    assert tmp.is_file()
    try:
        yield tmp
    finally:
        restore(tmp)


def restore(tmp: Path) -> None:
    if not tmp.is_dir():
        tmp.unlink(missing_ok=True)
        tmp.mkdir()


def _settle(kc, setup: str) -> str:  # type: ignore[no-untyped-def]
    """Run ``setup``, then cells until the scheduler keeps offering them to one replica (it
    prefers the Raft leader, which it learns of after the first cells), and give the standbys
    time to load the setup's objects from the store while it works. Returns that replica."""
    assert run(kc, setup).status == "ok"
    seen: list[str] = []
    for _ in range(10):
        seen.append(run(kc, "pass").tandem["replica_id"])
        if len(seen) >= 3 and len(set(seen[-3:])) == 1:
            break
    time.sleep(0.5)
    return seen[-1]


def _pid(kc) -> int:  # type: ignore[no-untyped-def]
    cell = run(kc, "print('pid', os.getpid())")
    assert cell.status == "ok", cell.reply["content"]
    return int(_line(cell.stdout, "pid")[1])


def _line(output: str, first: str) -> list[str]:
    """The words of the output line starting with ``first`` (Tandem's warnings surround it)."""
    return next(line.split() for line in output.splitlines() if line.startswith(first + " "))


def test_unstored_variable_is_named_on_the_cell_and_protected_once_the_store_works_again(
    tandem_cluster: ClusterHandle,
) -> None:
    with tandem_kernel() as (_km, kc):
        replica = _settle(kc, "import os\nimport numpy as np\nopened = np.zeros(300_000)")
        with unwritable_store(tandem_cluster) as tmp:
            made = run(kc, FIVE_MB_ARRAY)
            assert made.status == "ok", made.reply["content"]  # the cell ran; its value is right here
            assert "NOT protected" in made.stdout and "'big'" in made.stdout, made.stdout
            assert "NotADirectoryError" in made.stdout, made.stdout
            later = run(kc, "small = 1")
            assert later.status == "ok"
            assert "NOT protected" in later.stdout and "'big'" in later.stdout, later.stdout
            restore(tmp)
            time.sleep(1.5)  # past the retry backoff after two failed attempts (at once, then 1 s)
            stored = run(kc, "n = 3")
            assert stored.status == "ok"
            assert "NOT protected" not in stored.stdout, stored.stdout
            quiet = run(kc, "n += 1")
            assert "NOT protected" not in quiet.stdout, quiet.stdout
            ran_on = {c.tandem["replica_id"] for c in (made, later, stored, quiet)}
            assert ran_on == {replica}, ran_on  # no executor change: that is the other test
        executor = _pid(kc)
        assert signal_ours(executor, signal.SIGKILL)
        after = run(kc, "print('got', big.sum(), n, os.getpid())", timeout=30)
        assert after.status == "ok", after.reply["content"]
        total, n, pid = _line(after.stdout, "got")[1:]
        assert float(total) == BIG_SUM and n == "4" and int(pid) != executor
        assert "WARNING" not in after.stdout, after.stdout


def test_a_tensor_whose_background_image_fails_is_named_and_stored_again(
    tandem_cluster: ClusterHandle,
) -> None:
    """With torch imported a large tensor is copied after the reply (kernel_replica/state_image.py):
    an image the store refuses is told on a cell all the same, and stored once the store works."""
    with tandem_kernel() as (_km, kc):
        _settle(kc, "import os\nimport torch\nopened = torch.zeros(300_000)")
        with unwritable_store(tandem_cluster) as tmp:
            made = run(kc, "big = torch.arange(5 * 2**20 // 8, dtype=torch.float64)")
            assert made.status == "ok", made.reply["content"]
            later = run(kc, "small = 1")
            told = made.stdout + later.stdout
            assert "NOT protected" in told and "'big'" in told and "NotADirectoryError" in told, told
            restore(tmp)
            time.sleep(1.5)  # past the retry backoff
            stored = run(kc, "n = 3")
            assert "'big' now protected" in stored.stdout or "'big'" not in stored.stdout, stored.stdout
            quiet = run(kc, "n += 1")
            assert "NOT protected" not in quiet.stdout, quiet.stdout
        executor = _pid(kc)
        assert signal_ours(executor, signal.SIGKILL)
        after = run(kc, "print('got', big.sum().item(), os.getpid())", timeout=30)
        assert after.status == "ok", after.reply["content"]
        total, pid = _line(after.stdout, "got")[1:]
        assert float(total) == BIG_SUM and int(pid) != executor
        assert "WARNING" not in after.stdout, after.stdout


def test_next_executor_names_the_variables_that_died_with_the_previous_one(
    tandem_cluster: ClusterHandle,
) -> None:
    with tandem_kernel() as (_km, kc):
        _settle(kc, "import os\nimport numpy as np\nkept = np.ones(300_000)")
        with unwritable_store(tandem_cluster):
            made = run(kc, FIVE_MB_ARRAY + "\nkept[0] = 7")
            assert made.status == "ok" and "'big'" in made.stdout and "'kept'" in made.stdout, made.stdout
            executor = _pid(kc)
            time.sleep(0.3)  # the cell's STATE, listing what it could not store, commits
            assert signal_ours(executor, signal.SIGKILL)
            after = run(kc, "print('got', 'big' in dir(), kept[0], os.getpid())", timeout=30)
        assert after.status == "ok", after.reply["content"]
        found, first, pid = _line(after.stdout, "got")[1:]
        assert int(pid) != executor and found == "False" and first == "1.0"
        assert "'big' is missing" in after.stdout, after.stdout
        assert "'kept' has an older value here" in after.stdout, after.stdout
        assert "NotADirectoryError" in after.stdout, after.stdout
        again = run(kc, "big = 1")
        assert "WARNING" not in again.stdout, again.stdout  # told once; its STATE cleared the marks


def test_unstored_variable_is_stored_in_the_background_when_no_cell_follows(
    tandem_cluster: ClusterHandle,
) -> None:
    """The executor is killed without any cell after the failed one: only its background
    attempts can have stored the variable the next executor finds."""
    with tandem_kernel() as (_km, kc):
        _settle(kc, "import os\nimport numpy as np\nopened = np.zeros(300_000)")
        pid = _pid(kc)
        with unwritable_store(tandem_cluster) as tmp:
            made = run(kc, FIVE_MB_ARRAY)
            assert made.status == "ok" and "'big'" in made.stdout and "NOT protected" in made.stdout
            time.sleep(1.0)  # attempts fail meanwhile, and back off
            restore(tmp)
            time.sleep(4.0)  # the next background attempt (at most 2 s after the last) stores it
        assert signal_ours(pid, signal.SIGKILL)
        after = run(kc, "print('got', big.sum(), os.getpid())", timeout=30)
        assert after.status == "ok", after.reply["content"]
        total, new_pid = _line(after.stdout, "got")[1:]
        assert float(total) == BIG_SUM and int(new_pid) != pid, after.stdout
        assert "WARNING" not in after.stdout and after.tandem["replica_id"] != made.tandem["replica_id"]


def test_former_executor_takes_the_logs_values_after_the_next_one_reported_them(
    tandem_cluster: ClusterHandle,
) -> None:
    """The executor changes while a value is unstored (its host is cordoned, it lives on): the
    new executor tells the user it has an older value; when the first executor runs cells
    again, it has that older value too, not the one it could not store."""
    with tandem_kernel() as (_km, kc):
        first = _settle(kc, "import os\nimport numpy as np\nkept = np.ones(300_000)")
        hosts = [h["id"] for h in tandem_cluster.status()["hosts"]]
        cordoned: list[str] = []
        try:
            with unwritable_store(tandem_cluster):
                made = run(kc, "kept[0] = 7")
                assert "'kept'" in made.stdout and "NOT protected" in made.stdout, made.stdout
                home = made.tandem["host_id"]
                time.sleep(0.3)  # its STATE, listing kept as unstored, commits
                assert tandem_cluster.cli("host", "cordon", home).returncode == 0
                cordoned.append(home)
                moved = run(kc, "print('got', kept[0])")
                assert moved.tandem["replica_id"] != first, moved.tandem
                assert (
                    "'kept' has an older value here" in moved.stdout
                    and _line(moved.stdout, "got")[1] == "1.0"
                )
            assert tandem_cluster.cli("host", "uncordon", home).returncode == 0
            cordoned.remove(home)
            for host in hosts:  # only the first executor's host is left to run cells
                if host != home:
                    assert tandem_cluster.cli("host", "cordon", host).returncode == 0
                    cordoned.append(host)
            back = run(kc, "print('got', kept[0])")
            assert back.tandem["replica_id"] == first, back.tandem
            assert _line(back.stdout, "got")[1] == "1.0" and "WARNING" not in back.stdout, back.stdout
        finally:
            for host in cordoned:
                tandem_cluster.cli("host", "uncordon", host)
