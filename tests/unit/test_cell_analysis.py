"""AST-guided change analysis: each binding/mutation form, magics, registry, and a soundness property."""

from __future__ import annotations

import contextlib
import textwrap
from typing import Any

import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kernel_replica.cell_analysis import (
    CellEffects,
    FunctionFacts,
    ImportRecord,
    analyse_cell,
    names_to_check,
    update_registry,
)
from kernel_replica.object_codec import ObjectCodec, dumps


def fx(source: str, registry: dict[str, FunctionFacts] | None = None) -> CellEffects:
    return analyse_cell(textwrap.dedent(source), registry)


def test_assignment_forms_bind_names() -> None:
    e = fx("x, (y, *z) = 1, (2, 3)\nw: int = 4\nv: int\n(q := 5)\n[r := i for i in range(3)]")
    assert e.bound == {"x", "y", "z", "w", "q", "r"}
    assert not e.unknown and "i" not in e.bound and "v" not in e.bound


def test_augmented_assignment_binds_and_mutates() -> None:
    e = fx("a += [1]\nb.c[0] += 2\nd[k] -= 1")
    assert e.bound == {"a"} and {"a", "b", "d"} <= e.possibly_mutated


def test_loop_with_except_match_targets() -> None:
    e = fx(
        """
        for i, (j, k) in pairs:
            pass
        with open(p) as fh, lock:
            pass
        try:
            pass
        except ValueError as err:
            pass
        match v:
            case [a, *rest]:
                pass
            case {"k": q, **kw}:
                pass
            case Point(x=px) as whole:
                pass
        """
    )
    assert {"i", "j", "k", "fh", "err", "a", "rest", "q", "kw", "px", "whole"} <= e.bound
    assert "err" in e.deleted  # unbound again when the handler ends
    assert {"pairs", "lock"} <= e.possibly_mutated  # iterators advance; managers enter/exit


def test_deletions() -> None:
    e = fx("del a, (b, c)\ndel d[0], e.f")
    assert e.deleted == {"a", "b", "c"} and {"d", "e"} <= e.possibly_mutated


def test_imports_are_recorded_and_replayable() -> None:
    e = fx("import numpy as np, os.path\nfrom a.b import c as d, e\nfrom . import sib")
    assert e.imported == (
        ImportRecord("numpy", None, "np"),
        ImportRecord("os.path", None, "os"),
        ImportRecord("a.b", "c", "d"),
        ImportRecord("a.b", "e", "e"),
        ImportRecord("", "sib", "sib", 1),
    )
    assert [r.statement() for r in e.imported] == [
        "import numpy as np",
        "import os.path",
        "from a.b import c as d",
        "from a.b import e",
        "from . import sib",
    ]
    assert {"np", "os", "d", "e", "sib"} <= e.bound and not e.star_import


def test_star_import_is_flagged_and_checks_everything() -> None:
    e = fx("from math import *")
    assert e.star_import and e.imported[0].name == "*"
    assert names_to_check(e, {"x": 1, "pi": 3.14}) == {"x", "pi"}


def test_mutation_forms() -> None:
    e = fx("a.x = 1\nb[0] = 2\nc.append(3)\nf(d, k=[e], **{'z': g})\nh.i.j.update()\nm(n.o[1])\nmodel(inp)")
    assert {"a", "b", "c", "d", "e", "g", "h", "n", "model", "inp", "f", "m"} <= e.possibly_mutated
    assert not e.bound


def test_reads_are_not_mutations() -> None:
    e = fx("y = x + 1\nz = x.attr\nw = x[0]")
    assert "x" not in e.possibly_mutated and e.bound == {"y", "z", "w"}


def test_lambda_bodies_scanned_for_mutations_but_bind_nothing() -> None:
    e = fx("df.apply(lambda r: seen.append(r))\ng = lambda: (t := 1)")
    assert {"df", "seen"} <= e.possibly_mutated and "t" not in e.bound and "g" in e.bound


def test_functions_and_classes_defined_with_global_declarations() -> None:
    e = fx(
        """
        @deco(cfg)
        def f(x=default):
            global G
            G = x
            log.append(x)

        class C(Base):
            counter = make(registry)
            def m(self):
                global H
                H = 1
        """
    )
    assert e.defined == {"f", "C"} and {"f", "C"} <= e.bound
    assert e.globals_declared == {"G", "H"}
    assert {"cfg", "registry"} <= e.possibly_mutated  # decorators and class bodies run now
    facts = dict(e.functions)
    assert facts["f"].globals_declared == {"G"} and "log" in facts["f"].globals_read
    assert "x" not in facts["f"].globals_read and facts["C.m"].globals_declared == {"H"}


def test_registry_calls_from_later_cells() -> None:
    registry: dict[str, FunctionFacts] = {}
    update_registry(registry, fx("def bump():\n    global n\n    n += 1\ndef add(v):\n    items.append(v)"))
    update_registry(registry, fx("def outer():\n    bump()"))
    e = fx("outer()", registry)
    assert "n" in e.globals_declared  # transitively through outer -> bump
    e = fx("add(3)", registry)
    assert "items" in e.possibly_mutated
    e = fx("sorted(xs, key=add)", registry)  # passed, may be called by the library
    assert "items" in e.possibly_mutated
    assert not fx("y = 1", registry).globals_declared
    update_registry(registry, fx("bump = 3"))
    assert "bump" not in registry


def test_method_registry() -> None:
    registry: dict[str, FunctionFacts] = {}
    update_registry(
        registry, fx("class Acc:\n    def add(self, v):\n        global total\n        total += v")
    )
    assert "total" in fx("acc.add(1)", registry).globals_declared
    update_registry(registry, fx("class Acc:\n    pass"))
    assert "Acc.add" not in registry


def test_magics() -> None:
    assert fx("%time x = f(y)").bound == {"x"}
    assert fx("%timeit -n 2 -r 1 z = 1").bound == {"z"}
    assert fx("%matplotlib inline").bound == frozenset() and not fx("%matplotlib inline").unknown
    assert fx("!ls").bound == frozenset() and fx("files = !ls").bound == {"files"}
    e = fx("%%capture out\nq = 1\n")
    assert e.bound == {"out", "q"} and not e.unknown
    assert fx("%%bash --out o\necho hi\n").bound == {"o"}
    assert fx("%%time\nk = 2\n").bound == {"k"}
    for source in ("%run script.py", "%reset -f", "%store -r x", "%%writefile2 x\n"):
        assert fx(source).unknown, source
    transformed = "get_ipython().run_line_magic('time', 'x = 1')"
    assert analyse_cell(transformed).bound == {"x"}


def test_opaque_code_is_unknown() -> None:
    for source in ("exec('a = 1')", "globals()['a'] = 1", "eval(s)", "vars()['b'] = 2", "ip = get_ipython()"):
        e = fx(source)
        assert e.unknown and e.reasons, source
    assert names_to_check(fx("exec(s)"), {"a": 1}, replicated=["gone"]) == {"a", "gone"}


def test_syntax_error_is_unknown_not_an_exception() -> None:
    e = fx("def (:\n")
    assert e.unknown and "cannot parse" in e.reasons[0]


def test_names_to_check_filters_expands_aliases_and_sharing() -> None:
    shared = [1]
    ns: dict[str, Any] = {"a": shared, "b": shared, "c": [2], "d": 3, "m": object(), "o": object()}
    e = fx("a.append(1)\nprint(x)")
    assert names_to_check(e, ns) == {"a", "b"}  # print/x are not in the namespace; b is a
    assert names_to_check(e, ns, shared_with={"a": ["c"]}) == {"a", "b", "c"}
    assert names_to_check(fx("del d"), {"a": 1}, replicated=["d"]) == {"d"}
    assert names_to_check(fx("o.step()"), ns, shared_with={"o": ["m"], "m": ["o"]}) == {"o", "m"}


# ----- soundness: whatever a generated cell changes is found by analysis + sharing --------------

SETUP = """
import contextlib, sys, types
# a module of its own per namespace: the templates set attributes on what they import, and on a
# real one (math) that leaked into other tests' star imports
sys.modules["tandem_scratch_module"] = types.ModuleType("tandem_scratch_module")
class Obj:
    def __init__(self):
        self.v = [0]
def bump():
    global e
    e = e + 1
def push(x):
    d.append(x)
@contextlib.contextmanager
def ctx():
    yield [5]
"""

TEMPLATES = [
    "{x} = {y}",
    "{x} = {y}[0]",
    "{x}.append(1)",
    "{x} += [1]",
    "{x}[0] = 5",
    "{x}[0].append(6)",
    "{x}.v = 3",
    "{x}.v.append(4)",
    "del {x}",
    "for {x} in range(2):\n    pass",
    "with ctx() as {x}:\n    pass",
    "try:\n    raise ValueError\nexcept ValueError as {x}:\n    pass",
    "({x} := [7])",
    "bump()",
    "push({y})",
    "h = lambda: {x}.append(2)\nh()",
    "def g():\n    global {x}\n    {x} = 9\ng()",
    "match {y}:\n    case [{x}, *_]:\n        pass\n    case _:\n        pass",
    "import tandem_scratch_module as {x}",
    "if True:\n    {x} = [1]",
    "[{x}.append(i) for i in range(2)]",
    "{x}, *{y} = [1, 2, 3]",
    "list.append({x}, 8)",
    "k = push\nk({y})",
    "{x} = {y}.v",
    "sorted([1], key=lambda _: {x}.append(0))",
    "{x} = [{y}]\n{x}[0].append(1)",
    "{x} = list({y})\n{x}[0].append(1)",
    "{x}.clear()",
]
NAMES = ["a", "b", "c", "d", "e", "o"]


def _fresh_namespace() -> tuple[dict[str, Any], dict[str, FunctionFacts]]:
    ns: dict[str, Any] = {"__name__": "__main__"}
    exec(compile(SETUP, "<setup>", "exec"), ns)
    registry: dict[str, FunctionFacts] = {}
    update_registry(registry, analyse_cell(SETUP))
    ns.update(a=[[1], [2]], b={"k": [3]}, c=[[4]], d=[4], e=0, o=ns["Obj"]())
    ns["c"].append(ns["a"][0])  # c and a share a list from the start
    return ns, registry


def _digests(ns: dict[str, Any]) -> dict[str, bytes]:
    """Value digests as the codec pickles (functions linked to ``ns``, not carrying its values)."""
    out = {}
    for name, value in ns.items():
        if name.startswith("__"):
            continue
        pickled, buffers = dumps({"v": value}, namespace=ns)
        h = xxhash.xxh3_128(pickled)
        for buf in buffers:
            h.update(buf.raw())
        out[name] = h.digest()
    return out


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from(TEMPLATES), st.sampled_from(NAMES), st.sampled_from(NAMES)),
        min_size=1,
        max_size=4,
    )
)
def test_analysis_plus_sharing_finds_every_change(program: list[tuple[str, str, str]]) -> None:
    ns, registry = _fresh_namespace()
    user = [n for n in ns if not n.startswith("__")]
    codec = ObjectCodec(None)
    codec.plan(ns, [], universe=user)  # the executor's index as of the last replication
    before = _digests(ns)
    source = "\n".join(t.format(x=x, y=y) for t, x, y in program)
    with contextlib.suppress(Exception):  # a failing cell keeps the effects of what ran
        exec(compile(source, "<cell>", "exec"), ns)
    after = _digests(ns)
    changed = {n for n in after if before.get(n) != after[n]}
    deleted = set(before) - set(after)
    effects = analyse_cell(source, registry)
    names = names_to_check(effects, ns, replicated=before, shared_with=codec.sharing())
    groups, _ = codec.plan(ns, names)
    encoded = {n for g in groups for n in g}
    assert deleted <= names, source
    assert changed <= encoded, (source, changed - encoded)


def test_names_to_check_follows_notebook_code_without_a_registry() -> None:
    ns: dict[str, Any] = {"__name__": "__main__"}
    exec("def f():\n    log.append(1)\nclass K:\n    def go(self):\n        hits.append(1)\n", ns)
    ns.update(log=[], hits=[], g=ns["f"], k=ns["K"](), other=[])
    assert names_to_check(fx("g()"), ns) >= {"g", "log"}  # an alias the registry cannot see
    assert names_to_check(fx("k.go()"), ns) >= {"k", "hits"}
    assert "other" not in names_to_check(fx("g()"), ns)


def test_aliases_made_in_the_cell_carry_mutations_back() -> None:
    e = fx("e = b\ne[0] = 5\ne = 1")
    assert "b" in e.possibly_mutated
    e = fx("row = rows[0] if flag else other\nrow.append(1)")
    assert {"rows", "other"} <= e.possibly_mutated
    e = fx("item = d.get('k')\nitem.x = 1")
    assert "d" in e.possibly_mutated
    e = fx("match cfg:\n    case {'opts': o}:\n        o.update(a=1)")
    assert "cfg" in e.possibly_mutated
    assert "y" not in fx("x = y\nx = 2").possibly_mutated  # rebinding alone mutates nothing
