"""Namespaces of numpy arrays, views and subclasses, generated as notebook code, and the checks
that a replicated namespace is the same as the one the code makes in a plain dict.

A generated program is a list of cells (one statement each), drawn against a scratch namespace
so that every kept cell runs: bases of many dtypes and layouts, views of views (slices with
negative steps, transposes, reshapes, field and dtype views), ``recarray``, ``matrix``,
``MaskedArray`` (with masks and fill values), copies, rebinding and, for cell sequences,
in-place writes, masking and deletions. With ``tensors``, torch tensors on the arrays' memory
too (``torch.from_numpy``, ``t.numpy()``, tensor views): memory shared with no shared object.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import torch
from hypothesis import strategies as st

STRUCT = "[('a', 'i4'), ('b', 'f8'), ('c', 'S3')]"
DTYPES = ["float64", "float32", "int64", "int8", "uint16", "complex128", "bool", "M8[s]", "U3", "S2", STRUCT]
NUMERIC = ("f", "i", "u", "c")


def run(cells: list[str], ns: dict[str, Any] | None = None) -> dict[str, Any]:
    """The namespace ``cells`` make (the reference: no replication)."""
    ns = {"__name__": "__main__", "np": np, "torch": torch} if ns is None else ns
    for cell in cells:
        exec(cell, ns)
    return ns


def arrays(ns: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in ns.items() if isinstance(v, np.ndarray)}


def tensors(ns: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in ns.items() if isinstance(v, torch.Tensor)}


def _base(draw: st.DrawFn) -> str:
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=3)))
    n = math.prod(shape)
    if dtype == "bool":
        expr = f"(np.arange({n}) % 3 == 0)"
    elif dtype in ("U3", "S2"):
        expr = f"np.array([str(i) for i in range({n})], dtype={dtype!r})"
    elif dtype == "M8[s]":
        expr = f"np.arange({n}).astype('M8[s]')"
    elif dtype == STRUCT:
        expr = f"np.array([(i, i / 4, str(i)) for i in range({n})], dtype={STRUCT})"
    elif dtype == "complex128":
        expr = f"(np.arange({n}) * 1.5 + 0.5j)"
    else:
        expr = f"(np.arange({n}) * 1.5).astype({dtype!r})"
    expr = f"{expr}.reshape({shape})"  # a view of the arange (x2 = np.arange(12).reshape(3, 4))
    layout = draw(st.sampled_from(["view", "owner", "fortran"]))
    if layout == "owner":
        expr += ".copy()"
    elif layout == "fortran":
        expr = f"np.asfortranarray({expr})"
    return expr


def _index(draw: st.DrawFn, shape: tuple[int, ...]) -> str:
    parts = []
    for n in shape[: draw(st.integers(1, len(shape)))]:
        start = draw(st.one_of(st.none(), st.integers(-n, n)))
        stop = draw(st.one_of(st.none(), st.integers(-n, n)))
        step = draw(st.sampled_from([None, 1, 2, -1, -2, 3]))
        parts.append(":".join("" if x is None else str(x) for x in (start, stop, step)))
    return ", ".join(parts)


def _derived(draw: st.DrawFn, src: str, value: Any, with_tensors: bool) -> str:
    if isinstance(value, torch.Tensor):
        return _derived_tensor(draw, src, value)
    plain = type(value) is np.ndarray
    kind = value.dtype.kind
    ops = ["slice", "slice", "T", "all", "copy", "reshape", "alias", "reverse"]
    if plain and value.ndim <= 2 and kind in NUMERIC:
        ops.append("matrix")
    if plain and value.dtype.names:
        ops += ["recarray", "field"]
    if plain and kind in (*NUMERIC, "b"):
        ops += ["masked", "masked", "bytes"]
    if with_tensors:
        ops += ["tensor", "tensor"]
    op = draw(st.sampled_from(ops))
    if op == "tensor":
        return f"torch.from_numpy({src})"
    if op == "slice":
        return f"{src}[{_index(draw, value.shape)}]"
    if op == "masked":
        k = draw(st.integers(2, 4))
        fill = draw(st.sampled_from(["", ", fill_value=1"]))
        return f"np.ma.array({src}, mask=(np.arange({src}.size) % {k} == 0).reshape({src}.shape){fill})"
    return {
        "T": f"{src}.T",
        "all": f"{src}[...]",
        "copy": f"{src}.copy()",
        "reshape": f"{src}.reshape(-1)",
        "alias": src,
        "reverse": f"{src}[::-1]",
        "matrix": f"np.asmatrix({src})",
        "recarray": f"{src}.view(np.recarray)",
        "field": f"{src}['b']",
        "bytes": f"{src}.view(np.uint8)",
    }[op]


def _derived_tensor(draw: st.DrawFn, src: str, value: torch.Tensor) -> str:
    start = draw(st.integers(0, max(0, value.shape[0] - 1))) if value.dim() else 0
    return draw(
        st.sampled_from(
            [
                f"{src}.numpy()",
                f"{src}[{start}:].numpy()",
                f"{src}[{start}:]",
                f"{src}.T",
                f"{src}.clone()",
                f"torch.from_numpy({src}.numpy()[{start}:])",
                src,
            ]
        )
    )


def _mutation(draw: st.DrawFn, name: str, value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return draw(st.sampled_from([f"{name}.mul_(2)", f"{name}.fill_(3)", f"del {name}"]))
    ops = ["flat", "del"]
    if value.dtype.kind in NUMERIC and value.dtype.names is None:
        ops.append("scale")
    if isinstance(value, np.ma.MaskedArray):
        ops += ["mask", "mask", "unmask"]
    op = draw(st.sampled_from(ops))
    if op == "flat":
        return f"{name}.flat[0] = {name}.flat[-1]"
    if op == "scale":
        return f"{name}[...] *= 2"
    if op == "mask":
        return f"{name}[{draw(st.integers(0, 3))} % {name}.shape[0]] = np.ma.masked"
    if op == "unmask":
        return f"{name}.mask = False"
    return f"del {name}"


@st.composite
def programs(
    draw: st.DrawFn, *, max_cells: int = 8, mutations: bool = False, with_tensors: bool = False
) -> list[str]:
    """Cells, each kept only if it runs; the namespace they make has at least one array."""
    scratch = run([])
    cells: list[str] = []
    names = (f"a{i}" for i in itertools.count())
    for _ in range(draw(st.integers(1, max_cells))):
        existing = sorted(_values(scratch))
        choice = draw(
            st.sampled_from(["base", "derive", "derive", "mutate"] if mutations else ["base", "derive"])
        )
        if not existing or choice == "base":
            cell = f"{next(names)} = {_base(draw)}"
        elif choice == "derive":
            src = draw(st.sampled_from(existing))
            target = (
                next(names) if draw(st.booleans()) or len(existing) < 2 else draw(st.sampled_from(existing))
            )
            cell = f"{target} = {_derived(draw, src, scratch[src], with_tensors)}"
        else:
            name = draw(st.sampled_from(existing))
            cell = _mutation(draw, name, scratch[name])
        try:
            exec(cell, scratch)
        except Exception:
            continue
        cells.append(cell)
    if not arrays(scratch):
        cells.append(f"{next(names)} = {_base(draw)}")
    return cells


# ----- comparisons ---------------------------------------------------------------------------------


def _values(ns: dict[str, Any]) -> dict[str, Any]:
    return {**arrays(ns), **tensors(ns)}


def _memory(ns: dict[str, Any]) -> dict[str, np.ndarray]:
    """Every array of ``ns`` as a plain ndarray view, masks as entries of their own, every
    tensor as a numpy view of its elements."""
    out: dict[str, np.ndarray] = {name: t.numpy() for name, t in tensors(ns).items()}
    for name, value in arrays(ns).items():
        out[name] = np.ndarray.view(value, np.ndarray)
        mask = value._mask if isinstance(value, np.ma.MaskedArray) else np.ma.nomask
        if mask is not np.ma.nomask:
            out[name + ".mask"] = np.ndarray.view(mask, np.ndarray)
    return out


def _bytes(arr: np.ndarray) -> bytes:
    return np.ascontiguousarray(arr).tobytes()


def _fill_value(arr: np.ma.MaskedArray) -> bytes:
    """The fill value in effect, read on a view: the ``fill_value`` getter stores the default
    when none is set (a ``repr`` does it), which must not change the namespace compared."""
    return _bytes(np.asarray(arr.view().fill_value))


def assert_same_namespace(expected: dict[str, Any], actual: dict[str, Any], *, restored: bool) -> None:
    """Same names, classes, dtypes, layouts, bytes, masks, fill values and memory sharing.
    ``restored``: every array of ``actual`` was decoded, so one that owned its memory in
    ``expected`` must start on a 64-byte boundary."""
    assert sorted(arrays(expected)) == sorted(arrays(actual))
    assert sorted(tensors(expected)) == sorted(tensors(actual))
    for name, want in tensors(expected).items():
        got = actual[name]
        assert (got.dtype, got.shape) == (want.dtype, want.shape), name
        assert got.stride() == want.stride() or not want.numel(), name  # an empty one's are arbitrary
    for name, want in arrays(expected).items():
        got = actual[name]
        assert type(got) is type(want), name
        assert got.dtype == want.dtype and got.dtype.type is want.dtype.type, name
        assert got.shape == want.shape, name
        assert got.strides == want.strides or not want.size, name  # an empty array's are arbitrary
        assert got.flags.writeable == want.flags.writeable, name
        if isinstance(want, np.ma.MaskedArray):
            assert _bytes(np.ma.getmaskarray(got)) == _bytes(np.ma.getmaskarray(want)), name
            assert (got._mask is np.ma.nomask) == (want._mask is np.ma.nomask), name
            assert _fill_value(got) == _fill_value(want), name
            assert got.hardmask == want.hardmask, name
        if restored and want.base is None and want.size:
            assert got.ctypes.data % 64 == 0, f"{name} not 64-byte aligned"
    want_mem, got_mem = _memory(expected), _memory(actual)
    for name, want in want_mem.items():
        assert _bytes(got_mem[name]) == _bytes(want), name
    for a, b in itertools.combinations(sorted(want_mem), 2):
        assert np.shares_memory(got_mem[a], got_mem[b]) == np.shares_memory(want_mem[a], want_mem[b]), (a, b)


def assert_writes_alias_alike(expected: dict[str, Any], actual: dict[str, Any], seed: int) -> None:
    """Write the same bytes through each name (and mask) in both namespaces, in turn: every
    other name must show the same effect on both sides (aliasing kept, and none added)."""
    rng = np.random.default_rng(seed)
    want_mem, got_mem = _memory(expected), _memory(actual)
    for name in sorted(want_mem):
        want, got = want_mem[name], got_mem[name]
        if not want.flags.writeable or not want.size:
            continue
        if want.dtype == np.bool_:
            pattern = rng.random(want.shape) < 0.5
        else:
            raw = rng.bytes(want.size * want.dtype.itemsize)
            pattern = np.frombuffer(raw, dtype=want.dtype).reshape(want.shape)
        want[...] = pattern
        got[...] = pattern
        for other in want_mem:
            assert _bytes(got_mem[other]) == _bytes(want_mem[other]), f"write through {name}: {other} differs"
