"""Request mode: each invoke of a trace runs as its own request.

Locally, the invokes of one trace share one forward and the names bound above
them are one object each. In request mode every invoke is a separate request
(its own forward, with only its own input) that gets its own COPY of the names
bound above the invokes, and sends back a payload with its saves (compacted
with ``collect.dumps_compact``). ``collect.merge_shared_saves`` then rebuilds
the shared values, so the caller sees exactly what the local run gives for
the supported patterns (slot writes into shared lists, key writes into shared
dicts, per-invoke saves).

``backend="requests"`` runs the requests one after another in this process;
``backend=nnloom.Requests(processes=N)`` runs them in N worker processes (see
``nnloom._workers``).
"""

from __future__ import annotations

import copy
import pickle
from typing import Any

from . import _C, collect

__all__ = ["Requests", "run_requests"]


class Requests:
    """Backend for ``model.trace(..., backend=Requests(processes=N))``.

    ``processes=0`` runs the requests in this process (the same as
    ``backend="requests"``); ``processes=N`` starts N worker processes (spawn)
    that each hold a copy of the model and send compact payloads back through
    a shared-memory arena.
    """

    def __init__(self, processes: int = 0, *, timeout: float = 300.0):
        if not isinstance(processes, int) or processes < 0:
            raise ValueError(f"processes must be a non-negative int, not {processes!r}")
        self.processes = processes
        self.timeout = timeout
        self._pool = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):  # pragma: no cover - best effort at interpreter exit
        try:
            self.close()
        except Exception:
            pass


class _Mediator:
    """What merge_shared_saves needs of one request."""

    __slots__ = ("presaved", "scope")

    def __init__(self, presaved, scope):
        self.presaved = presaved
        self.scope = scope


def _own_copy(value):
    """A request's own copy of a name bound above the invokes."""
    try:
        return copy.deepcopy(value)
    except Exception:  # not copyable (a tracer, a lock...): shared as it is
        return value


def _run_one(model, inv, outer_names, presaved) -> tuple:
    """Run invoke `inv` as a request in this process: (output, payload dict)."""
    ns = dict(inv.ns)
    req_saved: dict = {}
    for name in outer_names:
        if name in ns:
            ns[name] = c = _own_copy(ns[name])
            if name in presaved:
                req_saved[id(c)] = c
    _C.scope_enter(req_saved)
    try:
        out = model._run_interleaved([(inv.site.code, ns, inv.args, inv.kwargs)])
    finally:
        _C.scope_exit(req_saved)
    payload = {}
    for name in tuple(inv.site.stores) + tuple(presaved):
        if name in ns and req_saved.get(id(ns[name])) is ns[name]:
            payload[name] = ns[name]
    return out, payload


def run_requests(tracer, backend, outer_ns: dict, outer_saved: dict) -> tuple:
    """Run the collected invokes of `tracer` as requests.

    Returns (outputs per request, values to push by name)."""
    site = tracer._site
    invokes = tracer._invokes
    outer_names = [n for n in site.stores if n in outer_ns]
    presaved = {n for n in outer_names if outer_saved.get(id(outer_ns[n])) is outer_ns[n]}
    processes = backend.processes if isinstance(backend, Requests) else 0
    outputs, payloads = [], []
    if processes > 0:
        from . import _workers

        outputs, blobs = _workers.run(backend, tracer.model, invokes, outer_names, presaved)
        payloads = [collect.loads(b) for b in blobs]
    else:
        for inv in invokes:
            out, payload = _run_one(tracer.model, inv, outer_names, presaved)
            outputs.append(out)
            # the payload travels as it would between processes
            payloads.append(pickle.loads(collect.dumps_compact(payload)))
    meds = [_Mediator(presaved, p) for p in payloads]
    merged = collect.merge_shared_saves(meds, payloads)
    values: dict = {}
    for p in payloads:  # per-invoke names: the later request's binding wins
        for name, v in p.items():
            if name not in presaved:
                values[name] = v
    for name in presaved:
        if name in merged:
            values[name] = merged[name]
        else:
            returned = [p[name] for p in payloads if name in p]
            values[name] = returned[-1] if returned else outer_ns[name]
    tracer.requests = payloads
    return outputs, values
