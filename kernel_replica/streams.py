"""Standard streams that skip ``flush()`` when there is nothing to send.

ipykernel's ``OutStream.flush()`` always hands two tasks to the IOPub thread and waits for them,
output or not; a cell's handler flushes stdout and stderr twice (after the cell, after the
handler), so a quiet cell pays four thread round trips (~0.45 ms each on 2 cores,
scripts/bench_latency.py) and a standby, which writes nothing, two per cell. Output the cell
wrote is buffered (``_buffers``) or has a flush pending, and is flushed exactly as before.
"""

from __future__ import annotations

from ipykernel.iostream import OutStream


class LazyFlushOutStream(OutStream):
    def flush(self) -> None:
        if (
            self._buffers
            or self._flush_pending
            or getattr(self, "_subprocess_flush_pending", False)
            or self.echo is not None
        ):
            super().flush()
