"""The replica's modules import neither torch nor numpy, and its codec still decodes arrays in a
process that has not imported numpy (it imports it then). Each check runs in a
fresh interpreter: this test process has imported both long ago."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from kernel_replica import object_codec
from kernel_replica.lazy_modules import Deferred, is_ndarray, is_tensor

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "numpy")


def _fresh(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_replica_modules_import_neither_torch_nor_numpy() -> None:
    loaded = _fresh(
        "import sys\n"
        "import kernel_replica.__main__, kernel_replica.kernel, kernel_replica.raft_bridge\n"
        "import kernel_replica.state_sync, kernel_replica.fingerprint, kernel_replica.object_codec\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    )
    assert loaded == "[]"


def test_codec_and_fingerprints_of_plain_values_import_nothing_heavy() -> None:
    loaded = _fresh(
        "import asyncio, sys\n"
        "from kernel_replica.object_codec import ObjectCodec, decode_all\n"
        "from kernel_replica.fingerprint import fingerprint\n"
        "ns = {'rows': [{'i': i} for i in range(100)], 'f': lambda x: x + 1, 'b': bytearray(10)}\n"
        "codec = ObjectCodec(None)\n"
        "result = asyncio.run(codec.encode(ns, list(ns)))\n"
        "back = asyncio.run(decode_all(codec, result.groups, {}))\n"
        "assert back['rows'] == ns['rows'] and back['f'](1) == 2\n"
        "assert all(fingerprint(v) for v in ns.values())\n"
        f"print(sorted(m for m in {HEAVY!r} if m in sys.modules))"
    )
    assert loaded == "[]"


def test_a_process_without_numpy_decodes_arrays(tmp_path: Path) -> None:
    """(Tensors: tests/integration/test_replica_imports.py, where standbys decode one.)"""
    base = np.arange(12, dtype=np.float32)
    values = {"a": base, "view": base[2:5]}
    pickled, buffers = object_codec.dumps(values)
    dump = tmp_path / "values.pickle"
    dump.write_bytes(pickle.dumps((pickled, [bytes(b.raw()) for b in buffers])))
    out = _fresh(
        "import pickle, sys\n"
        "from kernel_replica import object_codec\n"
        f"before = sorted(m for m in {HEAVY!r} if m in sys.modules)\n"
        f"pickled, buffers = pickle.loads(open({str(dump)!r}, 'rb').read())\n"
        "v = object_codec.loads(pickled, [bytearray(b) for b in buffers])\n"
        "print(before, v['a'].sum(), v['view'].base is v['a'], v['view'].tolist())"
    )
    assert out == "[] 66.0 True [2.0, 3.0, 4.0]"


def test_type_checks_see_arrays_and_tensors_once_their_library_is_imported() -> None:
    assert is_ndarray(np.zeros(1)) and not is_ndarray([0.0]) and not is_ndarray(torch.zeros(1))
    assert is_tensor(torch.zeros(1)) and not is_tensor(np.zeros(1))
    assert Deferred("math").sqrt(4.0) == 2.0


def test_the_http_api_and_tandem_run_skip_jsonschemas_iri_grammar_and_still_validate() -> None:
    """A second of CPU at every start of the HTTP API (services/jsonschema_formats.py): its
    process loads Jupyter Server without the RFC 3987 grammar, and notebooks and Jupyter's events
    are still validated (a notebook missing a required field is refused)."""
    loaded = _fresh(
        "import sys\n"
        "import services.http_gateway.app\n"
        "import jsonschema, nbformat\n"
        "from jupyter_events import EventLogger\n"
        "nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell('1')])\n"
        "nbformat.validate(nb)\n"
        "del nb['cells'][0]['source']\n"
        "try:\n"
        "    nbformat.validate(nb)\n"
        "except nbformat.ValidationError:\n"
        "    pass\n"
        "else:\n"
        "    raise SystemExit('an invalid notebook passed')\n"
        "print(sys.modules.get('rfc3987_syntax', 'loaded') is None)"
    )
    assert loaded == "True"


def test_skipping_the_iri_grammar_changes_nothing_once_jsonschema_is_loaded() -> None:
    import jsonschema  # noqa: F401  (this process has it loaded, as any process may)

    from services.jsonschema_formats import IRI_GRAMMAR, skip_iri_grammar

    before = sys.modules.get(IRI_GRAMMAR, "absent")
    assert skip_iri_grammar() is False
    assert sys.modules.get(IRI_GRAMMAR, "absent") is before
