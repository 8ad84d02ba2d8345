"""Who may send what to the checkpoint service (shared/security/authorization.py)."""

from __future__ import annotations

from shared import messages
from shared.security.authorization import checkpoint_refusal


def test_a_host_commits_reads_and_forgets_images_and_hands_over_journals_but_reads_no_status() -> None:
    assert checkpoint_refusal("host.h1", messages.CHECKPOINT_COMMIT) is None
    assert checkpoint_refusal("host.h1", messages.CHECKPOINT_WRITTEN) is None
    assert checkpoint_refusal("host.h1", messages.CHECKPOINT_LATEST) is None
    assert checkpoint_refusal("host.h1", messages.CHECKPOINT_FORGET) is None
    assert checkpoint_refusal("host.h1", messages.CHECKPOINT_STATUS) is not None


def test_the_operator_reads_and_forgets_but_commits_nothing() -> None:
    assert checkpoint_refusal("operator", messages.CHECKPOINT_FORGET) is None
    assert checkpoint_refusal("operator", messages.CHECKPOINT_STATUS) is None
    assert checkpoint_refusal("operator", messages.CHECKPOINT_COMMIT) is not None
    assert checkpoint_refusal("operator", messages.CHECKPOINT_WRITTEN) is not None


def test_other_services_and_unauthenticated_peers_are_refused() -> None:
    assert checkpoint_refusal("", messages.CHECKPOINT_LATEST) == "unauthenticated peer"
    assert checkpoint_refusal("gateway", messages.CHECKPOINT_LATEST) is not None
    assert checkpoint_refusal("replica.k/r", messages.CHECKPOINT_COMMIT) is not None
