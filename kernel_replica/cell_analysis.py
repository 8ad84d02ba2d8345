"""What a cell may have changed in the user namespace, from its AST (NotebookOS §3.2.4).

The executor runs a cell, then must decide which names to replicate. Pickling the whole namespace
after every cell (``PickleDiffDetector``) is O(namespace bytes); this module narrows the search to
the names a cell can have touched: names it binds or deletes, modules it imports, functions and
classes it defines, objects it may mutate in place (attribute/subscript stores, method calls, names
passed to calls), and globals rebound by functions it calls (known from earlier cells through a
registry of ``FunctionFacts``). It is an over-approximation by design: anything it cannot see
through (``exec``, ``globals()``, unknown magics, star imports, syntax errors) sets ``unknown`` and
``names_to_check`` then returns every name. Pure: no I/O, no execution, no IPython state.
"""

from __future__ import annotations

import ast
import functools
import re
import shlex
import types
from collections.abc import Collection, Iterable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

# Builtins that read or write the namespace behind the AST's back.
_OPAQUE_NAMES = frozenset({"exec", "eval", "globals", "locals", "vars", "__builtins__", "__import__"})
# Line magics with no effect on the user namespace (beyond the assignment of their result).
_SAFE_LINE_MAGICS = frozenset(
    {
        "matplotlib", "load_ext", "reload_ext", "unload_ext", "config", "pip", "conda", "mamba",
        "who", "whos", "who_ls", "ls", "pwd", "cd", "env", "set_env", "autoreload", "aimport",
        "precision", "pdoc", "pdef", "psource", "pfile", "pinfo", "pinfo2", "history", "lsmagic",
        "magic", "page", "pprint", "xmode", "colors", "alias", "unalias", "system", "sx", "sc",
        "dirs", "dhist", "bookmark", "notebook", "qtconsole", "connect_info", "doctest_mode",
        "automagic", "autocall", "autoindent", "pdb", "tb", "killbgscripts", "gui",
    }
)  # fmt: skip
# Line magics that list the user namespace: every name must be there (a standby's loading ones too).
_NAMESPACE_LISTING_MAGICS = frozenset({"who", "whos", "who_ls"})
_CODE_LINE_MAGICS = frozenset({"time", "timeit", "prun"})  # run their argument as code in the namespace
_SAFE_CELL_MAGICS = frozenset(
    {"bash", "sh", "script", "html", "HTML", "javascript", "js", "markdown", "latex", "svg",
     "writefile", "perl", "ruby", "python2", "pypy", "sx", "system"}
)  # fmt: skip
_CODE_CELL_MAGICS = frozenset({"time", "timeit", "prun", "capture"})


@dataclass(frozen=True, slots=True)
class ImportRecord:
    """One imported name: replayed as an import on a standby rather than pickled."""

    module: str  # "a.b" for ``import a.b``; "x" for ``from x import y``; "" for ``from . import y``
    name: str | None  # the attribute of a from-import ("*" for a star import); None for ``import a``
    alias: str  # the name bound in the namespace ("a" for ``import a.b``); "*" for a star import
    level: int = 0  # leading dots of a relative import

    def statement(self) -> str:
        """Source that re-creates this binding."""
        if self.name is None:
            if self.alias == self.module.split(".")[0]:
                return f"import {self.module}"
            return f"import {self.module} as {self.alias}"
        source = "." * self.level + self.module
        if self.name == "*" or self.alias == self.name:
            return f"from {source} import {self.name}"
        return f"from {source} import {self.name} as {self.alias}"


@dataclass(frozen=True, slots=True)
class FunctionFacts:
    """What a notebook function may touch when it runs: names it rebinds, globals it reads."""

    globals_declared: frozenset[str] = frozenset()
    globals_read: frozenset[str] = frozenset()  # free names: may be mutated in place by the call


@dataclass(frozen=True, slots=True)
class CellEffects:
    bound: frozenset[str]  # every name bound at module level (assignments, defs, imports, ...)
    deleted: frozenset[str]  # names possibly unbound (``del x``; ``except ... as e`` unbinds e)
    imported: tuple[ImportRecord, ...]
    defined: frozenset[str]  # functions and classes defined at module level
    possibly_mutated: frozenset[str]  # names whose objects may have changed in place
    star_import: bool
    globals_declared: frozenset[str]  # may be rebound by functions defined or called here
    unknown: bool  # the analysis cannot bound the effects: check every name
    reasons: tuple[str, ...] = ()  # why ``unknown``
    functions: tuple[tuple[str, FunctionFacts], ...] = ()  # defined here ("f", "C.m"): for the registry
    lists_namespace: bool = False  # reads the namespace as a whole (``%who``, ``dir()``), changes nothing
    # dotted attributes the cell assigns or deletes (``pd.DataFrame.f = f`` -> ("pd", "DataFrame",
    # "f")): a library's module or class they change is no name's value (``library_patches``)
    attribute_targets: frozenset[tuple[str, ...]] = frozenset()

    def candidates(self) -> frozenset[str]:
        """Every name this cell can have touched (not counting ``unknown``)."""
        return self.bound | self.deleted | self.possibly_mutated | self.globals_declared | self.defined


@dataclass(slots=True)
class _Acc:
    bound: set[str] = field(default_factory=set)
    deleted: set[str] = field(default_factory=set)
    imported: list[ImportRecord] = field(default_factory=list)
    defined: set[str] = field(default_factory=set)
    mutated: set[str] = field(default_factory=set)
    star: bool = False
    globals_declared: set[str] = field(default_factory=set)
    reasons: list[str] = field(default_factory=list)
    functions: dict[str, FunctionFacts] = field(default_factory=dict)
    loaded: set[str] = field(default_factory=set)  # every Name loaded (for registry expansion)
    lists_namespace: bool = False
    method_calls: set[str] = field(default_factory=set)  # attribute names called: x.m() -> "m"
    aliases: dict[str, set[str]] = field(default_factory=dict)  # x -> names x may share objects with
    attribute_targets: set[tuple[str, ...]] = field(default_factory=set)  # CellEffects'

    def alias(self, target: ast.expr, value: ast.expr | None) -> None:
        """``x = y[0]`` then ``x.append(1)`` mutates y, even if x is rebound before the cell ends."""
        roots = _value_roots(value) if value is not None else set()
        if not roots:
            return
        for sub in ast.walk(target):
            if isinstance(sub, ast.Name):
                self.aliases.setdefault(sub.id, set()).update(roots)

    def mutated_with_aliases(self) -> set[str]:
        mutated = set(self.mutated)
        todo = list(mutated)
        while todo:
            for other in self.aliases.get(todo.pop(), ()):
                if other not in mutated:
                    mutated.add(other)
                    todo.append(other)
        return mutated


def dotted(node: ast.expr) -> tuple[str, ...] | None:
    """``a.b.c`` as ("a", "b", "c"); None for anything but names and attributes."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    parts.append(node.id)
    return tuple(reversed(parts))


def root_name(node: ast.expr) -> str | None:
    """The variable at the base of ``x.a[i].b(...).c``: the object a store or call on it can mutate."""
    while True:
        if isinstance(node, ast.Attribute | ast.Subscript | ast.Starred):
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, ast.Name):
            return node.id
        else:
            return None


def _argument_roots(node: ast.expr) -> set[str]:
    """Names whose objects a callee receives (directly, or inside a literal container)."""
    if isinstance(node, ast.Name | ast.Attribute | ast.Subscript | ast.Starred):
        root = root_name(node)
        return {root} if root else set()
    if isinstance(node, ast.List | ast.Tuple | ast.Set):
        return set().union(*(_argument_roots(e) for e in node.elts)) if node.elts else set()
    if isinstance(node, ast.Dict):
        parts = [_argument_roots(v) for v in node.values]
        parts += [_argument_roots(k) for k in node.keys if k is not None]
        return set().union(*parts) if parts else set()
    if isinstance(node, ast.NamedExpr):
        return {node.target.id} | _argument_roots(node.value)
    return set()


def _value_roots(node: ast.expr) -> set[str]:
    """Names whose objects an expression's value may be or contain (``y``, ``y.a[0]``, ``[y, z]``,
    ``d.get(k)``, ``a if c else b``)."""
    if isinstance(node, ast.Call):
        roots = _value_roots(node.func) if isinstance(node.func, ast.Attribute) else set()
        for arg in [*node.args, *(k.value for k in node.keywords)]:
            roots |= _argument_roots(arg)  # f(y) may return y or something inside it
        return roots
    if isinstance(node, ast.IfExp):
        return _value_roots(node.body) | _value_roots(node.orelse)
    if isinstance(node, ast.BoolOp):
        return set().union(*(_value_roots(v) for v in node.values))
    if isinstance(node, ast.Await):
        return _value_roots(node.value)
    return _argument_roots(node)


def _const_str(node: ast.expr | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _function_facts(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> FunctionFacts:
    """Globals a function declares and the free names it reads (over-approximated)."""
    declared: set[str] = set()
    nonlocal_: set[str] = set()
    local: set[str] = set()
    loads: set[str] = set()
    args = node.args
    for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
        if arg is not None:
            local.add(arg.arg)
    body: list[ast.AST] = list(node.body) if isinstance(node.body, list) else [node.body]
    for stmt in body:
        for sub in ast.walk(stmt):
            if isinstance(sub, ast.Global):
                declared.update(sub.names)
            elif isinstance(sub, ast.Nonlocal):
                nonlocal_.update(sub.names)
            elif isinstance(sub, ast.Name):
                (loads if isinstance(sub.ctx, ast.Load) else local).add(sub.id)
            elif isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                local.add(sub.name)
            elif isinstance(sub, ast.alias):
                local.add(sub.asname or sub.name.split(".")[0])
            elif isinstance(sub, ast.arg):
                local.add(sub.arg)
            elif isinstance(sub, ast.ExceptHandler) and sub.name:
                local.add(sub.name)
    local -= declared
    return FunctionFacts(frozenset(declared), frozenset((loads - local) | declared))


class _Scanner:
    def __init__(self, acc: _Acc, registry: Mapping[str, FunctionFacts]) -> None:
        self.acc = acc
        self.registry = registry

    # ----- statements -------------------------------------------------------------------------

    def stmts(self, body: Iterable[ast.stmt]) -> None:
        for stmt in body:
            self.stmt(stmt)

    def stmt(self, node: ast.stmt) -> None:
        acc = self.acc
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            acc.bound.add(node.name)
            acc.defined.add(node.name)
            self._signature(node)
            facts = _function_facts(node)
            acc.functions[node.name] = facts
            acc.globals_declared |= facts.globals_declared
        elif isinstance(node, ast.ClassDef):
            acc.bound.add(node.name)
            acc.defined.add(node.name)
            self.exprs([*node.bases, *(k.value for k in node.keywords), *node.decorator_list])
            self._class_body(node.name, node.body)
        elif isinstance(node, ast.Assign):
            self.expr(node.value)
            for target in node.targets:
                self.target(target)
                acc.alias(target, node.value)
        elif isinstance(node, ast.AugAssign):
            self.expr(node.value)
            acc.alias(node.target, node.value)
            if isinstance(node.target, ast.Name):
                acc.bound.add(node.target.id)
                acc.mutated.add(node.target.id)  # ``a += [1]`` extends the list in place
                acc.loaded.add(node.target.id)
            else:
                self.target(node.target)
        elif isinstance(node, ast.AnnAssign):
            self.expr(node.annotation)
            if node.value is not None:
                self.expr(node.value)
                self.target(node.target)
                acc.alias(node.target, node.value)
            elif not isinstance(node.target, ast.Name):
                self.expr(node.target)
        elif isinstance(node, ast.For | ast.AsyncFor):
            self.expr(node.iter)
            self._iterated(node.iter)
            self.target(node.target)
            acc.alias(node.target, node.iter)
            self.stmts(node.body)
            self.stmts(node.orelse)
        elif isinstance(node, ast.While | ast.If):
            self.expr(node.test)
            self.stmts(node.body)
            self.stmts(node.orelse)
        elif isinstance(node, ast.With | ast.AsyncWith):
            for item in node.items:
                self.expr(item.context_expr)
                root = root_name(item.context_expr)
                if root:  # __enter__/__exit__ may change the manager (a file closes)
                    acc.mutated.add(root)
                if item.optional_vars is not None:
                    self.target(item.optional_vars)
                    acc.alias(item.optional_vars, item.context_expr)
            self.stmts(node.body)
        elif isinstance(node, ast.Try | ast.TryStar):
            self.stmts(node.body)
            for handler in node.handlers:
                if handler.type is not None:
                    self.expr(handler.type)
                if handler.name:  # bound in the handler, unbound again when it ends
                    acc.bound.add(handler.name)
                    acc.deleted.add(handler.name)
                self.stmts(handler.body)
            self.stmts(node.orelse)
            self.stmts(node.finalbody)
        elif isinstance(node, ast.Match):
            self.expr(node.subject)
            for case in node.cases:
                self._pattern(case.pattern)
                for sub in ast.walk(case.pattern):
                    for name in (getattr(sub, "name", None), getattr(sub, "rest", None)):
                        if name:
                            acc.aliases.setdefault(name, set()).update(_value_roots(node.subject))
                if case.guard is not None:
                    self.expr(case.guard)
                self.stmts(case.body)
        elif isinstance(node, ast.Delete):
            for target in node.targets:
                self._delete(target)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                bound = alias.asname or alias.name.split(".")[0]
                acc.imported.append(ImportRecord(alias.name, None, bound))
                acc.bound.add(bound)
        elif isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if alias.name == "*":
                    acc.star = True
                    acc.imported.append(ImportRecord(node.module or "", "*", "*", node.level))
                    continue
                bound = alias.asname or alias.name
                acc.imported.append(ImportRecord(node.module or "", alias.name, bound, node.level))
                acc.bound.add(bound)
        elif isinstance(node, ast.Global):
            acc.globals_declared.update(node.names)
        else:  # Expr, Return, Raise, Assert, Pass, ...: evaluate whatever expressions they hold
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.expr):
                    self.expr(child)

    def _signature(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        """Decorators, defaults and annotations run at definition time, in module scope."""
        args = node.args
        parts: list[ast.expr] = [*args.defaults, *(d for d in args.kw_defaults if d is not None)]
        if not isinstance(node, ast.Lambda):
            parts += node.decorator_list
            if node.returns is not None:
                parts.append(node.returns)
            for arg in [*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg]:
                if arg is not None and arg.annotation is not None:
                    parts.append(arg.annotation)
        self.exprs(parts)

    def _class_body(self, prefix: str, body: list[ast.stmt]) -> None:
        """A class body runs now: its calls can mutate globals; its methods go to the registry."""
        acc = self.acc
        for stmt in body:
            if isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
                self._signature(stmt)
                facts = _function_facts(stmt)
                acc.functions[f"{prefix}.{stmt.name}"] = facts
                acc.globals_declared |= facts.globals_declared
            elif isinstance(stmt, ast.ClassDef):
                self.exprs([*stmt.bases, *(k.value for k in stmt.keywords), *stmt.decorator_list])
                self._class_body(f"{prefix}.{stmt.name}", stmt.body)
            elif isinstance(stmt, ast.Global):
                acc.globals_declared.update(stmt.names)
            else:  # class-level assignments bind class attributes: only their expressions matter
                for sub in ast.walk(stmt):
                    if isinstance(sub, ast.Global):
                        acc.globals_declared.update(sub.names)
                for child in ast.iter_child_nodes(stmt):
                    if isinstance(child, ast.expr) and not (
                        isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store)
                    ):
                        self.expr(child)

    def target(self, node: ast.expr) -> None:
        """A binding target: names are bound, attribute/subscript targets mutate their base."""
        if isinstance(node, ast.Name):
            self.acc.bound.add(node.id)
        elif isinstance(node, ast.Tuple | ast.List):
            for elt in node.elts:
                self.target(elt)
        elif isinstance(node, ast.Starred):
            self.target(node.value)
        elif isinstance(node, ast.Attribute | ast.Subscript):
            root = root_name(node)
            if root:
                self.acc.mutated.add(root)
            chain = dotted(node) if isinstance(node, ast.Attribute) else None
            if chain is not None:
                self.acc.attribute_targets.add(chain)
            self.expr(node.value)
            if isinstance(node, ast.Subscript):
                self.expr(node.slice)
        else:
            self.expr(node)

    def _delete(self, node: ast.expr) -> None:
        if isinstance(node, ast.Name):
            self.acc.deleted.add(node.id)
        elif isinstance(node, ast.Tuple | ast.List):
            for elt in node.elts:
                self._delete(elt)
        else:
            self.target(node)

    def _pattern(self, node: ast.pattern) -> None:
        for sub in ast.walk(node):
            if isinstance(sub, ast.MatchAs | ast.MatchStar) and sub.name:
                self.acc.bound.add(sub.name)
            elif isinstance(sub, ast.MatchMapping) and sub.rest:
                self.acc.bound.add(sub.rest)
            elif isinstance(sub, ast.MatchValue):
                self.expr(sub.value)
            elif isinstance(sub, ast.MatchClass):
                self.expr(sub.cls)

    def _iterated(self, node: ast.expr) -> None:
        """Iterating advances an iterator held in a name."""
        root = root_name(node)
        if root:
            self.acc.mutated.add(root)

    # ----- expressions ------------------------------------------------------------------------

    def exprs(self, nodes: Iterable[ast.expr]) -> None:
        for node in nodes:
            self.expr(node)

    def expr(self, node: ast.expr, *, in_lambda: bool = False) -> None:
        acc = self.acc
        stack: list[tuple[ast.AST, bool]] = [(node, in_lambda)]
        while stack:
            sub, lam = stack.pop()
            if isinstance(sub, ast.Name):
                if isinstance(sub.ctx, ast.Load):
                    acc.loaded.add(sub.id)
                    if sub.id in _OPAQUE_NAMES:
                        acc.reasons.append(f"uses {sub.id}")
                    elif sub.id == "get_ipython":
                        acc.reasons.append("uses get_ipython() beyond known magics")
                continue
            if isinstance(sub, ast.NamedExpr) and not lam:  # walrus binds in the module scope
                acc.bound.add(sub.target.id)
                acc.alias(sub.target, sub.value)
            elif isinstance(sub, ast.Lambda):
                self._signature(sub)
                stack.append((sub.body, True))  # may run now (df.apply): scan for mutations only
                continue
            elif isinstance(sub, ast.comprehension):
                self._iterated(sub.iter)
            elif isinstance(sub, ast.Call):
                if self._magic(sub):
                    continue
                self._call(sub)
            for child in ast.iter_child_nodes(sub):
                if isinstance(child, ast.Name) and isinstance(child.ctx, ast.Store):
                    continue  # comprehension targets and walrus targets stay local / handled above
                stack.append((child, lam))

    def _call(self, node: ast.Call) -> None:
        acc = self.acc
        func = node.func
        if isinstance(func, ast.Name):
            if func.id == "dir" and not node.args and not node.keywords:
                acc.lists_namespace = True
            if func.id in ("setattr", "delattr") and len(node.args) >= 2:
                # ``setattr(pd.DataFrame, "summary", f)``: the same target as the assignment
                owner, attr = dotted(node.args[0]), _const_str(node.args[1])
                if owner is not None and attr is not None:
                    acc.attribute_targets.add((*owner, attr))
            acc.mutated.add(func.id)  # a callable object (closure, model) may update itself
        elif isinstance(func, ast.Attribute):
            acc.method_calls.add(func.attr)
            root = root_name(func)
            if root:
                acc.mutated.add(root)
        for arg in [*node.args, *(k.value for k in node.keywords)]:
            acc.mutated |= _argument_roots(arg)

    def _magic(self, node: ast.Call) -> bool:
        """``get_ipython().run_line_magic(...)`` and friends, as IPython's transformer writes them."""
        func = node.func
        if not (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Call)
            and isinstance(func.value.func, ast.Name)
            and func.value.func.id == "get_ipython"
        ):
            return False
        acc = self.acc
        method = func.attr
        args = node.args
        if method in ("system", "getoutput", "set_next_input"):
            return True
        name = _const_str(args[0]) if args else None
        if method == "run_line_magic" and name is not None and len(args) >= 2:
            line = _const_str(args[1])
            if name in _SAFE_LINE_MAGICS:
                acc.lists_namespace |= name in _NAMESPACE_LISTING_MAGICS
                return True
            if name in _CODE_LINE_MAGICS and line is not None:
                self._nested(_strip_magic_options(line))
                return True
        elif method == "run_cell_magic" and name is not None and len(args) >= 3:
            line, cell = _const_str(args[1]), _const_str(args[2])
            if line is not None and cell is not None:
                if name in _SAFE_CELL_MAGICS:
                    acc.bound |= _output_options(line)
                    return True
                if name in _CODE_CELL_MAGICS:
                    if name == "capture":
                        acc.bound |= {w for w in _words(line) if not w.startswith("-")}
                    self._nested(cell)
                    return True
        acc.reasons.append(f"magic {method}({name!r}) may change the namespace")
        return True

    def _nested(self, source: str) -> None:
        """Code a magic runs in the user namespace: analysed like a cell and merged."""
        inner = analyse_cell(source, self.registry)
        acc = self.acc
        acc.bound |= inner.bound
        acc.deleted |= inner.deleted
        acc.imported += inner.imported
        acc.defined |= inner.defined
        acc.mutated |= inner.possibly_mutated  # already closed over the inner cell's aliases
        acc.star |= inner.star_import
        acc.lists_namespace |= inner.lists_namespace
        acc.globals_declared |= inner.globals_declared
        acc.reasons += inner.reasons
        acc.functions.update(inner.functions)


def _words(line: str) -> list[str]:
    try:
        return shlex.split(line)
    except ValueError:
        return line.split()


def _output_options(line: str) -> set[str]:
    """``%%bash --out x --err y`` binds x and y."""
    words = _words(line)
    return {words[i + 1] for i, w in enumerate(words[:-1]) if w in ("--out", "--err", "--proc")}


def _strip_magic_options(line: str) -> str:
    """``%timeit -n 3 -r 1 x = f()``: drop leading options so the rest parses as code."""
    words = line.split()
    i = 0
    while i < len(words) and words[i].startswith("-"):
        i += 2 if words[i] in ("-n", "-r", "-o", "-T", "-D", "-s", "-l") else 1
    return " ".join(words[i:]) if i else line


def _parse(source: str) -> tuple[ast.Module | None, str | None]:
    """The cell's AST; raw IPython syntax (``%time``, ``!ls``) is transformed first if needed."""
    try:
        return ast.parse(source), None
    except (SyntaxError, ValueError) as exc:
        error = f"{exc.__class__.__name__}: {exc}"
    try:
        from IPython.core.inputtransformer2 import TransformerManager

        transformed = TransformerManager().transform_cell(source)
        return ast.parse(transformed), None
    except Exception:  # IPython absent, or still not Python
        return None, error


def _expand_registry(acc: _Acc, registry: Mapping[str, FunctionFacts]) -> None:
    """Functions that may run in this cell (named anywhere, methods called by name, dunders)
    contribute their globals, transitively through the names they read."""
    todo = [key for key in registry if key in acc.loaded]
    for key in registry:
        _, _, method = key.rpartition(".")
        if "." in key and (
            method in acc.method_calls
            or key.split(".")[0] in acc.loaded
            or (method.startswith("__") and method.endswith("__"))
        ):
            todo.append(key)
    seen: set[str] = set()
    while todo:
        key = todo.pop()
        if key in seen:
            continue
        seen.add(key)
        facts = registry[key]
        acc.globals_declared |= facts.globals_declared
        acc.mutated |= facts.globals_read
        for name in facts.globals_read:
            if name in registry and name not in seen:
                todo.append(name)
            todo.extend(k for k in registry if k.startswith(f"{name}.") and k not in seen)


def analyse_cell(source: str, registry: Mapping[str, FunctionFacts] | None = None) -> CellEffects:
    """Effects of running ``source`` at module level.

    ``registry`` maps notebook functions and methods ("f", "C.m") defined by earlier cells to their
    facts (keep it with ``update_registry``); calling them adds what they rebind or read.
    """
    registry = dict(registry or {})
    tree, error = _parse(source)
    if tree is None:
        return CellEffects(
            frozenset(), frozenset(), (), frozenset(), frozenset(), False, frozenset(), True,
            (f"cannot parse: {error}",),
        )  # fmt: skip
    acc = _Acc()
    scanner = _Scanner(acc, registry)
    scanner.stmts(tree.body)
    _expand_registry(acc, {**registry, **acc.functions})
    reasons = list(dict.fromkeys(acc.reasons))
    if acc.star:
        reasons.append("star import")
    return CellEffects(
        bound=frozenset(acc.bound),
        deleted=frozenset(acc.deleted),
        imported=tuple(acc.imported),
        defined=frozenset(acc.defined),
        possibly_mutated=frozenset(acc.mutated_with_aliases()),
        star_import=acc.star,
        globals_declared=frozenset(acc.globals_declared),
        unknown=bool(acc.reasons),
        reasons=tuple(reasons),
        functions=tuple(sorted(acc.functions.items())),
        lists_namespace=acc.lists_namespace,
        attribute_targets=frozenset(acc.attribute_targets),
    )


def update_registry(registry: MutableMapping[str, FunctionFacts], effects: CellEffects) -> None:
    """Remember this cell's functions; forget functions it deleted or rebound to something else."""
    for name in effects.deleted | (effects.bound - effects.defined):
        registry.pop(name, None)
        for key in [k for k in registry if k.startswith(f"{name}.")]:
            del registry[key]
    for name in effects.defined:  # a redefined class drops its old methods
        for key in [k for k in registry if k.startswith(f"{name}.")]:
            del registry[key]
    registry.update(effects.functions)


def names_to_check(
    effects: CellEffects,
    namespace: Mapping[str, Any],
    *,
    replicated: Iterable[str] = (),
    shared_with: Mapping[str, Iterable[str]] | None = None,
) -> set[str]:
    """Names whose value may differ from the replicated one after the cell (conservative).

    ``replicated``: names the standbys hold (a candidate missing from ``namespace`` is a deletion).
    ``shared_with``: name -> names sharing objects with it, e.g. from ``ObjectCodec.sharing``;
    a mutation through one name changes them all. Names bound to the very same object as a
    candidate are added too (``b = a`` then ``b.append(1)``). The caller filters private names.
    """
    replicated_set = set(replicated)
    if effects.unknown or effects.star_import:
        return set(namespace) | replicated_set
    names = _reachable(set(effects.candidates()), namespace, shared_with)
    return {name for name in names if name in namespace or name in replicated_set}


_IDENTIFIER = re.compile(r"[^\W\d]\w*")


def names_to_load(
    effects: CellEffects,
    source: str,
    namespace: Mapping[str, Any],
    loading: Collection[str],
    *,
    shared_with: Mapping[str, Iterable[str]] | None = None,
) -> set[str] | None:
    """Of the names still ``loading`` here (a standby's large objects, ``lazy_load``), those the
    code ``source`` (with ``effects``, its analysis) may read or change: to load before it runs.
    None: every one (the analysis cannot bound what the code reaches, or it lists the namespace, as
    ``%who`` and ``dir()`` do, and must not miss a name still loading). Conservative: every
    identifier the text mentions (names in magics and strings too), what notebook code reachable
    from them mentions, and their sharers; call again once those are loaded (a loaded object's
    methods may mention more)."""
    if effects.unknown or effects.star_import or effects.lists_namespace:
        return None
    mentioned = mentioned_names(source) | set(effects.candidates())
    names = _reachable(
        {n for n in mentioned if n in namespace or n in loading}, namespace, shared_with, loading
    )
    return {name for name in names if name in loading}


def mentioned_names(source: str) -> set[str]:
    """Every identifier in the text (names in magics, strings and comments too)."""
    return set(_IDENTIFIER.findall(source))


_TRAILING_IDENTIFIER = re.compile(r"[^\W\d]\w*\Z")


def identifier_before(source: str, cursor: int) -> str:
    """The identifier that ends at ``cursor`` (what ``bi<tab>`` completes), or "" when none does
    (a completion after ``x.`` completes an attribute of ``x``, not a global name)."""
    before = source[: max(0, cursor)]
    match = _TRAILING_IDENTIFIER.search(before)
    if match is None:
        return ""
    start = match.start()
    return "" if start > 0 and before[start - 1] == "." else match.group()


def _reachable(
    names: set[str],
    namespace: Mapping[str, Any],
    shared_with: Mapping[str, Iterable[str]] | None,
    loading: Collection[str] = (),
) -> set[str]:
    """``names`` and every name a change through them may reach: their sharers, the globals of
    notebook code among them (``loading`` ones too), and other names bound to the same objects."""
    if shared_with:
        todo = list(names)
        while todo:
            for other in shared_with.get(todo.pop(), ()):
                if other not in names:
                    names.add(other)
                    todo.append(other)
    todo = [name for name in names if name in namespace]
    while todo:  # notebook code reachable from a candidate may rebind or mutate what it names
        for other in _code_globals(namespace[todo.pop()], namespace, loading):
            if other not in names:
                names.add(other)
                if other in namespace:
                    todo.append(other)
    ids = {id(namespace[name]) for name in names if name in namespace}
    names.update(name for name, value in namespace.items() if id(value) in ids)
    return names


def _code_names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def _code_globals(value: Any, namespace: Mapping[str, Any], loading: Collection[str] = ()) -> set[str]:
    """Namespace names that the notebook code behind ``value`` mentions (its bytecode's global and
    attribute names: an over-approximation). Complements the registry for functions the AST cannot
    follow: aliases (``g = f``), callbacks, functions from cells analysed before this process."""
    if isinstance(value, functools.partial):
        value = value.func
    if isinstance(value, types.MethodType):
        value = value.__func__
    functions: list[types.FunctionType] = []
    if isinstance(value, types.FunctionType):
        functions.append(value)
    else:
        cls = value if isinstance(value, type) else type(value)
        for klass in getattr(cls, "__mro__", ()):
            if klass.__module__ == namespace.get("__name__", "__main__"):
                functions += [f for f in vars(klass).values() if isinstance(f, types.FunctionType)]
    names: set[str] = set()
    for function in functions:
        if function.__globals__ is namespace:
            names |= _code_names(function.__code__)
    return {name for name in names if name in namespace or name in loading}
