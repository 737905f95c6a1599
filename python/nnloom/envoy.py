"""Envoy: the proxy tree over a wrapped ``torch.nn.Module``.

``NNsight(module)`` installs nnloom's forward wrappers on every submodule once
(``nnloom._C.Tree``) and mirrors the module tree with Envoys: attribute access
and indexing walk the tree (``model.transformer.h[0].mlp``), each Envoy has a
dotted path (``model.transformer.h.0.mlp``), and ``.output`` / ``.input`` /
``.inputs`` read (and assign) the live values inside a trace. Anything that is
not a child module is read from the module itself (``model.config``).
"""

from __future__ import annotations

import weakref
from typing import Any, Iterator

import torch

from . import _C
from .batching import Batcher, plan_batch
from .tracing import Tracer

__all__ = ["Envoy", "NNsight"]

_OUT, _INS, _IN = 0, 1, 2
_FRESH = 8  # ask for the next occurrence even while one is being served
_request = _C.request
_assign = _C.assign
_INVOKE_NAMES = [f"invoke {i}" for i in range(1024)]


def _invoke_name(i: int) -> str:
    return _INVOKE_NAMES[i] if i < len(_INVOKE_NAMES) else f"invoke {i}"


class Envoy:
    """Proxy for one module of a wrapped model."""

    def __init__(self, module: torch.nn.Module, path: str, tree, index: int, children: dict):
        d = self.__dict__
        d["_module"] = module
        d["_path"] = path
        d["_tree"] = tree
        d["_index"] = index
        d["_children"] = children

    # -- the live values (inside a trace) ------------------------------------

    @property
    def output(self) -> Any:
        """The module's output for this invoke (a view of the live batch)."""
        return _request(self._tree, self._index, _OUT)

    @output.setter
    def output(self, value: Any) -> None:
        _assign(self._tree, self._index, _OUT, value)

    @property
    def input(self) -> Any:
        """The module's first positional argument (else its first keyword argument)."""
        return _request(self._tree, self._index, _IN)

    @input.setter
    def input(self, value: Any) -> None:
        _assign(self._tree, self._index, _IN, value)

    @property
    def inputs(self) -> tuple:
        """``(args, kwargs)`` the module is called with."""
        return _request(self._tree, self._index, _INS)

    @inputs.setter
    def inputs(self, value: tuple) -> None:
        _assign(self._tree, self._index, _INS, value)

    def next(self) -> "_Next":
        """The module's next call: ``m.next().output`` skips past the occurrence
        being served (a module called several times in one forward)."""
        return _Next(self)

    def skip(self, value: Any) -> None:
        """Do not run this module in the forward; ``value`` is its output."""
        _C.skip(self._tree, self._index, value)

    # -- the tree ----------------------------------------------------------------

    @property
    def path(self) -> str:
        return self._path

    def __getattr__(self, name: str) -> Any:
        child = self.__dict__["_children"].get(name)
        if child is not None:
            self.__dict__[name] = child  # next lookup is a plain attribute hit
            return child
        return getattr(self.__dict__["_module"], name)

    def __setattr__(self, name: str, value: Any) -> None:
        prop = getattr(type(self), name, None)
        if isinstance(prop, property):
            prop.__set__(self, value)
        else:
            setattr(self._module, name, value)

    def __getitem__(self, key):
        children = self._children
        if isinstance(key, int):
            n = len(children)
            if key < 0:
                key += n
            child = children.get(str(key))
            if child is None:
                raise IndexError(f"{self._path} has no child {key}")
            return child
        if isinstance(key, str) and key in children:
            return children[key]
        return self._module[key]

    def __iter__(self) -> Iterator["Envoy"]:
        return iter(self._children.values())

    def __len__(self) -> int:
        return len(self._children)

    def __call__(self, *args, **kwargs):
        """Run the module directly (inside a trace: without interleaving)."""
        return self._module(*args, **kwargs)

    def modules(self) -> Iterator["Envoy"]:
        yield self
        for c in self._children.values():
            yield from c.modules()

    def __repr__(self) -> str:
        return repr(self._module)

    def __dir__(self):
        return sorted(set(super().__dir__()) | set(self._children) | set(dir(self._module)))


class _Next:
    """``envoy.next()``: reads and writes the next occurrence of the module."""

    __slots__ = ("_e",)

    def __init__(self, envoy: Envoy):
        self._e = envoy

    @property
    def output(self):
        return _request(self._e._tree, self._e._index, _OUT | _FRESH)

    @output.setter
    def output(self, value):
        _assign(self._e._tree, self._e._index, _OUT | _FRESH, value)

    @property
    def input(self):
        return _request(self._e._tree, self._e._index, _IN | _FRESH)

    @input.setter
    def input(self, value):
        _assign(self._e._tree, self._e._index, _IN | _FRESH, value)

    @property
    def inputs(self):
        return _request(self._e._tree, self._e._index, _INS | _FRESH)

    @inputs.setter
    def inputs(self, value):
        _assign(self._e._tree, self._e._index, _INS | _FRESH, value)


class NNsight(Envoy):
    """Wrap any ``torch.nn.Module`` for tracing.

    ``batcher`` tells how to combine several invokes' inputs into one batch
    (see :class:`nnloom.Batcher`); without one, a trace may have a single
    input invoke (plus empty invokes).
    """

    def __init__(self, module: torch.nn.Module, *, batcher: Batcher | None = None,
                 root: str = "model"):
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"NNsight wraps a torch.nn.Module, not {type(module).__name__}")
        named = list(module.named_modules())
        paths = [root if not n else f"{root}.{n}" for n, _ in named]
        mods = [m for _, m in named]
        tree = _C.Tree(mods, paths)
        envoys: dict = {}
        # children first: build bottom-up by path
        by_path = {}
        for i in range(len(mods) - 1, -1, -1):
            m, p = mods[i], paths[i]
            kids = {}
            for name, child in m.named_children():
                cp = f"{p}.{name}"
                if cp in by_path:
                    kids[name] = by_path[cp]
            if i == 0:
                break
            by_path[p] = Envoy(m, p, tree, i, kids)
        root_kids = {}
        for name, _ in module.named_children():
            cp = f"{root}.{name}"
            if cp in by_path:
                root_kids[name] = by_path[cp]
        super().__init__(module, root, tree, 0, root_kids)
        d = self.__dict__
        d["_batcher"] = batcher
        # one boundary past the modules: the traced call's result (tracer.result)
        d["_paths"] = paths + [f"{root}.result"]
        d["_result_index"] = len(paths)
        d["_finalizer"] = weakref.finalize(self, tree.uninstall)
        del envoys

    # -- tracing -----------------------------------------------------------------

    def trace(self, *args, trace: bool = True, backend=None, **kwargs):
        """``with model.trace(input) as tracer:`` - see :class:`nnloom.Tracer`.

        ``trace=False`` runs the model plainly and returns its output.
        ``backend="requests"`` (or ``nnloom.Requests(processes=N)``) runs each
        invoke as its own request and merges what they saved.
        """
        if not trace:
            return self._module(*args, **kwargs)
        if backend is not None and backend != "requests" and not hasattr(backend, "processes"):
            raise ValueError(f"unknown backend {backend!r}: use \"requests\" or "
                             "nnloom.Requests(processes=N)")
        return Tracer(self, args, kwargs, backend=backend)

    def _run_interleaved(self, bodies: list, method: str | None = None,
                         method_kwargs: dict | None = None):
        """Run the bodies [(code, ns, args, kwargs)] with one batched call of
        the module (or of its `method`, e.g. generate)."""
        tree = self._tree
        if len(bodies) == 1 and self._batcher is None:
            # one invoke on a plain module: it sees the whole batch, as given
            code, ns, args, kwargs = bodies[0]
            il = _C.Interleaver(tree, self._paths, 1)
            il.add(code, ns, -1, 0, _INVOKE_NAMES[0])
        else:
            plan = plan_batch(self._batcher, [(a, k) for _, _, a, k in bodies])
            il = _C.Interleaver(tree, self._paths, plan.batch_size)
            for i, (code, ns, _, _) in enumerate(bodies):
                start, size = plan.rows[i]
                il.add(code, ns, start, size, _invoke_name(i))
            args, kwargs = plan.args, plan.kwargs
        fn = self._module if method is None else getattr(self._module, method)
        if method_kwargs:
            kwargs = dict(kwargs)
            if method == "generate":
                kwargs.pop("position_ids", None)  # generate derives them from the mask
            kwargs.update(method_kwargs)
        return il.run(fn, args, kwargs, self._result_index)

    def unwrap(self) -> torch.nn.Module:
        """Remove nnloom from the module, leaving it exactly as it was."""
        self._finalizer()
        return self._module

    def __repr__(self) -> str:
        return repr(self._module)
