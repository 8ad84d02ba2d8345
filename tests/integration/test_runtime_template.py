"""The runtime template (kernel_replica/template.py, a fork server) driven by the local scheduler's
shell (services/local_scheduler/runtime_template.py): forks in milliseconds once warm, imports a
resumed kernel's installed modules before forking (never a notebook's own files), and reports
each forked runtime's exit status, which its parent, not the local scheduler, collects."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest

from kernel_replica.template import installed
from services.local_scheduler.runtime_template import RuntimeTemplate
from services.local_scheduler.warm_pool import runtime_env, setpriv_path

pytestmark = pytest.mark.integration


def test_only_installed_modules_are_imported_into_the_template(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "notebook_helper.py").write_text("raise SystemExit('never imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert installed("json") and installed("numpy") and installed("sys")
    assert not installed("notebook_helper")  # beside the notebook, not installed
    assert not installed("no_such_module_anywhere") and not installed("os.path") and not installed("")


def test_a_forked_runtime_runs_the_replica_entry_point_and_its_exit_is_reported(tmp_path: Path) -> None:
    async def scenario() -> None:
        template = RuntimeTemplate(
            python=sys.executable,
            imports=[],
            directory=tmp_path,
            env=runtime_env("h1"),
            setpriv=setpriv_path(),
        )
        await template.start()
        try:
            await asyncio.wait_for(template.ready, 60)
            # the replica's own argument check fails (exit 2): proof the child ran its entry point
            bad = {"argv": ["--no-such-flag"], "env": {"X": "1"}, "cwd": str(tmp_path)}
            first = await template.fork(
                {**bad, "log_file": str(tmp_path / "a.log")}, ["numpy", "not_installed_x"]
            )
            started = time.monotonic()
            second = await template.fork({**bad, "log_file": str(tmp_path / "b.log")}, ["numpy"])
            fork_s = time.monotonic() - started
            assert await asyncio.wait_for(first.wait(), 30) == 2
            assert await asyncio.wait_for(second.wait(), 30) == 2
            assert first.pid != second.pid and template.forks == 2
            assert "the following arguments are required" in (tmp_path / "a.log").read_text()
            assert fork_s < 1.0, fork_s  # numpy was imported by the first request already
            log = next(tmp_path.glob("template-*.log")).read_text()
            assert "not importing 'not_installed_x'" in log
        finally:
            await template.close()
        assert not template.alive

    asyncio.run(scenario())
