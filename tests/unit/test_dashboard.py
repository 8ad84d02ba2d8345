"""The dashboard's rendering (pure: a ``tandem status --json`` in, HTML out) and what an action's
answer tells the operator."""

from __future__ import annotations

from typing import Any

from services.http_gateway.dashboard import action_message, host_usage, render_body, render_page


def status(**extra: Any) -> dict[str, Any]:
    return {
        "hosts": [
            {"id": "host-0", "gpus": 8, "committed": 2, "cordoned": False, "alive": True},
            {"id": "host-1", "gpus": 4, "committed": 0, "cordoned": True, "alive": True},
        ],
        "kernels": [
            {
                "id": "k-1234567890",
                "state": "running",
                "last_executor": "r2",
                "migrations": 1,
                "last_migration": {"replica": "r1", "new_replica": "r4", "from": "host-1", "to": "host-0",
                                   "reason": "host drained", "seconds": 1.5, "at": 0.0},
                "replicas": [
                    {"id": "r2", "host": "host-0", "role": "leader", "alive": True, "pid": 11},
                    {"id": "r4", "host": "host-0", "role": "follower", "alive": True, "pid": 12},
                ],
            }
        ],
        "cells": [{"kernel_id": "k-1234567890", "executor": "r2", "host": "host-0", "submitted_at": 0.0}],
        **extra,
    }  # fmt: skip


def test_without_an_arbiter_a_hosts_uncommitted_gpus_are_free() -> None:
    assert host_usage(status()) == {
        "host-0": {"cells": 2, "be": 0, "free": 6, "reserved": 0},
        "host-1": {"cells": 0, "be": 0, "free": 4, "reserved": 0},
    }


def test_the_arbiters_per_host_report_gives_the_best_effort_share() -> None:
    batch = {"usage": {"hosts": {"host-0": {"gpus": 8, "cells": 2, "be": 3, "free": 2, "reserved": 1}}}}
    usage = host_usage(status(batch=batch))
    assert usage["host-0"] == {"cells": 2, "be": 3, "free": 2, "reserved": 1}
    assert usage["host-1"]["free"] == 4  # not reported by the arbiter (yet): the scheduler's view


def test_the_page_shows_hosts_kernels_replicas_cells_and_migrations() -> None:
    html = render_body(status())
    assert 'id="host-host-1" data-state="cordoned"' in html and 'data-action="uncordon"' in html
    assert 'id="kernel-k-1234567890" data-state="running"' in html
    assert '<li class="replica executor" data-replica="r2">' in html
    assert "host drained" in html and "r1 → r4" in html
    assert "this cluster runs no arbiter" in html


def test_names_from_the_cluster_are_escaped() -> None:
    hostile = status()
    hostile["hosts"][0]["id"] = '<script>alert("x")</script>'
    html = render_page(hostile)
    assert '<script>alert("x")</script>' not in html and "&lt;script&gt;" in html


def test_an_unreachable_cluster_is_said_on_the_page() -> None:
    assert "cluster unreachable: no Tandem cluster is running" in render_page(
        None, "no Tandem cluster is running"
    )


def test_a_drain_that_left_replicas_behind_is_a_failure_with_the_reasons() -> None:
    ok, text = action_message(
        "drain", "host-0", {"moved": [{}], "failed": [{"kernel": "k", "replica": "r1", "reason": "no room"}]}
    )
    assert not ok and "1 replicas moved" in text and "k/r1: no room" in text
    assert action_message("cordon", "host-0", {}) == (True, "host-0: cordoned")
    assert action_message("restart", "k/r2", {"replicas": [{"id": "r2", "pid": 7}]}) == (
        True,
        "k/r2: restarted (pid 7)",
    )
