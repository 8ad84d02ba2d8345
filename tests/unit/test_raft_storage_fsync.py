"""The WAL durability policy: without fsync nothing is fdatasync'd per write, a process crash loses
nothing, and a log that a machine reboot may have cut is refused (fenced by the boot id)."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kernel_replica.__main__ import stale_raft_log
from services.global_scheduler.cluster_state import RUNNING, KernelRecord, ReplicaRecord
from services.global_scheduler.jupyter_router import KernelRouter
from services.global_scheduler.service import GlobalScheduler
from shared import messages
from shared.config import DEFAULTS, load_config
from shared.envelope import Envelope
from shared.raft.driver import PeerConfig, RaftPeer
from shared.raft.storage import (
    FENCE_FILE,
    StaleLogAfterReboot,
    Storage,
    check_boot_fence,
    read_boot_id,
)
from shared.raft.types import Entry, EntryType, HardState, Snapshot, SnapshotMeta
from shared.resources import Resources


def boot(boot_id: str | None) -> Callable[[], str | None]:
    return lambda: boot_id


def entries(first: int, last: int, term: int = 1) -> list[Entry]:
    return [Entry(term, i, EntryType.NORMAL, bytes([i % 256]) * 8, f"p{i}") for i in range(first, last + 1)]


class SyncCalls:
    """Counts the real fdatasync/fsync calls of the process (the storage calls ``os.*`` directly)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.fdatasync = 0
        self.fsync = 0
        real_fdatasync, real_fsync = os.fdatasync, os.fsync

        def fdatasync(fd: int) -> None:
            self.fdatasync += 1
            real_fdatasync(fd)

        def fsync(fd: int) -> None:
            self.fsync += 1
            real_fsync(fd)

        monkeypatch.setattr(os, "fdatasync", fdatasync)
        monkeypatch.setattr(os, "fsync", fsync)

    def reset(self) -> None:
        self.fdatasync = self.fsync = 0


@pytest.fixture
def syncs(monkeypatch: pytest.MonkeyPatch) -> SyncCalls:
    return SyncCalls(monkeypatch)


def write_then_crash(directory: Path, *, fsync: bool, boot_id: str, last: int = 20) -> None:
    """Open, append one Ready per entry plus a vote, and die by SIGKILL: nothing closed or synced
    on the way out, exactly what a crashed replica process leaves behind."""

    def child() -> None:
        s = Storage(directory, fsync=fsync, boot_id=boot(boot_id))
        s.save([], HardState(3, "r2", 0))
        for i in range(1, last + 1):
            s.save(entries(i, i, term=3), HardState(3, "r2", i - 1))
        os.kill(os.getpid(), signal.SIGKILL)

    proc = multiprocessing.get_context("fork").Process(target=child)
    proc.start()
    proc.join(30)
    assert proc.exitcode == -signal.SIGKILL


def snapshot_of(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


# ---- no fdatasync on the write path ---------------------------------------------------------------


def test_without_fsync_wal_appends_are_written_but_never_fdatasynced(
    tmp_path: Path, syncs: SyncCalls
) -> None:
    s = Storage(tmp_path, fsync=False, boot_id=boot("boot-a"))
    syncs.reset()
    for i in range(1, 51):
        assert s.append(entries(i, i), HardState(1, "a", i - 1))  # the Ready still "needs" durability
        s.sync()
    assert (syncs.fdatasync, syncs.fsync) == (0, 0)
    assert s.last_index == 50 and s.fsync is False
    s.close()


def test_with_fsync_every_ready_with_entries_is_fdatasynced_once(tmp_path: Path, syncs: SyncCalls) -> None:
    s = Storage(tmp_path, fsync=True, boot_id=boot("boot-a"))
    syncs.reset()
    for i in range(1, 51):
        s.save(entries(i, i), HardState(1, "a", i - 1))
    assert syncs.fdatasync == 50
    assert not (tmp_path / FENCE_FILE).exists()
    s.close()


def test_snapshot_files_are_fsynced_even_without_wal_fsync(tmp_path: Path, syncs: SyncCalls) -> None:
    s = Storage(tmp_path, fsync=False, boot_id=boot("boot-a"))
    s.save(entries(1, 5), HardState(1, "a", 5))
    syncs.reset()
    s.write_snapshot_file(Snapshot(SnapshotMeta(5, 1), b"state"))
    assert syncs.fsync >= 2  # the file, then the directory after the rename
    assert syncs.fdatasync == 0
    s.close()


# ---- the boot-id fence ------------------------------------------------------------------------------


def test_a_crashed_process_reopened_in_the_same_boot_replays_everything(tmp_path: Path) -> None:
    write_then_crash(tmp_path, fsync=False, boot_id="boot-a")
    assert (tmp_path / FENCE_FILE).read_text().strip() == "boot-a"
    r = Storage(tmp_path, fsync=False, boot_id=boot("boot-a")).restored()
    assert [e.index for e in r.entries] == list(range(1, 21))
    assert r.hard_state == HardState(3, "r2", 19)


def test_a_log_written_without_fsync_is_refused_after_a_reboot(tmp_path: Path) -> None:
    write_then_crash(tmp_path, fsync=False, boot_id="boot-a")
    before = snapshot_of(tmp_path)
    for fsync in (False, True):  # turning fsync on now cannot bring back what the reboot lost
        with pytest.raises(StaleLogAfterReboot) as err:
            Storage(tmp_path, fsync=fsync, boot_id=boot("boot-b"))
        message = str(err.value)
        assert message.startswith(f"StaleLogAfterReboot: Raft log in {tmp_path} was written without fsync")
        assert "(boot boot-a, now boot-b)" in message
        assert "must be replaced, not restarted in place" in message
    with pytest.raises(StaleLogAfterReboot):
        check_boot_fence(tmp_path, boot("boot-b"))
    assert snapshot_of(tmp_path) == before  # a refused directory is left as it was, for inspection


def test_a_fenced_log_is_refused_where_no_boot_id_can_be_read(tmp_path: Path) -> None:
    write_then_crash(tmp_path, fsync=False, boot_id="boot-a")
    with pytest.raises(StaleLogAfterReboot, match=r"boot boot-a, now unknown"):
        Storage(tmp_path, fsync=True, boot_id=boot(None))


def test_a_log_written_with_fsync_opens_after_a_reboot(tmp_path: Path) -> None:
    write_then_crash(tmp_path, fsync=True, boot_id="boot-a")
    assert not (tmp_path / FENCE_FILE).exists()
    check_boot_fence(tmp_path, boot("boot-b"))
    for fsync in (True, False):
        s = Storage(tmp_path, fsync=fsync, boot_id=boot("boot-b"))
        assert s.last_index == 20 and s.hard_state.vote == "r2"
        s.close()


def test_a_clean_close_syncs_and_unfences_so_the_log_survives_a_reboot(tmp_path: Path) -> None:
    s = Storage(tmp_path, fsync=False, boot_id=boot("boot-a"))
    s.save(entries(1, 3), HardState(2, "r1", 2))
    assert (tmp_path / FENCE_FILE).exists()
    s.close()
    assert not (tmp_path / FENCE_FILE).exists()
    r = Storage(tmp_path, fsync=False, boot_id=boot("boot-b")).restored()
    assert len(r.entries) == 3 and r.hard_state.vote == "r1"


def test_reopening_with_fsync_in_the_same_boot_makes_the_log_durable_and_unfences_it(
    tmp_path: Path, syncs: SyncCalls
) -> None:
    write_then_crash(tmp_path, fsync=False, boot_id="boot-a")
    syncs.reset()
    s = Storage(tmp_path, fsync=True, boot_id=boot("boot-a"))
    assert syncs.fsync >= 1 and not (tmp_path / FENCE_FILE).exists()
    s.close()
    assert Storage(tmp_path, boot_id=boot("boot-b")).last_index == 20


def test_without_a_boot_id_no_fsync_falls_back_to_fsync_and_says_so(tmp_path: Path, syncs: SyncCalls) -> None:
    events: list[tuple[str, dict[str, Any]]] = []

    class Capture:
        def __getattr__(self, level: str) -> Callable[..., None]:
            return lambda event, **kw: events.append((event, kw))

    s = Storage(tmp_path, fsync=False, boot_id=boot(None), logger=Capture())
    assert s.fsync is True
    assert any(event == "raft.storage.fsync_forced" for event, _ in events)
    syncs.reset()
    s.save(entries(1, 1), None)
    assert syncs.fdatasync == 1 and not (tmp_path / FENCE_FILE).exists()
    s.close()


def test_a_raft_peer_refuses_to_start_on_a_stale_log(tmp_path: Path) -> None:
    (tmp_path / FENCE_FILE).write_text("a-boot-before-this-one\n")
    peer = RaftPeer(PeerConfig("r1", "tcp://127.0.0.1:0", tmp_path, bootstrap_voters=("r1",), fsync=False))
    with pytest.raises(StaleLogAfterReboot):
        asyncio.run(peer.start())


# ---- a replica on a stale log is replaced, never restarted in place --------------------------------


def test_a_replica_on_a_stale_log_refuses_before_it_registers(tmp_path: Path) -> None:
    assert stale_raft_log(tmp_path) is None  # a fresh data dir
    raft_dir = tmp_path / "raft"
    Storage(raft_dir, fsync=False).save(entries(1, 1), None)  # fenced by this very boot: fine
    if read_boot_id() is not None:
        assert stale_raft_log(tmp_path) is None
    (raft_dir / FENCE_FILE).write_text("a-boot-before-this-one\n")
    reason = stale_raft_log(tmp_path)
    assert reason is not None and reason.startswith("StaleLogAfterReboot: Raft log in")


def test_raft_fsync_defaults_to_off_and_reaches_the_replica_settings() -> None:
    from kernel_replica.raft_bridge import ReplicaSettings

    assert DEFAULTS["raft"]["fsync"] is False
    assert ReplicaSettings().raft_fsync is False
    assert load_config(overrides={"raft.fsync": True}).get("raft.fsync") is True


class Scheduler:
    """The global scheduler in process; what it sends is recorded instead of going on a socket."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.gs = GlobalScheduler(load_config(overrides={"scheduler.heartbeat_timeout_s": 5.0}))
        self.sent: list[tuple[bytes, Envelope]] = []
        self.gs._server.send = lambda identity, env: self.sent.append((identity, env))  # type: ignore[method-assign]

    def register(self, host: str, replicas: list[dict[str, Any]]) -> None:
        body = {
            "host_id": host,
            "resources": Resources(64_000, 262_144, 4, 160).to_dict(),
            "gpu_kind": "virtual",
            "replicas": replicas,
        }
        assert self.gs._handle(host.encode(), Envelope(messages.HOST_REGISTER, body)).type == messages.REPLY

    def close(self) -> None:
        tasks = asyncio.all_tasks(self.loop)
        for task in tasks:
            task.cancel()
        self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        self.gs._server._sock.close(linger=0)
        self.gs._ctx.destroy(linger=0)
        self.loop.close()


@pytest.fixture
def scheduler() -> Iterator[Scheduler]:
    s = Scheduler()
    yield s
    s.close()


def test_replicas_of_a_rebooted_host_are_replaced_by_fresh_members_not_restarted(
    scheduler: Scheduler,
) -> None:
    for host in ("h1", "h2", "h3", "h4"):
        scheduler.register(host, [])
    kernel = KernelRecord("k", "key", "hmac-sha256", Resources(gpus=1), KernelRouter("k", b"key"))
    kernel.state = RUNNING
    for n, host in enumerate(("h1", "h2", "h3"), start=1):
        kernel.replicas[f"r{n}"] = ReplicaRecord(f"r{n}", host, pid=100 + n, started=True)
    scheduler.gs.state.kernels["k"] = kernel

    scheduler.register("h1", [])  # h1 rebooted: its local scheduler is back, running none of them
    scheduler.loop.run_until_complete(asyncio.sleep(0.05))  # the replacement task runs

    assert kernel.replicas["r1"].alive is False
    to_hosts = [(identity, env.type, env.body) for identity, env in scheduler.sent]
    starts = [(identity, body) for identity, kind, body in to_hosts if kind == messages.REPLICA_START]
    assert starts == [(b"h4", starts[0][1])]
    new = starts[0][1]
    assert new["replica_id"] not in ("r1", "r2", "r3") and new["join"] is True  # a new member, new dir
    assert not any(kind == messages.REPLICA_RESTART for _, kind, _ in to_hosts)
