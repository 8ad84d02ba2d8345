"""The working directory, environment and sys.path a notebook changed, as replicas exchange them."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import msgpack
import pytest

from kernel_replica.log_entries import LogEntryError, State, decode, encode
from kernel_replica.process_context import ProcessContext, ProcessState, env_changes, env_to_apply
from kernel_replica.state_sync import ReplicatedNamespace

START = {"HOME": "/root", "LANG": "C", "TANDEM_REPLICA_ID": "r1"}


def test_env_changes_are_what_differs_from_the_start_without_tandems_own() -> None:
    now = {
        "HOME": "/root",
        "LANG": "en_US",
        "API_TOKEN": "s",
        "TANDEM_REPLICA_ID": "r1",
        "TANDEM_GPU_IDS": "0",
    }
    assert env_changes(now, START) == {"LANG": "en_US", "API_TOKEN": "s"}
    assert env_changes({"LANG": "C", "TANDEM_REPLICA_ID": "r1"}, START) == {"HOME": None}


def test_a_variable_changed_before_but_not_now_is_put_back_to_this_replicas_start() -> None:
    """Another replica's start differs in Tandem's own variables only; what it changed applies
    over this one's start, and a change it undid is undone here too."""
    applied = {"API_TOKEN": "s", "LANG": "en_US", "HOME": None}
    assert env_to_apply({"API_TOKEN": "t"}, applied, START) == {
        "API_TOKEN": "t",
        "LANG": "C",
        "HOME": "/root",
    }
    assert env_to_apply({"TANDEM_REPLICA_ID": "r2"}, {}, START) == {}


def test_a_state_carries_the_context_through_the_log_and_the_snapshot() -> None:
    context = ProcessContext("/data", {"API_TOKEN": "s", "LANG": None}, ("/src", "/usr/lib/python3"))
    state = State("m", "r1", process=context)
    decoded = decode(encode(state))
    assert isinstance(decoded, State) and decoded.process == context
    namespace = ReplicatedNamespace()
    namespace.apply(decoded)
    namespace.apply(State("n", "r1"))  # a STATE without a change keeps the last context
    restored = ReplicatedNamespace()
    restored.restore(namespace.to_snapshot())
    assert restored.process_context() == context


@pytest.mark.parametrize(
    ("px", "problem"),
    [
        ({"cwd": "", "env": {}, "path": []}, "'cwd'"),
        ({"cwd": "/", "env": {"A": 1}, "path": []}, "'env'"),
        ({"cwd": "/", "env": {}, "path": "/src"}, "'path'"),
        ({"cwd": "/", "env": {}, "path": [], "settings": {"random.state": "0"}}, "'settings'"),
    ],
)
def test_a_malformed_context_in_the_log_is_refused_naming_the_field(px: dict, problem: str) -> None:
    body = msgpack.unpackb(encode(State("m", "r1")), raw=False)
    body["px"] = px  # as a faulty or hostile peer would have written it
    with pytest.raises(LogEntryError, match=f"'px'.*{problem}"):
        decode(msgpack.packb(body, use_bin_type=True))


def test_a_working_directory_missing_on_this_host_is_reported_not_entered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    missing = str(tmp_path / "only-on-the-other-host")
    notice = ProcessState().apply(ProcessContext(missing, {}, tuple(sys.path)))
    assert notice is not None and missing in notice and "cannot be entered" in notice
    assert os.getcwd() == str(tmp_path)


def test_configuration_magics_are_replayed_once_each_in_order() -> None:
    """A replica replays what it has not run yet; an executor's repeats add nothing."""
    executor, standby = ProcessState(), ProcessState()
    for magic in (("load_ext", "autoreload"), ("autoreload", "2"), ("load_ext", "autoreload"), ("time", "x")):
        executor.record_magic(*magic)
    context = executor.capture()
    assert context.magics == (("load_ext", "autoreload"), ("autoreload", "2"))  # %time is no config
    assert ProcessContext.from_wire(context.to_wire()) == context
    ran: list[tuple[str, str]] = []
    assert standby.apply(context, lambda name, line: ran.append((name, line))) is None
    executor.record_magic("precision", "3")
    assert standby.apply(executor.capture(), lambda name, line: ran.append((name, line))) is None
    assert ran == [("load_ext", "autoreload"), ("autoreload", "2"), ("precision", "3")]


def test_a_magic_that_fails_on_this_replica_is_reported() -> None:
    def missing(name: str, line: str) -> None:
        raise ModuleNotFoundError(f"No module named {line!r}")

    context = ProcessContext(os.getcwd(), {}, tuple(sys.path), (("load_ext", "only_there"),))
    notice = ProcessState().apply(context, missing)
    assert notice is not None and "%load_ext only_there" in notice and "ModuleNotFoundError" in notice


def test_a_magic_outside_the_configuration_ones_is_refused_from_the_log() -> None:
    with pytest.raises(ValueError, match="'magics'"):
        ProcessContext.from_wire({"cwd": "/", "env": {}, "path": [], "magics": [["system", "rm -rf /"]]})


def test_a_time_zone_set_by_the_notebook_is_in_force_on_the_next_executor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TZ", raising=False)
    standby = ProcessState()
    assert standby.apply(ProcessContext(os.getcwd(), {"TZ": "EST+5"}, tuple(sys.path))) is None
    try:
        assert time.tzname[0] == "EST" and time.timezone == 5 * 3600  # read again, not only set
    finally:
        monkeypatch.delenv("TZ", raising=False)
        time.tzset()
