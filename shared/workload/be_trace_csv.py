"""Read real BE job traces (Philly-like) from CSV into a :class:`BeWorkload`.

One row per job. Columns::

    app_id, job_id, submit_time, gpus, duration_s[, model, placement_sensitivity, seconds_per_iteration]

* ``app_id``: jobs with the same id form one app (a sweep); empty: the job is its own app.
* ``submit_time``: seconds (any origin) or ISO-8601; an app arrives with its earliest job; with
  ``rebase`` (default) the earliest arrival becomes 0.
* ``gpus``: the job's GPU count (its max_gpus) and ``duration_s`` its runtime on that many GPUs,
  so its serial work is gpus * duration_s GPU-seconds (linear speedup, as Themis assumes).
* ``model``: a name from ``shared.workload.be_model.MODELS`` (sets the sensitivity and iteration
  time) or anything else / empty (insensitive, 1 s per iteration); ``placement_sensitivity``
  (>= 1) and ``seconds_per_iteration`` (> 0) override the model's.

A malformed row raises :class:`TraceCsvError` naming the line and the column: a replay that
silently dropped jobs would misstate every fairness figure built on it.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TextIO

from shared.workload.be_model import MODELS, UNKNOWN_MODEL, BeApp, BeJob, BeWorkload
from shared.workload.trace_csv import TraceCsvError, _parse_float, _parse_int, _parse_time, checked_rows

REQUIRED = ("app_id", "job_id", "submit_time", "gpus", "duration_s")
OPTIONAL = ("model", "placement_sensitivity", "seconds_per_iteration")
COLUMNS = REQUIRED + OPTIONAL
MAX_JOB_GPUS = 1024


def read_be_trace_csv(source: str | Path | TextIO, *, rebase: bool = True) -> BeWorkload:
    """Parse a BE job trace (a path or an open text stream)."""
    if isinstance(source, str | Path):
        with open(source, newline="", encoding="utf-8") as fh:
            return read_be_trace_csv(fh, rebase=rebase)
    apps: dict[str, tuple[float, list[BeJob]]] = {}
    seen: set[str] = set()
    for line, row in checked_rows(source, REQUIRED, OPTIONAL):
        job_id = row["job_id"].strip()
        if not job_id:
            raise TraceCsvError(line, "job_id", "empty job id")
        if job_id in seen:
            raise TraceCsvError(line, "job_id", f"job {job_id!r} appears twice")
        seen.add(job_id)
        app_id = row["app_id"].strip() or job_id
        submit = _parse_time(row["submit_time"], line, "submit_time")
        gpus = _parse_int(row["gpus"], line, "gpus", 1, MAX_JOB_GPUS)
        duration = _parse_float(row["duration_s"], line, "duration_s")
        if duration <= 0:
            raise TraceCsvError(line, "duration_s", f"a job runs for > 0 s, got {row['duration_s']!r}")
        model = MODELS.get((row.get("model") or "").strip().lower(), UNKNOWN_MODEL)
        sens_text = (row.get("placement_sensitivity") or "").strip()
        if sens_text:
            sens = _parse_float(sens_text, line, "placement_sensitivity")
            if sens < 1.0:
                raise TraceCsvError(line, "placement_sensitivity", f"a slowdown is >= 1, got {sens_text!r}")
            model = replace(model, placement_sensitivity=sens)
        spi_text = (row.get("seconds_per_iteration") or "").strip()
        if spi_text:
            spi = _parse_float(spi_text, line, "seconds_per_iteration")
            if spi <= 0:
                raise TraceCsvError(line, "seconds_per_iteration", f"must be > 0, got {spi_text!r}")
            model = replace(model, seconds_per_iteration=spi)
        iterations = max(1, round(gpus * duration / model.seconds_per_iteration))
        first, jobs = apps.get(app_id, (submit, []))
        jobs.append(BeJob(job_id, model, iterations, gpus))
        apps[app_id] = (min(first, submit), jobs)
    if not apps:
        raise TraceCsvError(2, None, "no jobs in the trace")
    origin = min(t for t, _ in apps.values()) if rebase else 0.0
    built = sorted(
        (BeApp(app_id, t - origin, tuple(jobs)) for app_id, (t, jobs) in apps.items()),
        key=lambda a: (a.submitted_at, a.app_id),
    )
    name = getattr(source, "name", "csv")
    return BeWorkload(tuple(built), f"csv:{name}")
