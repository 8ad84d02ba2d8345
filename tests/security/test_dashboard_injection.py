"""The operator's dashboard against what the cluster reports to it.

The page is rendered from ``tandem status --json``, and much of that is what hosts said: a
``replica.start`` answer's ``pid`` went to the page as the host wrote it (and to ``tandem
status``), so anyone holding a host key (which notebook code on that host can read) could put
script into the operator's page, where the API token is (``?token=``): from host to operator. Now
every value is escaped, numbers too, the data the page's script starts from cannot end its
``<script>``, a Content-Security-Policy runs only the page's own script (by nonce), and
``Referrer-Policy: no-referrer`` keeps the token in the page's address out of every Referer."""

from __future__ import annotations

import copy
import re
from collections.abc import Iterator
from typing import Any

import pytest
import requests
from _cluster import ClusterHandle

from services.global_scheduler.service import _reported_pid
from services.http_gateway.dashboard import render_page

PAYLOAD = '<img src=x onerror="alert(1)">'


def full_status() -> dict[str, Any]:
    """A ``tandem status --json`` with every section the page renders."""
    return {
        "policy": "notebookos",
        "cluster": {"hosts": 1, "kernels": 1, "committed_gpus": 1, "provisioned_gpus": 8,
                    "subscription_ratio": 0.1, "migrations": 1, "warm_runtimes": 2},
        "metrics": {"cells_total": 3, "immediate_commit_ratio": 1.0, "interactivity_delay_ms": {"p50": 4.0},
                    "prometheus_url": "http://127.0.0.1:9000/metrics"},
        "hosts": [{"id": "host-0", "alive": True, "cordoned": False, "gpu_kind": "virtual", "gpus": 8,
                   "committed": 1, "subscribed": 3, "subscription_ratio": 0.12, "warm_pool": {"warm": 2}}],
        "kernels": [{"id": "k-1234567890", "state": "running", "last_executor": "r1", "held_requests": 0,
                     "migrations": 1, "resources": {"gpus": 1, "memory_mb": 512},
                     "last_migration": {"replica": "r1", "new_replica": "r4", "from": "host-0", "to": "host-1",
                                        "reason": "drain", "seconds": 1.5, "at": 1.0},
                     "replicas": [{"id": "r1", "host": "host-0", "role": "leader", "alive": True, "pid": 11}]}],
        "cells": [{"kernel_id": "k-1234567890", "executor": "r1", "host": "host-0", "submitted_at": 1.0,
                   "immediate": True, "interactivity_delay_ms": 3.0, "task_completion_ms": 9.0}],
        "scale_events": [{"at": 1.0, "kind": "scale_out", "hosts": ["host-1"], "reason": "pending"}],
        "batch": {"rounds": 4, "prometheus_url": "http://127.0.0.1:9001/metrics",
                  "usage": {"gpus_now": {"cells": 1, "be": 2, "idle": 5, "provisioned": 8},
                            "utilization": {"cells": 0.1, "be": 0.2, "idle": 0.7}, "be_capacity_gpus": 7,
                            "hosts": {"host-0": {"cells": 1, "be": 2, "free": 4, "reserved": 1}}},
                  "apps": {"sweep": {"rho": 1.2, "gpu_seconds": 30.0, "gpus_now": 2, "jobs": {"running": 1}}},
                  "lease_events": [{"at": 1.0, "event": "granted", "app_id": "sweep", "job_id": "sweep.1",
                                    "host": "host-0"}]},
    }  # fmt: skip


def leaves(value: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    """The path of every scalar in ``value``."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from leaves(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from leaves(item, (*path, index))
    else:
        yield path


def with_leaf(status: dict[str, Any], path: tuple[Any, ...], new: Any) -> dict[str, Any]:
    hostile = copy.deepcopy(status)
    target: Any = hostile
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = new
    return hostile


def test_no_reported_value_reaches_the_dashboard_as_markup() -> None:
    status = full_status()
    paths = [p for p in leaves(status) if p[-1] != "id" or p[0] != "hosts"]  # host ids: checked ids
    assert len(paths) > 60
    unsafe = []
    for path in paths:
        try:
            html = render_page(with_leaf(status, path, PAYLOAD), nonce="n0nce")
        except (TypeError, ValueError) as exc:  # one bad number must not take the page down either
            unsafe.append(f"{'.'.join(map(str, path))}: {exc.__class__.__name__}: {exc}")
            continue
        if PAYLOAD in html:
            unsafe.append(".".join(map(str, path)))
    assert unsafe == [], f"shown as markup or breaking the page: {unsafe}"


def test_the_scripts_data_cannot_end_the_script() -> None:
    status = full_status()
    status["hosts"][0]["id"] = "</script><script>alert(1)</script>"
    html = render_page(status, nonce="n0nce")
    assert html.count("<script") == 1 and html.count("</script>") == 1


def test_a_metrics_link_is_only_ever_an_http_link() -> None:
    status = full_status()
    status["metrics"]["prometheus_url"] = "javascript:alert(1)"
    assert "javascript:" not in render_page(status)


def test_a_hosts_pid_is_kept_only_when_it_is_a_number() -> None:
    assert _reported_pid({"pid": 4242}) == 4242
    assert _reported_pid({"pid": PAYLOAD}) is None
    assert _reported_pid({"pid": True}) is None and _reported_pid({}) is None


@pytest.mark.integration
def test_the_dashboard_runs_only_its_own_script_and_sends_no_referer(tandem_cluster: ClusterHandle) -> None:
    url = str(tandem_cluster.info["http"])
    token = (tandem_cluster.state_dir / "keys" / "http.token").read_text().strip()
    page = requests.get(f"{url}/dashboard", params={"token": token}, timeout=30)
    assert page.status_code == 200
    assert page.headers["Referrer-Policy"] == "no-referrer"
    policy = page.headers["Content-Security-Policy"]
    nonce = re.search(r"script-src 'nonce-([^']+)'", policy)
    assert nonce is not None and "unsafe-inline" not in policy.split("script-src")[1].split(";")[0]
    assert f'<script nonce="{nonce.group(1)}">' in page.text
    again = requests.get(f"{url}/dashboard", params={"token": token}, timeout=30)
    assert nonce.group(1) not in again.headers["Content-Security-Policy"]  # one per response
    state = requests.get(f"{url}/dashboard/state", headers={"Authorization": f"token {token}"}, timeout=30)
    assert state.headers["Referrer-Policy"] == "no-referrer"
    assert "script-src 'none'" in state.headers["Content-Security-Policy"]
