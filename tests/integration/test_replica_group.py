"""Three real replica processes, real Raft, real Jupyter clients; this test plays the local and
global schedulers' roles over the real protocol (a ROUTER answering register/gpu.commit/gpu.release,
replica.configure to bootstrap, and one jupyter_client per replica carrying the same msg_id)."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import zmq
from _cluster import eventually
from jupyter_client import BlockingKernelClient

from shared import messages
from shared.envelope import Envelope, decode
from shared.raft.tls import IDENTITY_ENV
from shared.raft.tls_ca import ClusterCA

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
REPLICAS = ("r1", "r2", "r3")
KERNEL_ID = "k-test"


class FakeLocalScheduler:
    """The local scheduler's replica ROUTER, on its own thread: answers replica requests, records
    events, and sends replica.configure on demand."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.linger = 0
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{port}"
        self.identities: dict[str, bytes] = {}
        self.raft_addresses: dict[str, str] = {}
        self.commits: list[tuple[str, str]] = []  # (replica_id, msg_id)
        self.releases: list[tuple[str, str]] = []
        self.events: list[dict[str, Any]] = []
        self._answers: dict[str, Envelope] = {}
        self._outbox: queue.Queue[tuple[bytes, Envelope]] = queue.Queue()
        self._changed = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self._stop:
            if poller.poll(10):
                ident, payload = self.sock.recv_multipart()
                env = decode(payload)
                answer = self._handle(ident, env)
                if answer is not None:
                    self.sock.send_multipart([ident, answer.encode()])
            while not self._outbox.empty():
                ident, env = self._outbox.get()
                self.sock.send_multipart([ident, env.encode()])

    def _handle(self, ident: bytes, env: Envelope) -> Envelope | None:
        body = env.body
        with self._changed:
            self._changed.notify_all()
            if env.type == messages.REPLICA_REGISTER:
                self.identities[body["replica_id"]] = ident
                self.raft_addresses[body["replica_id"]] = body["raft_address"]
                return env.reply()
            if env.type == messages.GPU_COMMIT:
                self.commits.append((body["replica_id"], body["msg_id"]))
                return env.reply({"device_ids": [int(body["replica_id"][1:])]})
            if env.type == messages.GPU_RELEASE:
                self.releases.append((body["replica_id"], body["msg_id"]))
                return env.reply()
            if env.type == messages.REPLICA_EVENT:
                self.events.append(body)
                return None
            self._answers[env.id] = env
            return None

    def wait_for(self, predicate: Any, timeout: float = 20.0, poll_s: float | None = None) -> None:
        deadline = time.monotonic() + timeout
        with self._changed:
            while not predicate():
                remaining = deadline - time.monotonic()
                assert remaining > 0, "timed out waiting for the replicas"
                self._changed.wait(remaining if poll_s is None else min(remaining, poll_s))

    def configure(self, replicas: tuple[str, ...] = REPLICAS) -> None:
        sent = []
        for rid in replicas:
            env = Envelope(
                messages.REPLICA_CONFIGURE,
                {"kernel_id": KERNEL_ID, "replica_id": rid, "peers": self.raft_addresses},
            )
            sent.append(env.id)
            self._outbox.put((self.identities[rid], env))
        self.wait_for(lambda: all(i in self._answers for i in sent), timeout=20)
        for i in sent:
            assert self._answers[i].type == messages.REPLY, self._answers[i].body

    def status(self, rid: str) -> dict[str, Any]:
        """The replica's view of its Raft group (``replica.membership status``)."""
        env = Envelope(
            messages.REPLICA_MEMBERSHIP,
            {"kernel_id": KERNEL_ID, "replica_id": rid, "action": "status"},
        )
        self._outbox.put((self.identities[rid], env))
        self.wait_for(lambda: env.id in self._answers, timeout=10)
        answer = self._answers.pop(env.id)
        assert answer.type == messages.REPLY, answer.body
        return answer.body

    def close(self) -> None:
        self._stop = True
        self._thread.join(2)
        self.sock.close()
        self.ctx.destroy(linger=0)


class Cluster:
    def __init__(self, tmp: Path, config: dict[str, Any] | None = None) -> None:
        self.tmp = tmp
        self.config = config or {}
        self.scheduler = FakeLocalScheduler()
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.clients: dict[str, BlockingKernelClient] = {}
        self.alive: tuple[str, ...] = REPLICAS
        self.raft_ca = ClusterCA.create()  # the global scheduler's role: each start gets a certificate
        key = os.urandom(16).hex()
        for rid in REPLICAS:
            # every port 0, as the local scheduler writes it: the replica binds and writes the
            # ports back before it registers (ports chosen here could be taken before its bind)
            ports = {f"{channel}_port": 0 for channel in ("shell", "iopub", "stdin", "control", "hb")}
            info = {"ip": "127.0.0.1", "transport": "tcp", "key": key, "signature_scheme": "hmac-sha256"}
            (tmp / f"{rid}.json").write_text(json.dumps(info | ports))
            self.launch(rid)
        self._wait_registered(REPLICAS)
        for rid in REPLICAS:
            kc = BlockingKernelClient(connection_file=str(tmp / f"{rid}.json"))
            kc.load_connection_file()
            kc.start_channels()
            self.clients[rid] = kc
        self.scheduler.configure()

    def _wait_registered(self, replicas: tuple[str, ...], timeout: float = 60) -> None:
        """Until every replica registered; a replica that exited first fails at once, with its log."""

        def registered() -> bool:
            dead = [
                r for r in replicas if r not in self.scheduler.identities and self.procs[r].poll() is not None
            ]
            if dead:
                raise AssertionError(
                    "; ".join(f"{r} exited ({self.procs[r].returncode}): {self.log_tail(r)}" for r in dead)
                )
            return all(r in self.scheduler.identities for r in replicas)

        try:
            self.scheduler.wait_for(registered, timeout=timeout, poll_s=0.5)
        except AssertionError as exc:
            if "timed out" in str(exc):
                tails = {r: self.log_tail(r) for r in replicas if r not in self.scheduler.identities}
                raise AssertionError(f"replicas did not register in {timeout:.0f} s: {tails}") from None
            raise

    def log_tail(self, rid: str, chars: int = 1500) -> str:
        path = self.tmp / f"{rid}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"

    def launch(self, rid: str) -> None:
        env = dict(os.environ, PYTHONPATH=str(REPO), TANDEM_KERNEL_GPUS="1")
        env["TANDEM_STATE_DIR"] = str(self.tmp / "state")  # the shared data store: <state>/datastore
        if self.config.get("raft", {}).get("tls", True):
            env[IDENTITY_ENV] = self.raft_ca.issue(KERNEL_ID, rid).to_json()
        log = open(self.tmp / f"{rid}.log", "ab")  # noqa: SIM115
        self.procs[rid] = subprocess.Popen(
            [
                sys.executable, "-m", "kernel_replica",
                "--kernel-id", KERNEL_ID, "--replica-id", rid, "--connection-file", str(self.tmp / f"{rid}.json"),
                "--local-scheduler", self.scheduler.address, "--data-dir", str(self.tmp / rid),
                "--config-json", json.dumps(self._config()),
            ],
            cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip

    def _config(self) -> dict[str, Any]:
        # snapshot often, so the restart test restores from a snapshot plus a log suffix;
        # a designated executor's LEAD waits 1 s (the conflict test needs the time)
        config: dict[str, dict[str, Any]] = {
            "raft": {"snapshot_every": 8},
            "election": {"executor_silence_s": 2.0, "progress_interval_s": 0.5},
        }
        for section, values in self.config.items():
            config.setdefault(section, {}).update(values)
        return config

    def restart(self, rid: str) -> None:
        """Kill -9 and start again on the same data dir, as a local scheduler would after a crash."""
        os.killpg(self.procs[rid].pid, signal.SIGKILL)
        self.procs[rid].wait(5)
        old_identity = self.scheduler.identities.pop(rid)
        self.launch(rid)
        self.scheduler.wait_for(
            lambda: self.scheduler.identities.get(rid, old_identity) != old_identity, timeout=30
        )
        self.scheduler.configure((rid,))

    # ---- the global scheduler's role -------------------------------------------------------------
    def send_cell(
        self,
        code: str,
        executor: str | None,
        *,
        to: tuple[str, ...] = REPLICAS,
        msg: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """One client request fanned out: execute_request to ``executor`` (all if None), yield to the rest."""
        first = self.clients[to[0]]
        if msg is None:
            msg = first.session.msg("execute_request", {"code": code, "silent": False, "store_history": True,
                                                         "user_expressions": {}, "allow_stdin": False,
                                                         "stop_on_error": True})  # fmt: skip
        for rid in to:
            copy_ = copy.deepcopy(msg)
            if executor is not None and rid != executor:
                copy_["header"]["msg_type"] = "yield_request"
            self.clients[rid].shell_channel.send(copy_)
        self.last_msg = msg
        return msg

    def replies(
        self, msg: dict[str, Any], to: tuple[str, ...] = REPLICAS, timeout: float = 10
    ) -> dict[str, Any]:
        out = {}
        for rid in to:
            while True:
                reply = self.clients[rid].get_shell_msg(timeout=timeout)
                if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
                    out[rid] = reply
                    break
        return out

    def run(self, code: str, executor: str | None, to: tuple[str, ...] = REPLICAS) -> dict[str, Any]:
        msg = self.send_cell(code, executor, to=to)
        return self.replies(msg, to)

    def iopub(self, rid: str, msg_id: str, timeout: float = 0.3) -> list[dict[str, Any]]:
        out = []
        with contextlib.suppress(queue.Empty):
            while True:
                m = self.clients[rid].get_iopub_msg(timeout=timeout)
                if m["parent_header"].get("msg_id") == msg_id:
                    out.append(m)
        return out

    def close(self) -> None:
        for kc in self.clients.values():
            kc.stop_channels()
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        self.scheduler.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("replicas")
    c = Cluster(tmp)
    try:
        yield c
    finally:
        c.close()
        for rid in REPLICAS:
            log = tmp / f"{rid}.log"
            if log.exists():
                print(
                    f"---- {rid} log (tail) ----\n"
                    + "\n".join(log.read_text(errors="replace").splitlines()[-40:])
                )


def roles(replies: dict[str, Any]) -> dict[str, str]:
    return {rid: r["metadata"]["tandem"]["role"] for rid, r in replies.items()}


def test_one_executor_per_cell_and_standbys_reply_the_same(cluster: Cluster) -> None:
    msg = cluster.send_cell("import os\nprint('hello', os.environ['TANDEM_GPU_IDS'])", "r1")
    replies = cluster.replies(msg)
    assert roles(replies) == {"r1": "executor", "r2": "standby", "r3": "standby"}
    contents = [r["content"] for r in replies.values()]
    assert all(c == contents[0] for c in contents) and contents[0]["status"] == "ok"
    assert cluster.scheduler.commits.count(("r1", msg["header"]["msg_id"])) == 1
    outputs = cluster.iopub("r1", msg["header"]["msg_id"])
    assert any(m["msg_type"] == "stream" and m["content"]["text"] == "hello 1\n" for m in outputs)
    standby_out = cluster.iopub("r2", msg["header"]["msg_id"], timeout=0.1)
    assert not [m for m in standby_out if m["msg_type"] in ("stream", "execute_input", "execute_result")]


def test_when_all_are_asked_to_execute_exactly_one_does(cluster: Cluster) -> None:
    replies = cluster.run("z = 7", None)
    assert sorted(roles(replies).values()) == ["executor", "standby", "standby"]
    counts = {r["content"]["execution_count"] for r in replies.values()}
    assert len(counts) == 1


def test_state_follows_the_executor_and_counts_agree(cluster: Cluster) -> None:
    assert cluster.run("x = 41\ndef inc(v):\n    return v + 1", "r1")["r1"]["content"]["status"] == "ok"
    second = cluster.run("y = inc(x)", "r2")
    assert roles(second)["r2"] == "executor" and second["r2"]["content"]["status"] == "ok", second["r2"][
        "content"
    ]
    msg = cluster.send_cell("y", "r3")
    third = cluster.replies(msg)
    assert roles(third)["r3"] == "executor"
    results = [m for m in cluster.iopub("r3", msg["header"]["msg_id"]) if m["msg_type"] == "execute_result"]
    assert results and results[0]["content"]["data"]["text/plain"] == "42"
    counts = {r["content"]["execution_count"] for r in third.values()}
    assert len(counts) == 1


def test_a_notebook_function_updates_the_namespace_on_another_executor(cluster: Cluster) -> None:
    # cloudpickle gives a function a private globals dict: ``global n`` in it must still be the
    # notebook's n on the replica that calls it, not a copy travelling with the function
    assert (
        cluster.run("n = 0\ndef bump():\n    global n\n    n += 1", "r1")["r1"]["content"]["status"] == "ok"
    )
    assert cluster.run("bump()", "r2")["r2"]["content"]["status"] == "ok"
    assert cluster.run("bump()", "r3")["r3"]["content"]["status"] == "ok"
    msg = cluster.clients["r1"].session.msg(
        "execute_request", {"code": "", "silent": False, "user_expressions": {"n": "n"}}
    )
    cluster.send_cell("", "r1", msg=msg)
    content = cluster.replies(msg)["r1"]["content"]
    assert content["status"] == "ok", content
    assert content["user_expressions"]["n"]["data"]["text/plain"] == "2"


def test_large_objects_travel_through_the_data_store(cluster: Cluster) -> None:
    code = "import numpy as np\nbig = np.arange(1_000_000, dtype=np.float64)\nview = big[::2]"
    assert cluster.run(code, "r1")["r1"]["content"]["status"] == "ok"
    msg = cluster.clients["r3"].session.msg(
        "execute_request",
        {"code": "view[1] = -1.0", "silent": False, "user_expressions": {"v": "(big[2], big.sum() > 0)"}},
    )
    cluster.send_cell("", "r3", msg=msg)
    content = cluster.replies(msg)["r3"]["content"]
    assert content["status"] == "ok", content
    assert content["user_expressions"]["v"]["data"]["text/plain"] == "(np.float64(-1.0), np.True_)"
    assert any((cluster.tmp / "state" / "datastore").rglob("*")), "the group did not go to the store"


def test_a_listing_of_the_namespace_on_a_new_executor_names_large_objects_still_loading(
    cluster: Cluster,
) -> None:
    """A standby loads large objects on demand; ``%who_ls`` and ``dir()`` there wait for them."""
    code = "import numpy as np\nlisted_big = np.ones(4_000_000)"
    assert cluster.run(code, "r1")["r1"]["content"]["status"] == "ok"
    msg = cluster.clients["r2"].session.msg(
        "execute_request",
        {"code": "names = %who_ls\nlisted = dir()", "silent": False,
         "user_expressions": {"v": "[[n for n in ns if n.startswith('listed_b')] for ns in (names, listed)]"}},
    )  # fmt: skip
    cluster.send_cell("", "r2", msg=msg)
    content = cluster.replies(msg)["r2"]["content"]
    assert content["status"] == "ok", content
    # (the expression must not name the array: a name in the cell's text is loaded first anyway)
    assert content["user_expressions"]["v"]["data"]["text/plain"] == "[['listed_big'], ['listed_big']]"


def test_a_completion_on_a_standby_offers_a_large_object_still_loading(cluster: Cluster) -> None:
    """``compl<tab>`` right after a large object was made elsewhere lists it (loaded first)."""
    code = "import numpy as np\ncompleted_big = np.ones(4_000_000)"
    assert cluster.run(code, "r1")["r1"]["content"]["status"] == "ok"
    # r3 executes a cell that needs nothing: it has caught up with the log, the array still loading
    assert cluster.run("pass", "r3")["r3"]["content"]["status"] == "ok"
    client = cluster.clients["r3"]
    msg_id = client.complete("completed_b", 11)
    reply = client.get_shell_msg(timeout=30)
    while reply["parent_header"].get("msg_id") != msg_id:  # an earlier test's late reply
        reply = client.get_shell_msg(timeout=30)
    assert "completed_big" in reply["content"]["matches"], reply["content"]


def _raft_leader(cluster: Cluster) -> str:
    """The leader of the newest term reported through replica.event raft_role."""
    cluster.scheduler.wait_for(
        lambda: any(
            e["event"] == "raft_role" and str(e["detail"]["role"]).lower() == "leader"
            for e in cluster.scheduler.events
        )
    )
    leaders = [
        (int(e["detail"].get("term") or 0), e["replica_id"])
        for e in cluster.scheduler.events
        if e["event"] == "raft_role" and str(e["detail"]["role"]).lower() == "leader"
    ]
    assert leaders, "no replica reported Raft leadership"
    return max(leaders)[1]


def test_a_designated_leader_runs_on_gpus_bound_ahead_without_asking(cluster: Cluster) -> None:
    """The local scheduler's gpu.bound push (designated) lets the Raft leader start the cell
    before its LEAD commits: no gpu.commit round trip, the pushed device ids reach user code, the
    replica announces itself elected, and the cell still runs exactly once."""
    leader = _raft_leader(cluster)
    msg = cluster.clients[leader].session.msg(
        "execute_request",
        {"code": "import os\nprint(os.environ['TANDEM_GPU_IDS'])", "silent": False, "store_history": True,
         "user_expressions": {}, "allow_stdin": False, "stop_on_error": True},
    )  # fmt: skip
    msg_id = msg["header"]["msg_id"]
    _push_designated(cluster, leader, msg_id)
    replies = cluster.replies(cluster.send_cell("", leader, msg=msg))
    assert roles(replies)[leader] == "executor"
    assert sorted(roles(replies).values()) == ["executor", "standby", "standby"]
    assert all(r["content"]["status"] == "ok" for r in replies.values())
    assert (leader, msg_id) not in cluster.scheduler.commits
    # the replica announces itself elected beside the cell, not before its reply: wait for it
    assert eventually(
        lambda: any(e["event"] == "elected" and e["msg_id"] == msg_id for e in cluster.scheduler.events)
    )
    elected = [e for e in cluster.scheduler.events if e["event"] == "elected" and e["msg_id"] == msg_id]
    assert [(e["replica_id"], e["detail"]["gpus"]) for e in elected] == [(leader, [7])]
    outputs = cluster.iopub(leader, msg_id)
    assert [m["content"]["text"] for m in outputs if m["msg_type"] == "stream"] == ["7\n"]


def _push_designated(cluster: Cluster, replica: str, msg_id: str) -> None:
    """What the local scheduler sends ahead of a cell only ``replica`` is sent: GPUs bound."""
    push = Envelope(
        messages.GPU_BOUND,
        {
            "kernel_id": KERNEL_ID,
            "replica_id": replica,
            "msg_id": msg_id,
            "device_ids": [7],
            "designated": True,
        },
    )
    cluster.scheduler._outbox.put((cluster.scheduler.identities[replica], push))
    time.sleep(0.5)  # the real local scheduler sends the push before it forwards the request


def test_two_replicas_sent_the_same_cell_run_it_once_only_after_a_committed_lead(cluster: Cluster) -> None:
    """The designated Raft leader and a rival (as when the global scheduler takes a cell over
    from a candidate it found silent) both get the cell: neither runs user code before its LEAD
    is the committed winner, so exactly one runs it and the other answers as a standby. (A
    leader that started the cell before its LEAD committed ran it twice when it was beaten.)"""
    leader = _raft_leader(cluster)
    rival = next(r for r in REPLICAS if r != leader)
    assert cluster.run("conflict_runs = 0", leader)[leader]["content"]["status"] == "ok"
    ran_on = "get_ipython().kernel.replica_id"
    msg = cluster.clients[leader].session.msg(
        "execute_request",
        {"code": f"import time\ntime.sleep(0.3)\nconflict_runs += 1\nconflict_ran_on = {ran_on}", "silent": False,
         "store_history": True, "user_expressions": {}, "allow_stdin": False, "stop_on_error": True},
    )  # fmt: skip
    _push_designated(cluster, leader, msg["header"]["msg_id"])
    cluster.send_cell("", leader, to=(leader,), msg=msg)
    cluster.send_cell("", rival, to=(rival,), msg=msg)
    replies = cluster.replies(msg, to=(leader, rival))
    executors = [r for r in (leader, rival) if roles(replies)[r] == "executor"]
    assert len(executors) == 1, roles(replies)
    winner = executors[0]
    assert replies[winner]["content"]["status"] == "ok"
    # every replica holds the winner's state: the cell ran once
    for rid in REPLICAS:
        check = cluster.send_cell("", rid, msg=cluster.clients[rid].session.msg(
            "execute_request", {"code": "", "silent": False,
                                "user_expressions": {"n": "conflict_runs", "on": "conflict_ran_on"}}
        ))  # fmt: skip
        content = cluster.replies(check)[rid]["content"]
        assert content["user_expressions"]["n"]["data"]["text/plain"] == "1", (rid, content)
        assert content["user_expressions"]["on"]["data"]["text/plain"] == repr(winner), (rid, content)


def test_duplicate_msg_id_runs_at_most_once(cluster: Cluster) -> None:
    cluster.run("runs = 0", "r1")
    msg = cluster.send_cell("runs += 1", "r1")
    first = cluster.replies(msg)
    # A retry of the same request (same msg_id), to another executor. Re-signed with a new date:
    # ipykernel drops a byte-identical message as a replay ("Duplicate Signature").
    retry = copy.deepcopy(msg)
    retry["header"]["date"] = datetime.now(UTC)
    cluster.send_cell("", "r2", msg=retry)
    retry = cluster.replies(msg)
    assert retry["r2"]["metadata"]["tandem"].get("replayed") is True
    assert retry["r2"]["content"] == first["r1"]["content"]
    check = cluster.send_cell("runs", "r3")
    cluster.replies(check)
    results = [m for m in cluster.iopub("r3", check["header"]["msg_id"]) if m["msg_type"] == "execute_result"]
    assert results[0]["content"]["data"]["text/plain"] == "1"


def test_all_yield_is_a_failed_election(cluster: Cluster) -> None:
    msg = cluster.clients["r1"].session.msg("yield_request", {"code": "1", "silent": False})
    for rid in REPLICAS:
        cluster.clients[rid].shell_channel.send(copy.deepcopy(msg))
    replies = cluster.replies(msg)
    for reply in replies.values():
        assert reply["content"]["status"] == "error"
        assert reply["content"]["ename"] == "NoExecutorAvailable"
    cluster.scheduler.wait_for(
        lambda: any(
            e["event"] == "election_failed" and e["msg_id"] == msg["header"]["msg_id"]
            for e in cluster.scheduler.events
        )
    )


def test_interrupt_of_busy_loop_returns_keyboard_interrupt_quickly(cluster: Cluster) -> None:
    msg = cluster.send_cell("while True:\n    pass", "r1")
    time.sleep(0.5)
    # An interrupt that reaches a standby (the scheduler may not know the executor yet) must not
    # break its wait for DONE.
    standby = cluster.clients["r2"]
    standby.control_channel.send(standby.session.msg("interrupt_request", {}))
    time.sleep(0.2)
    started = time.monotonic()
    kc = cluster.clients["r1"]
    kc.control_channel.send(kc.session.msg("interrupt_request", {}))
    replies = cluster.replies(msg, timeout=5)
    elapsed = time.monotonic() - started
    assert elapsed < 2.0, elapsed
    for reply in replies.values():
        assert reply["content"]["ename"] == "KeyboardInterrupt"
    # (its GPUs go back as its reply passes the local scheduler: test_schedulers checks that)
    after = cluster.run("x", "r2")  # the group still works after the interrupt
    assert after["r2"]["content"]["status"] == "ok"


def test_a_restarted_replica_rebuilds_state_and_history_from_its_log(cluster: Cluster) -> None:
    # r2 executes, so after its restart its own DONE and STATE must come back from its log
    before = cluster.run("restart_probe = [1, 2, 3]", "r2")
    count = before["r2"]["content"]["execution_count"]
    idle = [m for m in cluster.iopub("r2", cluster.last_msg["header"]["msg_id"]) if m["msg_type"] == "status"]
    assert idle and idle[-1]["content"]["execution_state"] == "idle"
    # The executor replies (and goes idle) before its DONE and STATE commit; the standbys' replies
    # (``run`` waited for them) mean DONE committed. Give STATE, proposed right behind it, time too.
    time.sleep(0.5)
    cluster.restart("r2")
    # the same msg_id retried at the restarted replica is answered from its replayed log
    retry = copy.deepcopy(cluster.last_msg)
    retry["header"]["date"] = datetime.now(UTC)
    cluster.send_cell("", "r2", msg=retry)
    replayed = cluster.replies(retry)
    assert replayed["r2"]["metadata"]["tandem"].get("replayed") is True
    msg = cluster.clients["r2"].session.msg(
        "execute_request",
        {"code": "restart_probe", "silent": False, "user_expressions": {"probe": "restart_probe"}},
    )
    cluster.send_cell("", "r2", msg=msg)
    content = cluster.replies(msg, timeout=20)["r2"]["content"]
    assert content["status"] == "ok", content
    assert content["execution_count"] == count + 1
    assert content["user_expressions"]["probe"]["data"]["text/plain"] == "[1, 2, 3]"


def current_leader(cluster: Cluster) -> str:
    """The Raft leader as the replicas last logged it (waiting out a leadership transfer, during
    which the log says ``leader=None``)."""
    deadline = time.monotonic() + 5
    while True:
        leader = None
        for line in (cluster.tmp / "r1.log").read_text(errors="replace").splitlines():
            if "raft.leader_changed" in line:
                leader = re.search(r"leader=(\S+)", line).group(1)  # type: ignore[union-attr]
        if leader in REPLICAS or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert leader in REPLICAS, leader
    return leader


def test_cells_still_run_after_the_raft_leader_dies_mid_cell(cluster: Cluster) -> None:
    victim = current_leader(cluster)
    alive = tuple(r for r in REPLICAS if r != victim)
    cluster.alive = alive
    # the leader executes a long cell and dies in the middle of it
    msg = cluster.send_cell("import time\ntime.sleep(60)", victim)
    time.sleep(1.0)
    os.killpg(cluster.procs[victim].pid, signal.SIGKILL)
    cluster.procs[victim].wait(5)
    started = time.monotonic()
    lost = cluster.replies(msg, to=alive, timeout=15)
    assert time.monotonic() - started < 10
    for reply in lost.values():  # the standbys are not stuck behind a cell nobody will finish
        assert reply["content"]["ename"] == "ExecutorLost", reply["content"]
    for executor in alive:
        replies = cluster.run("x = x + 1", executor, to=alive)
        assert replies[executor]["content"]["status"] == "ok", replies[executor]["content"]
        assert roles(replies)[executor] == "executor"


def test_lost_quorum_is_an_error_reply_not_a_hang(cluster: Cluster) -> None:
    victim, survivor = cluster.alive
    time.sleep(0.5)  # let the previous cell's DONE and STATE commit (the executor replied before)
    os.killpg(cluster.procs[victim].pid, signal.SIGKILL)
    cluster.procs[victim].wait(5)
    started = time.monotonic()
    replies = cluster.run("x", survivor, to=(survivor,))
    content = replies[survivor]["content"]
    assert content["status"] == "error" and content["ename"] == "ReplicaUnavailable", content
    assert "Raft" in content["evalue"]
    assert time.monotonic() - started < 10


def test_shutdown_request_stops_raft_and_exits(cluster: Cluster) -> None:
    (survivor,) = (r for r in REPLICAS if cluster.procs[r].poll() is None)
    kc = cluster.clients[survivor]
    kc.shutdown()
    assert cluster.procs[survivor].wait(10) == 0
    assert "raft.stopped" in (cluster.tmp / f"{survivor}.log").read_text(errors="replace")
