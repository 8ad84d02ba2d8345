"""Who may send what to the arbiter (shared/security/authorization.py, pure)."""

from __future__ import annotations

from shared import messages
from shared.security.authorization import arbiter_refusal

REPORT = {"host_id": "host-0", "gpus": 2, "idle": [1], "committed": 0, "jobs": []}


def test_only_the_operator_submits_lists_and_cancels_jobs() -> None:
    for msg_type in (messages.JOB_SUBMIT, messages.JOB_CANCEL, messages.JOB_LOGS, messages.ARBITER_STATUS):
        assert arbiter_refusal("operator", msg_type, {}) is None
        assert arbiter_refusal("host.host-0", msg_type, {}) == f"host.host-0 may not send {msg_type}"
        assert arbiter_refusal("gateway", msg_type, {}) == f"gateway may not send {msg_type}"
    assert arbiter_refusal("", messages.JOB_LIST, {}) == "unauthenticated peer"


def test_a_host_reports_only_for_itself() -> None:
    assert arbiter_refusal("host.host-0", messages.AGENT_REPORT, REPORT) is None
    assert arbiter_refusal("host.host-1", messages.AGENT_REPORT, REPORT) == (
        "host.host-1 may not report for host 'host-0'"
    )
    assert arbiter_refusal("operator", messages.AGENT_REPORT, REPORT) == "operator may not send agent.report"
