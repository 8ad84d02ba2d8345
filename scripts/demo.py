"""``make demo``: start an embedded cluster, run examples/quickstart.ipynb on it, stop it.

Prints, per cell, which replica on which host executed it and its interactivity delay (request
arrival at the gateway to the start of user code). Exits non-zero if anything failed, so the demo
doubles as an end-to-end smoke test.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from services.cli import print_report, run_notebook  # noqa: E402
from services.cluster_file import ask  # noqa: E402
from services.embedded import ClusterStartError, EmbeddedCluster  # noqa: E402
from services.kernelspec import install  # noqa: E402
from shared import messages  # noqa: E402
from shared.config import load_config, parse_overrides  # noqa: E402
from shared.logs import configure_logging  # noqa: E402
from shared.security import curve  # noqa: E402


class Failover:
    """Cordons the executor's host after N cells: the rest of the notebook must run elsewhere,
    with every variable intact. This is the product's promise, shown rather than told."""

    def __init__(self, scheduler: str, *, keys_dir: str, after_cells: int) -> None:
        self.scheduler = scheduler
        self.credentials = curve.client_curve(Path(keys_dir), curve.OPERATOR, curve.SCHEDULER)
        self.after_cells = after_cells
        self.seen = 0
        self.cordoned: str | None = None

    async def __call__(self, row: dict[str, Any]) -> None:
        self.seen += 1
        if self.after_cells and self.seen == self.after_cells and row.get("host"):
            self.cordoned = str(row["host"])
            body = {"host_id": self.cordoned}
            await ask(self.scheduler, messages.HOST_CORDON, body, credentials=self.credentials, timeout=5.0)

    def note(self) -> None:
        if self.cordoned:
            print(f"cordoned {self.cordoned} (the executor's host) after cell {self.after_cells}: "
                  "later cells ran on another replica, same namespace")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--notebook", default=str(ROOT / "examples" / "quickstart.ipynb"))
    parser.add_argument("-o", "--output", help="write the executed notebook here")
    parser.add_argument("--config", help="TOML configuration (default: configs/local.toml)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--cordon-after",
        type=int,
        default=3,
        help="cordon the executor's host after this many cells (0: never)",
    )
    args = parser.parse_args(argv)
    config = args.config or (
        str(ROOT / "configs" / "local.toml") if (ROOT / "configs" / "local.toml").exists() else None
    )
    cfg = load_config(config, parse_overrides(args.set))
    configure_logging(cfg.get("log.format"), "warning", service="demo")
    with tempfile.TemporaryDirectory(prefix="tandem-demo-") as tmp:
        state_dir = Path(tmp) / "state"
        logging.getLogger("traitlets").setLevel(logging.ERROR)  # "prefix not on the search path": we add it
        install(prefix=str(Path(tmp) / "prefix"))  # a private kernelspec: the demo needs no prior setup
        os.environ["JUPYTER_PATH"] = os.pathsep.join(
            filter(None, [str(Path(tmp) / "prefix" / "share" / "jupyter"), os.environ.get("JUPYTER_PATH")])
        )
        os.environ["TANDEM_STATE_DIR"] = str(state_dir)
        cluster = EmbeddedCluster(cfg, state_dir=state_dir)
        print(
            f"starting the embedded cluster: {cfg.get('cluster.hosts')} hosts x {cfg.get('host.gpus')} virtual GPUs"
        )
        try:
            info = cluster.start()
            print(f"cluster up: gateway {info['gateway']}, hosts {', '.join(info['hosts'])}")
            print(f"running {args.notebook} on the 'tandem' kernel ...")
            failover = Failover(info["scheduler"], keys_dir=info["keys_dir"], after_cells=args.cordon_after)
            report = run_notebook(
                Path(args.notebook),
                Path(args.output) if args.output else None,
                timeout=300,
                after_cell=failover,
            )
            failover.note()
        except ClusterStartError as exc:
            print(f"demo: the cluster did not start: {exc}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            print("demo: interrupted", file=sys.stderr)
            return 130
        finally:
            cluster.stop()
        print_report(report)
        executors = {(c["replica"], c["host"]) for c in report["cells"]}
        print(f"{len(report['cells'])} cells on {len(executors)} executor(s); cluster stopped")
        if not report["ok"]:
            print("demo: FAILED", file=sys.stderr)
            return 1
        print("demo: OK")
        return 0


if __name__ == "__main__":
    sys.exit(main())
