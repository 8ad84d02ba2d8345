"""C libraries' writes to fd 1 cannot corrupt a command's result output (``shared.result_stdout``).

The C writer is real: the one HiGHS MILP below (a partial-allocation instance captured from a
``bench_arbiter --quick`` auction: three bidders, bundles of 1/2/4/8/16/17 GPUs, 17 free) makes
scipy 1.17's HiGHS printf "HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();"
to fd 1 whatever its options say. Each case runs in its own process, as the CLI does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HIGHS_LINE = "HighsMipSolverData::transformNewIntegerFeasibleSolution"

NOISY_MILP = textwrap.dedent(
    """
    import ctypes, os
    import numpy as np
    from scipy.optimize import Bounds, LinearConstraint, milp
    from scipy.sparse import coo_array

    GAINS = [
        0.02861500935304634, 0.046182431994144194, 0.06664177829126076, 0.08560854321683813,
        0.09981596148994809, 0.10080011470793626, 0.10660425930133288, 0.19035056729953925,
        0.3141443477607162, 0.4671249614435865, 0.6198030375047665, 0.6320562666832859,
        0.06901940862088146, 0.11279285830056254, 0.1652326855537048, 0.21535893411903478,
        0.2539311796122106, 0.25663714010603683,
    ]
    SIZES = [1, 2, 4, 8, 16, 17]

    def c_writes_to_fd1():
        rows = [a for a in range(3) for _ in SIZES] + [9] * 18
        vals = [1.0] * 18 + [float(s) for _ in range(3) for s in SIZES]
        a = coo_array((vals, (rows, list(range(18)) * 2)), shape=(10, 18)).tocsr()
        upper = np.array([1.0, 1.0, 1.0, 3.0, 4.0, 2.0, 1.0, 4.0, 3.0, 17.0])
        milp(
            c=-np.array(GAINS),
            constraints=LinearConstraint(a, -np.inf, upper),
            integrality=np.ones(18),
            bounds=Bounds(0.0, 1.0),
            options={"mip_rel_gap": 1e-9},
        )
        # and a buffered printf that C stdio flushes only at exit, after the result
        ctypes.CDLL(None).printf(b"buffered C printf\\n")
    """
)


def _run(body: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-c", NOISY_MILP + textwrap.dedent(body)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=120,
        check=True,
    )


def test_without_the_guard_highs_corrupts_stdout() -> None:
    """The reproduction: HiGHS's print and the C printf land in the result stream."""
    out = _run(
        """
        c_writes_to_fd1()
        print('{"result": 1}')
        """
    ).stdout
    assert HIGHS_LINE in out and "buffered C printf" in out


def test_the_guard_keeps_stdout_one_json_line_and_sends_c_writes_to_stderr() -> None:
    proc = _run(
        """
        import json
        from shared.result_stdout import result_stdout
        with result_stdout():
            c_writes_to_fd1()
            print(json.dumps({"result": 1}))
        """
    )
    assert proc.stdout.splitlines() == ['{"result": 1}']
    assert HIGHS_LINE in proc.stderr and "buffered C printf" in proc.stderr


def test_tandem_sim_json_stays_one_parsable_last_line_when_a_c_library_writes_to_fd1() -> None:
    """``tandem sim --json``: a mixed run's auctions call HiGHS inside ``run_sim``; here the noisy
    MILP runs there too, so the C writes happen in the middle of the command."""
    proc = _run(
        """
        import sys
        import shared.simulator.cli as sim_cli
        from services.cli import main

        real_run_sim = sim_cli.run_sim

        def run_sim_with_c_writes(*args, **kwargs):
            c_writes_to_fd1()
            return real_run_sim(*args, **kwargs)

        sim_cli.run_sim = run_sim_with_c_writes
        sys.exit(main(["sim", "--trace", "synthetic-idlt", "--days", "0.05",
                       "--policies", "notebookos", "--no-plots", "--json"]))
        """
    )
    lines = proc.stdout.splitlines()
    assert HIGHS_LINE not in proc.stdout and "buffered C printf" not in proc.stdout
    assert sum(1 for line in lines if line.startswith("{")) == 1
    assert "notebookos" in json.loads(lines[-1])
    assert HIGHS_LINE in proc.stderr and "buffered C printf" in proc.stderr
