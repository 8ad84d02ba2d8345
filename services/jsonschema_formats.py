"""jsonschema builds a grammar of RFC 3987 (``rfc3987_syntax``, a lark parser) when it is imported,
to check the ``iri`` and ``iri-reference`` formats: over a CPU-second in every process that imports
Jupyter Server or nbformat (the HTTP API's start, ``tandem run``), for formats that none of their
schemas use (nbformat's notebook schemas; Jupyter Server's and jupyter_events' event schemas use
``uri`` and ``date-time``, which other checkers serve). Marking that optional module absent before
jsonschema loads skips the grammar; jsonschema then treats ``iri`` as it treats any format it has
no checker for: as an annotation."""

from __future__ import annotations

import sys

IRI_GRAMMAR = "rfc3987_syntax"


def skip_iri_grammar() -> bool:
    """Before jsonschema is imported: make its optional IRI checker's import fail (``None`` in
    ``sys.modules`` is how Python marks a module absent). False when it is too late (jsonschema
    is loaded already) or the module is already there: nothing is changed then."""
    if "jsonschema" in sys.modules or sys.modules.get(IRI_GRAMMAR) is not None:
        return False
    sys.modules[IRI_GRAMMAR] = None
    return True
