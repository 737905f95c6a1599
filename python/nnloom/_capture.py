"""Capture of a ``with`` block's body: source lookup, parsing, compilation.

A trace's body is not run where it stands. At ``__enter__`` the caller's frame
is inspected, the ``with`` statement at its current line is found in the
source (a file, an IPython cell, or ``python -c``), and its body is compiled
into a code object of its own, under the original file name and line numbers
so tracebacks point at the user's lines. The result is memoised per call site
(code object + line), so a trace in a loop parses once.
"""

from __future__ import annotations

import ast
import copy
import linecache
import sys
import types

__all__ = ["Site", "SourceError", "capture"]


class SourceError(ValueError):
    """The ``with`` block of a trace cannot be captured (and was not run)."""


class Site:
    """One captured ``with`` block (shared by every run of that call site)."""

    __slots__ = ("code", "first_line", "stores", "has_invokes", "trivial", "filename", "line",
                 "invokes")

    def __init__(self, code, first_line, stores, has_invokes, trivial, filename, line,
                 invokes=()):
        self.code: types.CodeType = code  # the body, compiled in "exec" mode
        self.first_line: int = first_line  # line of the body's first statement
        self.stores: tuple = stores  # names the body binds at its own level
        self.has_invokes: bool = has_invokes  # contains ``with <x>.invoke(...)``
        self.trivial: bool = trivial  # only pass / docstrings / ...: nothing to skip
        self.filename: str = filename
        self.line: int = line
        self.invokes: tuple = invokes  # Sites of the invoke blocks, compiled ahead


_SITES: dict = {}  # (code object, line) -> Site
_TREES: dict = {}  # filename or source text -> parsed module


def _source_of(frame) -> str:
    filename = frame.f_code.co_filename
    lines = linecache.getlines(filename, frame.f_globals)
    if lines:
        return "".join(lines)
    if filename == "<string>":
        argv = getattr(sys, "orig_argv", [])
        if "-c" in argv and argv.index("-c") + 1 < len(argv):
            return argv[argv.index("-c") + 1]
        why = "it was compiled from a string (exec/eval), which keeps no source"
    elif filename == "<stdin>":
        why = "it was typed at an interactive prompt or piped through stdin, which keeps no source"
    elif filename.startswith("<"):
        why = f"it comes from {filename}, which keeps no source"
    else:
        why = f"the file {filename!r} cannot be read"
    raise SourceError(
        f"cannot capture the trace at {filename}:{frame.f_lineno}: {why}. "
        "Put the trace in a file, a notebook cell, or a `python -c` program."
    )


def _parse(frame) -> ast.Module:
    filename = frame.f_code.co_filename
    key = filename
    tree = _TREES.get(key)
    if tree is None:
        src = _source_of(frame)
        try:
            tree = ast.parse(src, filename)
        except SyntaxError as e:
            raise SourceError(f"cannot parse the source of {filename}: {e}") from None
        _TREES[key] = tree
    return tree


def _find_with(tree: ast.AST, line: int):
    """The innermost with statement whose header spans `line`."""
    best = None
    for node in ast.walk(tree):
        if isinstance(node, (ast.With, ast.AsyncWith)) and node.body:
            end = max(node.lineno, node.body[0].lineno - 1)
            if node.lineno <= line <= end and (best is None or node.lineno >= best.lineno):
                best = node
    return best


_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
_COMPS = (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


def _stores(body) -> tuple:
    """Names bound at the body's own level (not inside nested scopes)."""
    out: dict = {}

    def visit(node):
        if isinstance(node, _SCOPES):
            if not isinstance(node, ast.Lambda):
                out[node.name] = None
            for d in getattr(node, "decorator_list", ()):
                visit(d)
            return
        if isinstance(node, _COMPS):
            return
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            out[node.id] = None
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                out[(a.asname or a.name).split(".")[0]] = None
        elif isinstance(node, ast.NamedExpr):
            out[node.target.id] = None
        for child in ast.iter_child_nodes(node):
            visit(child)

    for stmt in body:
        visit(stmt)
    return tuple(out)


def _is_invoke(node) -> bool:
    if not isinstance(node, (ast.With, ast.AsyncWith)):
        return False
    for item in node.items:
        e = item.context_expr
        if isinstance(e, ast.Call) and isinstance(e.func, ast.Attribute) and e.func.attr == "invoke":
            return True
    return False


def _trivial(body) -> bool:
    for stmt in body:
        if isinstance(stmt, ast.Pass):
            continue
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            continue
        return False
    return True


INVOKE_HOOK = "__nnloom_invoke__"


def _compile_body(body, filename, name, qualname):
    module = ast.Module(body=body, type_ignores=[])
    code = compile(module, filename, "exec", dont_inherit=True)
    if hasattr(code, "co_qualname"):
        return code.replace(co_name=name, co_qualname=qualname)
    return code.replace(co_name=name)  # pragma: no cover - 3.10


class _InvokeLifter(ast.NodeTransformer):
    """Compiles each ``with <x>.invoke(...) [as y]:`` block of a trace body
    ahead of time and replaces the statement with
    ``[y =] __nnloom_invoke__(<x>.invoke(...), k)``: the body runs later as
    the invoke's coroutine, so nothing has to stop it from running inline."""

    def __init__(self, filename, name, qualname):
        self.filename, self.name, self.qualname = filename, name, qualname
        self.sites: list = []

    # nested scopes keep their withs as they are (captured at run time)
    def visit_FunctionDef(self, node):
        return node

    visit_AsyncFunctionDef = visit_FunctionDef
    visit_ClassDef = visit_FunctionDef
    visit_Lambda = visit_FunctionDef

    def visit_With(self, node):
        if not (_is_invoke(node) and len(node.items) == 1):
            return self.generic_visit(node)
        item = node.items[0]
        first = node.body[0]
        if first.lineno == node.lineno or isinstance(first, _TRY):
            return node  # left to the run-time capture, which explains the error
        k = len(self.sites)
        code = _compile_body(node.body, self.filename, self.name, self.qualname)
        self.sites.append(Site(code, first.lineno, _stores(node.body), False,
                               _trivial(node.body), self.filename, node.lineno))
        call = ast.Call(func=ast.Name(INVOKE_HOOK, ast.Load()),
                        args=[item.context_expr, ast.Constant(k)], keywords=[])
        if item.optional_vars is not None:
            new = ast.Assign(targets=[item.optional_vars], value=call)
        else:
            new = ast.Expr(call)
        return ast.copy_location(new, node)


_TRY = (ast.Try,) + ((ast.TryStar,) if hasattr(ast, "TryStar") else ())


def capture(frame, what: str = "trace") -> Site:
    """The Site of the with block being entered in `frame` (memoised)."""
    key = (frame.f_code, frame.f_lineno)
    site = _SITES.get(key)
    if site is not None:
        return site
    tree = _parse(frame)
    node = _find_with(tree, frame.f_lineno)
    filename = frame.f_code.co_filename
    where = f"{filename}:{frame.f_lineno}"
    if node is None:
        raise SourceError(
            f"no `with` statement found at {where}: use the {what} as `with ...{what}(...):`"
        )
    first = node.body[0]
    if first.lineno == node.lineno:
        raise SourceError(
            f"the body of the {what} at {where} is written on the `with` line; "
            "start it on a line of its own below the `with`"
        )
    if isinstance(first, _TRY):
        raise SourceError(
            f"the body of the {what} at {where} starts with `try:`; put another statement "
            "first (or move the try into a function called from the body)"
        )
    name = frame.f_code.co_name
    qualname = getattr(frame.f_code, "co_qualname", name)
    has_invokes = any(_is_invoke(n) for stmt in node.body for n in ast.walk(stmt))
    body = node.body
    invokes: tuple = ()
    if has_invokes:
        lifter = _InvokeLifter(filename, name, qualname)
        body = [lifter.visit(copy.deepcopy(stmt)) for stmt in node.body]
        body = [ast.fix_missing_locations(b) for b in body]
        invokes = tuple(lifter.sites)
    code = _compile_body(body, filename, name, qualname)
    site = Site(code, first.lineno, _stores(node.body), has_invokes, _trivial(node.body),
                filename, frame.f_lineno, invokes)
    _SITES[key] = site
    return site
