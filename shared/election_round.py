"""Election rounds of one cell (NotebookOS §3.2.3: a failed election leads to a migration).

A cell whose election failed for lack of GPUs (every replica yielded, or the designated
executor's local scheduler refused to bind although the global scheduler's ledger said it could)
is sent again after a migration, with ``tandem_round: n`` in its header. Its first round's
outcome (and DONE) stay in the Raft log under the cell's msg_id, so the replicas elect the
executor afresh under a key of the round's own: the msg_id plus the round. That key is what the
replica proposes LEAD/YIELD and DONE for, what the local scheduler binds GPUs under, and what
``replica.event``s carry; the global scheduler maps it back to the client's msg_id. Round 0 (no
field) keys by the msg_id alone, so nothing changes for a cell elected the first time.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

ROUND_FIELD = "tandem_round"  # header field of a cell sent again after a failed election
# Header field of a ``yield_request`` the scheduler sent because the cell's designated candidate
# stayed silent: that candidate's id (the stand-ins do not wait ``election_wait_s`` for it again).
SILENT_FIELD = "tandem_silent_candidate"
# Header field of a ``yield_request`` the scheduler sent because the cell's executor died before
# replying: that executor's id. The survivors answer with the cell's outcome from the Raft log
# (its DONE, or the ``ExecutorLost`` one committed for it) and never run it.
OUTCOME_FIELD = "tandem_outcome_of"
# set by the scheduler, never by a client (stripped from a client's header before routing)
SCHEDULER_FIELDS = frozenset((ROUND_FIELD, SILENT_FIELD, OUTCOME_FIELD))
_SEPARATOR = ":round-"


def round_of(header: Mapping[str, Any]) -> int:
    """The election round a request's header carries (0 when none, or when malformed)."""
    value = header.get(ROUND_FIELD)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def election_key(msg_id: str, round_: int) -> str:
    """What the replicas elect (and the local scheduler binds GPUs) under for this round."""
    return msg_id if round_ <= 0 else f"{msg_id}{_SEPARATOR}{round_}"


def split_election_key(key: str) -> tuple[str, int]:
    """The client's msg_id and the round of an election key (``election_key``'s inverse)."""
    msg_id, separator, number = key.rpartition(_SEPARATOR)
    if separator and msg_id and number.isdigit() and int(number) > 0:
        return msg_id, int(number)
    return key, 0
