"""Small helpers for integration tests that drive tandem kernels through jupyter_client."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import zmq
from jupyter_client import BlockingKernelClient, KernelManager


@dataclass
class CellResult:
    reply: dict[str, Any]
    stdout: str = ""
    errors: list[dict[str, Any]] = field(default_factory=list)
    results: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def status(self) -> str:
        return str(self.reply["content"]["status"])

    @property
    def tandem(self) -> dict[str, Any]:
        return dict(self.reply.get("metadata", {}).get("tandem", {}))


@contextlib.contextmanager
def tandem_kernel(**resources: Any) -> Iterator[tuple[KernelManager, BlockingKernelClient]]:
    with jupyter_kernel("tandem") as started:
        yield started


@contextlib.contextmanager
def jupyter_kernel(kernel_name: str) -> Iterator[tuple[KernelManager, BlockingKernelClient]]:
    """A started kernel of ``kernel_name`` ("tandem", or "python3" for the stock comparison)."""
    # One zmq context per kernel, owned here and destroyed with linger 0 on the way out. Left to
    # jupyter_client, a manager whose shutdown raised (a dead kernel) keeps its context and control
    # socket open until garbage collection; collected in one cycle, the context's __del__ can run
    # before the socket's and block forever in term() (the suite once hung there).
    ctx = zmq.Context()
    km = KernelManager(kernel_name=kernel_name, context=ctx)
    try:
        km.start_kernel()
        kc = km.client(context=ctx)
        kc.start_channels()
        try:
            kc.wait_for_ready(timeout=60)
            yield km, kc
        finally:
            kc.stop_channels()
            with contextlib.suppress(Exception):
                km.shutdown_kernel(now=True)
    finally:
        ctx.destroy(linger=0)


def run(kc: BlockingKernelClient, code: str, timeout: float = 30.0) -> CellResult:
    """Execute ``code`` and collect its reply and outputs, as a notebook front end would."""
    result = CellResult(reply={})

    def on_output(msg: dict[str, Any]) -> None:
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            result.stdout += content["text"]
        elif kind == "error":
            result.errors.append(content)
        elif kind == "execute_result":
            result.results.append(content["data"].get("text/plain", ""))

    started = time.monotonic()
    result.reply = kc.execute_interactive(code, timeout=timeout, output_hook=on_output)
    result.seconds = time.monotonic() - started
    return result
