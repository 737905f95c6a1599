"""Tracer and Invoker: the ``with`` blocks of nnloom.

``with model.trace(x) as tracer:`` captures its body (see ``_capture``), keeps
it from running inline (a one-shot trace function raises at the body's first
line, and ``__exit__`` swallows that), then runs it through the C scheduler
interleaved with one forward pass, and finally writes the saved values back
into the caller's frame.

The Python here runs once per trace, never per module call: everything per
module call or per tensor is in ``nnloom._C``.
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any

from . import _C
from ._capture import INVOKE_HOOK, SourceError, capture

__all__ = ["Tracer", "Invoker", "Barrier", "SourceError"]

_PKG_DIR = os.path.dirname(os.path.abspath(__file__))
_DEBUG = os.environ.get("NNLOOM_DEBUG", "") not in ("", "0")
_CO_OPTIMIZED = 0x0001
_OLD_LOCALS = sys.version_info < (3, 13)


_MISSING = object()


class _Skip(Exception):
    """Raised by the trace function at a body's first line; never escapes."""


def _noop_trace(frame, event, arg):
    return None


# ---------------------------------------------------------------------------
# Skipping a body
# ---------------------------------------------------------------------------


class _TraceSkipper:
    """Arms a per-frame trace function that stops the body before its first
    line runs, and restores whatever tracing (debugger, coverage) was there.
    (CPython 3.10-3.11; on 3.12+ ``sys.settrace`` re-instruments every code
    object, so ``_MonitorSkipper`` is used there.)"""

    __slots__ = ("frame", "prev_global", "prev_local", "first_line", "armed")

    def __init__(self, frame, first_line):
        self.frame = frame
        self.first_line = first_line
        self.armed = False
        self.prev_global = None
        self.prev_local = None

    def __call__(self, frame, event, arg):
        if event == "line" and frame.f_lineno >= self.first_line:
            raise _Skip
        return self

    def arm(self):
        self.prev_global = sys.gettrace()
        self.prev_local = self.frame.f_trace
        sys.settrace(_noop_trace if self.prev_global is None else self.prev_global)
        self.frame.f_trace = self
        self.armed = True

    def disarm(self):
        if not self.armed:
            return
        self.armed = False
        self.frame.f_trace = self.prev_local
        sys.settrace(self.prev_global)
        self.prev_global = self.prev_local = None


class _MonitorSkipper:
    """The same with ``sys.monitoring`` (3.12+): LINE events are enabled on
    the one code object that holds the ``with``, counted per code object so
    concurrent traces of the same call site do not disarm each other, and the
    callback raises only in the frame that armed it."""

    __slots__ = ("frame", "first_line", "armed")

    _armed: dict = {}  # code -> {frame: first line of the body}

    def __init__(self, frame, first_line):
        self.frame = frame
        self.first_line = first_line
        self.armed = False

    @staticmethod
    def _on_line(code, line):
        frames = _MonitorSkipper._armed.get(code)
        if frames:
            f = sys._getframe(1)
            first = frames.get(f)
            if first is not None and line >= first:
                del frames[f]
                raise _Skip
        return None

    def arm(self):
        code = self.frame.f_code
        frames = self._armed.get(code)
        if frames is None:
            frames = self._armed[code] = {}
        frames[self.frame] = self.first_line
        if len(frames) == 1:
            _MON.set_local_events(_TOOL, code, _MON.events.LINE)
        self.armed = True

    def disarm(self):
        if not self.armed:
            return
        self.armed = False
        code = self.frame.f_code
        frames = self._armed.get(code)
        if frames is None:
            return
        frames.pop(self.frame, None)
        if not frames:
            del self._armed[code]
            _MON.set_local_events(_TOOL, code, 0)


_MON = getattr(sys, "monitoring", None)
_TOOL = None
if _MON is not None and os.environ.get("NNLOOM_SETTRACE", "") in ("", "0"):
    for _tid in (4, 3):  # 0-2 and 5 are the debugger, coverage, profiler, optimizer ids
        try:
            _MON.use_tool_id(_tid, "nnloom")
        except ValueError:
            continue
        _TOOL = _tid
        _MON.register_callback(_TOOL, _MON.events.LINE, _MonitorSkipper._on_line)
        break
_Skipper = _MonitorSkipper if _TOOL is not None else _TraceSkipper


def _snapshot(frame) -> dict:
    """The names visible in `frame`: its globals overlaid with its locals."""
    loc = frame.f_locals
    if frame.f_globals is loc:
        return dict(loc)
    ns = dict(frame.f_globals)
    ns.update(loc)
    if _OLD_LOCALS and frame.f_code.co_flags & _CO_OPTIMIZED:
        # before PEP 667 f_locals is a snapshot cached on the frame: drop it so
        # it does not keep the caller's locals alive after they are deleted
        loc.clear()
    return ns


def _push(frame, values: dict) -> None:
    """Bind `values` in `frame` (a function, module, class or body frame)."""
    if not values:
        return
    if frame.f_code.co_flags & _CO_OPTIMIZED:
        _C.frame_set(frame, values)
    else:
        frame.f_locals.update(values)


def _is_internal(code) -> bool:
    return code.co_filename.startswith(_PKG_DIR)


def _rebuild_tb(entries):
    tb = None
    for t in reversed(entries):
        tb = types.TracebackType(tb, t.tb_frame, t.tb_lasti, t.tb_lineno)
    return tb


# ---------------------------------------------------------------------------
# Generation steps
# ---------------------------------------------------------------------------


class _Steps:
    __slots__ = ("_tracer",)

    def __init__(self, tracer):
        self._tracer = tracer

    def __getitem__(self, key) -> "_StepIter":
        n = self._tracer._steps
        if isinstance(key, int):
            return _StepIter(range(key, key + 1))
        if isinstance(key, slice):
            start = 0 if key.start is None else key.start
            stop = n if key.stop is None else key.stop
            if start < 0 or stop < 0:
                raise ValueError("tracer.iter takes non-negative steps")
            return _StepIter(range(start, stop, key.step or 1))
        raise TypeError("tracer.iter[...] takes a step or a slice of steps")


class _StepIter:
    """Sets the running invoke's iteration before each step of the loop."""

    __slots__ = ("_steps",)

    def __init__(self, steps: range):
        self._steps = steps

    def __iter__(self):
        for step in self._steps:
            _C.set_iteration(step)
            yield step


# ---------------------------------------------------------------------------
# Barrier
# ---------------------------------------------------------------------------


class Barrier:
    """``barrier = tracer.barrier(n)``; inside invokes: ``barrier()``."""

    __slots__ = ("n", "_waiting", "_tracer")

    def __init__(self, tracer: "Tracer", n: int):
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"a barrier needs a positive number of invokes, not {n!r}")
        self.n = n
        self._waiting: list = []
        self._tracer = tracer

    def __call__(self) -> None:
        me = _C.current_invoke()
        if me < 0:
            raise ValueError("a barrier can only be waited on inside an invoke's body")
        if me in self._waiting:
            raise ValueError(f"invoke {me} reached the same barrier twice")
        self._waiting.append(me)
        if len(self._waiting) < self.n:
            _C.block()
            return
        waiting, self._waiting = self._waiting, []
        self._tracer._exchange(waiting)
        for i in waiting[:-1]:
            _C.release(i)


# ---------------------------------------------------------------------------
# Invoker
# ---------------------------------------------------------------------------


def _bind_invoke(inv: "Invoker", k: int) -> "Invoker":
    """What a lifted ``with tracer.invoke(...):`` statement calls (see
    _capture._InvokeLifter): register invoke block k of the running trace body
    with the names visible at this point."""
    tr = inv.tracer
    if tr._state != "collecting":
        inv._check_state()
    inv.site = tr._site.invokes[k]
    inv._record(sys._getframe(1))
    return inv


class Invoker(_C.ExitBase):
    """``with tracer.invoke(input):`` - one prompt group, one mediator."""

    def __init__(self, tracer: "Tracer", args: tuple, kwargs: dict):
        self.tracer = tracer
        self.args = args
        self.kwargs = kwargs
        self.site = None
        self.ns = None
        self._skipper = None

    def _check_state(self):
        tr = self.tracer
        if tr._state != "collecting":
            if tr._state == "running":
                raise ValueError("cannot invoke while the model runs: tracer.invoke(...) blocks "
                                 "belong at the top level of the trace body")
            raise ValueError("tracer.invoke(...) is only valid inside its trace's body")

    def _record(self, frame):
        # the invoke sees the names bound so far: objects shared, bindings its own
        self.ns = ns = _snapshot(frame)
        self.initial = {n: ns.get(n, _MISSING) for n in self.site.stores}
        self.tracer._invokes.append(self)

    def __enter__(self):
        self._check_state()
        frame = sys._getframe(1)
        self.site = capture(frame, "invoke")
        self._frame = frame
        self._skipper = None
        if not self.site.trivial:
            self._skipper = _Skipper(frame, self.site.first_line)
            self._skipper.arm()
        return self

    def _exit(self, et, ev, tb):
        if self._skipper is not None:
            self._skipper.disarm()
            self._skipper = None
        frame, self._frame = self._frame, None
        if et is not None and not issubclass(et, _Skip):
            return False
        self._record(frame)
        return True

    def _user_traceback(self, exc):
        return None


# ---------------------------------------------------------------------------
# Tracer
# ---------------------------------------------------------------------------


class Tracer(_C.ExitBase):
    """``with model.trace(*inputs, **kwargs) as tracer:``

    The body runs interleaved with one forward pass of the wrapped model. Give
    the input here (one implicit invoke) or in ``tracer.invoke(...)`` blocks.
    """

    def __init__(self, model, args: tuple, kwargs: dict, method: str | None = None,
                 method_kwargs: dict | None = None, steps: int = 1, backend: Any = None):
        self.model = model
        self._backend = backend  # None: local; "requests" / nnloom.Requests: request mode
        self.requests = None  # request mode: each request's payload (name -> value)
        self._args = args
        self._kwargs = kwargs
        self._method = method  # e.g. "generate": what runs instead of forward
        self._method_kwargs = method_kwargs or {}
        self._steps = steps  # forward passes the method makes (generation steps)
        self._invokes: list = []
        self._state = "new"
        self._frame = None
        self._site = None
        self._skipper = None
        self._codes: tuple = ()
        self.output = None  # the forward's return value, after the trace

    # -- the with protocol ---------------------------------------------------

    def __enter__(self):
        if self._state != "new":
            raise RuntimeError("a Tracer can be entered only once; call model.trace(...) again")
        frame = sys._getframe(1)
        site = capture(frame, "trace")
        if not self._args and not self._kwargs and not site.has_invokes:
            raise ValueError(
                "trace() needs an input, or at least one `with tracer.invoke(...)` block"
            )
        self._frame = frame
        self._site = site
        self._state = "entered"
        if not site.trivial:
            self._skipper = _Skipper(frame, site.first_line)
            self._skipper.arm()
        return self

    def _exit(self, et, ev, tb):
        if self._skipper is not None:
            self._skipper.disarm()
            self._skipper = None
        if et is not None and not issubclass(et, _Skip):
            self._reset()
            return False
        try:
            self._execute()
        finally:
            self._reset()
        return True

    def _reset(self):
        self._frame = None
        self._invokes = []
        self._state = "done"

    # -- running ---------------------------------------------------------------

    def _execute(self):
        site, frame = self._site, self._frame
        nested = _C.scope_depth() > 0
        ns = _snapshot(frame)
        saved: dict = {}
        codes = [site.code]
        _C.scope_enter(saved)
        try:
            if site.has_invokes:
                self._state = "collecting"
                ns[INVOKE_HOOK] = _bind_invoke
                exec(site.code, ns)
                invokes = self._invokes
                if self._args or self._kwargs:
                    raise ValueError("give the input either to trace(...) or to "
                                     "tracer.invoke(...) blocks, not both")
                if not invokes:
                    raise ValueError(
                        "trace() needs an input, or at least one `with tracer.invoke(...)` block"
                    )
                bodies = [(inv.site.code, inv.ns, inv.args, inv.kwargs) for inv in invokes]
                codes += [inv.site.code for inv in invokes]
            else:
                bodies = [(site.code, ns, self._args, self._kwargs)]
            self._codes = tuple(codes)
            self._state = "running"
            if self._backend is not None:
                if not site.has_invokes:
                    raise ValueError("request mode runs each `tracer.invoke(...)` block as a "
                                     "request: put the input in invoke blocks")
                from .requests import run_requests

                self.output, pushed = run_requests(self, self._backend, ns, saved)
                for v in pushed.values():
                    saved[id(v)] = v
                # the merged values replace what the requests' copies came from
                for inv in self._invokes:
                    inv.ns = pushed
                ns.update({k: v for k, v in pushed.items() if k in ns})
            else:
                self.output = self.model._run_interleaved(bodies, self._method,
                                                          self._method_kwargs)
        except _C.StopTrace:
            pass  # stop() before any invoke: nothing ran
        finally:
            _C.scope_exit(saved)
            self._state = "done"

        # write back: saved names only (all names when nested in another trace)
        out: dict = {}
        scopes = [(ns, site.stores)]
        if site.has_invokes:
            scopes += [(inv.ns, inv.site.stores) for inv in self._invokes]
        for scope_ns, stores in scopes:
            for name in stores:
                if name in scope_ns:
                    v = scope_ns[name]
                    if nested or saved.get(id(v)) is v:
                        out[name] = v
        if nested:
            for v in saved.values():
                _C.save(v)
        _push(frame, out)
        for inv in self._invokes:
            inv.ns = inv.initial = None

    # -- user API --------------------------------------------------------------

    def invoke(self, *args, **kwargs) -> Invoker:
        """One prompt group: its input joins the batch, its body sees its rows."""
        return Invoker(self, args, kwargs)

    def stop(self):
        """End the forward here; everything saved so far is returned."""
        _C.stop()

    @property
    def result(self) -> Any:
        """What the traced call returned (generated ids for ``generate``).

        Inside an invoke's body this waits for the call to finish and gives
        the invoke's rows of its result; after the trace it is the result."""
        if _C.current_invoke() >= 0:
            m = self.model
            _C.set_iteration(0)  # the call ends once, whatever step the body is at
            return _C.request(m._tree, m._result_index, 0)
        return self.output

    @property
    def iter(self) -> "_Steps":
        """``for step in tracer.iter[0:3]:`` runs the loop body once per
        generation step, with module requests pinned to that step."""
        return _Steps(self)

    def all(self) -> "_StepIter":
        """Every generation step: ``for step in tracer.all():``."""
        return _Steps(self)[:]

    def barrier(self, n: int) -> "Barrier":
        """A barrier for ``n`` invokes: each waits at ``barrier()`` until all n
        have reached it, so one can use a value another produced in the same
        forward."""
        return Barrier(self, n)

    def _exchange(self, members: list) -> None:
        """At a completed barrier, the names each member bound so far become
        visible to the others (unless they bound that name themselves)."""
        invs = [self._invokes[i] for i in members]
        for src in invs:
            for name in src.site.stores:
                if name not in src.ns or src.ns[name] is src.initial.get(name, _MISSING):
                    continue
                value = src.ns[name]
                for dst in invs:
                    if dst is src:
                        continue
                    cur = dst.ns.get(name, _MISSING)
                    if cur is _MISSING or cur is dst.initial.get(name, _MISSING):
                        dst.ns[name] = value

    # -- tracebacks --------------------------------------------------------------

    def _user_traceback(self, exc):
        """The traceback of `exc` from the user's body on, without nnloom's frames."""
        if _DEBUG:
            return None
        entries = []
        t = exc.__traceback__
        codes = self._codes or ((self._site.code,) if self._site else ())
        started = False
        while t is not None:
            co = t.tb_frame.f_code
            if co in codes:
                started = True
            if started and (co in codes or not _is_internal(co)):
                entries.append(t)
            t = t.tb_next
        if not started:
            entries = []
            t = exc.__traceback__
            while t is not None:
                if not _is_internal(t.tb_frame.f_code):
                    entries.append(t)
                t = t.tb_next
        return _rebuild_tb(entries)
