"""Worker processes for ``nnloom.Requests(processes=N)``.

Each worker (a ``spawn``ed process) holds its own copy of the model, wrapped
once. A request travels to it as: the invoke body's code object (marshal),
the values of the names the body uses (pickled; the model wrapper, its
envoys, modules and the tracer travel as markers the worker resolves to its
own), the invoke's input and the names bound above the invokes. The worker
runs the request like the in-process backend, compacts its saves with
``collect.dumps_compact`` into its shared-memory arena, and sends back only
where the unit lies; the parent loads it with the restricted loader.

An error in a worker reaches the caller as the same exception type (when it
can be pickled) whose ``__cause__`` carries the worker's traceback text.
"""

from __future__ import annotations

import builtins
import marshal
import multiprocessing as mp
import pickle
import traceback
import types

from . import _C, collect

_SLOT = 64 << 20  # bytes of one arena segment: the largest payload


class WorkerError(RuntimeError):
    """The traceback of an exception raised in a worker process."""


class _Pool:
    def __init__(self, model, processes: int, timeout: float):
        ctx = mp.get_context("spawn")
        self.model = model  # the NNsight wrapper it serves
        self.timeout = timeout
        self.workers = []
        try:
            for _ in range(processes):
                reader = collect.ArenaReader(slots=2, slot_size=_SLOT)
                parent, child = ctx.Pipe()
                p = ctx.Process(target=_worker_main,
                                args=(child, _dump_model(model._module), model._batcher,
                                      reader.name),
                                daemon=True)
                p.start()
                child.close()
                self.workers.append((p, parent, reader))
        except BaseException:
            self.close()
            raise

    def close(self):
        for p, conn, reader in self.workers:
            try:
                conn.send(None)
            except Exception:
                pass
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
            conn.close()
            reader.close()
        self.workers = []


class _NoHook:
    """Stands for nnloom's forward wrapper in a pickled model; the worker
    deletes it (the module gets its class's forward back, then its own
    wrapper)."""

    def __reduce__(self):
        return (_NoHook, ())


def _dump_model(module) -> bytes:
    """The model pickled without nnloom's forward wrappers (tensors through
    shared memory, as multiprocessing sends them)."""
    import io
    from multiprocessing.reduction import ForkingPickler

    hook_type = _C.ForwardHook

    class P(ForkingPickler):
        def reducer_override(self, obj):
            if type(obj) is hook_type:
                wrapped = obj.__wrapped__
                owner = getattr(wrapped, "__self__", None)
                if isinstance(wrapped, types.MethodType) and \
                        wrapped.__func__ is getattr(type(owner), "forward", None):
                    return (_NoHook, ())
                return (_identity, (wrapped,))
            return NotImplemented

    buf = io.BytesIO()
    P(buf, pickle.HIGHEST_PROTOCOL).dump(module)
    return buf.getvalue()


def _identity(x):
    return x


def _load_model(blob):
    module = pickle.loads(blob)
    for m in module.modules():
        if isinstance(m.__dict__.get("forward"), _NoHook):
            del m.__dict__["forward"]
    return module


class _Marker:
    """A name the worker resolves to its own object."""

    __slots__ = ("kind", "arg")

    def __init__(self, kind, arg=None):
        self.kind = kind
        self.arg = arg

    def __reduce__(self):
        return (_Marker, (self.kind, self.arg))


def _names_used(code) -> set:
    out = set(code.co_names) | set(code.co_varnames) | set(code.co_freevars)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            out |= _names_used(c)
    return out


def _pack_names(model, tracer, inv) -> dict:
    from .envoy import Envoy

    names = {}
    for name in _names_used(inv.site.code):
        if name not in inv.ns or name == "__builtins__":
            continue
        v = inv.ns[name]
        if v is model:
            names[name] = _Marker("model")
        elif isinstance(v, Envoy) and v._tree is model._tree:
            names[name] = _Marker("envoy", v._path)
        elif v is tracer:
            names[name] = _Marker("tracer")
        elif isinstance(v, types.ModuleType):
            names[name] = _Marker("module", v.__name__)
        else:
            names[name] = v
    try:
        return pickle.dumps(names)
    except Exception as e:
        bad = []
        for n, v in names.items():
            try:
                pickle.dumps(v)
            except Exception:
                bad.append(n)
        raise TypeError(f"cannot send {', '.join(sorted(bad)) or 'the names'} to a worker "
                        f"process ({e}); use picklable values in request-mode invokes") from None


def run(backend, model, invokes, outer_names, presaved) -> tuple:
    """Run the invokes on the backend's workers: (outputs, payload bytes)."""
    pool = backend._pool
    if pool is None or pool.model is not model:
        backend.close()
        pool = backend._pool = _Pool(model, backend.processes, backend.timeout)
    tracer = invokes[0].tracer if invokes else None
    n = len(pool.workers)
    pending = []
    for i, inv in enumerate(invokes):  # round robin; each worker runs its requests in order
        msg = (i, marshal.dumps(inv.site.code), _pack_names(model, tracer, inv),
               inv.args, inv.kwargs, list(outer_names), sorted(presaved))
        pending.append(i % n)
        proc, conn, _ = pool.workers[i % n]
        try:
            conn.send(msg)
        except OSError:
            code = proc.exitcode
            backend.close()  # the next trace starts fresh workers
            raise RuntimeError(f"the worker for request {i} died (exit code {code}); "
                               "its requests were not run") from None
    blobs = [None] * len(invokes)
    first_error = None
    for i, w in enumerate(pending):
        p, conn, reader = pool.workers[w]
        if not conn.poll(backend.timeout):
            backend.close()
            raise TimeoutError(f"request {i} got no answer from its worker in {backend.timeout} s")
        try:
            kind, req, *rest = conn.recv()
        except EOFError:
            backend.close()
            raise RuntimeError(f"the worker running request {i} died (exit code "
                               f"{p.exitcode})") from None
        if kind == "ok":
            span, parts = rest
            got, _ = reader.next_unit(timeout=backend.timeout)
            try:
                if got != span:
                    raise RuntimeError(f"request {i}: arena unit {got} arrived, {span} expected")
                blobs[req] = b"".join(bytes(reader.read_binary(o, nb)) for o, nb in parts)
            finally:
                reader.end_unit(got)
        elif first_error is None:
            first_error = _rebuild_error(req, *rest)
    if first_error is not None:
        raise first_error
    return [None] * len(invokes), blobs


def _rebuild_error(req, type_name, text, tb, blob):
    exc = None
    if blob is not None:
        try:
            exc = pickle.loads(blob)
        except Exception:
            exc = None
    if not isinstance(exc, BaseException):
        exc = WorkerError(f"request {req} raised {type_name}: {text}")
    exc.__cause__ = WorkerError(f"in the worker running request {req}:\n{tb}")
    return exc


# ---- the worker process -----------------------------------------------------


class _WorkerTracer:
    """What a request's body may use of its tracer in a worker."""

    def stop(self):
        _C.stop()


def _resolve(names: dict, wrapper):
    import importlib

    out = {}
    for k, v in names.items():
        if isinstance(v, _Marker):
            if v.kind == "model":
                v = wrapper
            elif v.kind == "envoy":
                env = wrapper
                for part in v.arg.split(".")[1:]:
                    env = env._children[part]
                v = env
            elif v.kind == "tracer":
                v = _WorkerTracer()
            elif v.kind == "module":
                v = importlib.import_module(v.arg)
        out[k] = v
    return out


def _worker_main(conn, model_blob, batcher, arena_name):  # pragma: no cover - in a child
    from . import NNsight
    from ._capture import Site
    from .requests import _run_one

    wrapper = NNsight(_load_model(model_blob), batcher=batcher)
    writer = collect.ArenaWriter(arena_name)
    while True:
        msg = conn.recv()
        if msg is None:
            return
        req, code_bytes, names_blob, args, kwargs, outer_names, presaved = msg
        try:
            code = marshal.loads(code_bytes)
            ns = {"__builtins__": builtins, "__name__": "__nnloom_request__"}
            ns.update(_resolve(pickle.loads(names_blob), wrapper))
            inv = types.SimpleNamespace(
                ns=ns, args=args, kwargs=kwargs,
                site=Site(code, 0, tuple(_names_used(code) & set(ns) | set(code.co_names)),
                          False, False, code.co_filename, 0))
            _, payload = _run_one(wrapper, inv, outer_names, set(presaved))
            data = collect.dumps_compact(payload)
            off = writer.write_binary(data)
            span = writer.commit_unit()
            conn.send(("ok", req, span, [(off, len(data))]))
        except BaseException as e:  # noqa: BLE001 - everything goes back to the caller
            try:
                blob = pickle.dumps(e)
            except Exception:
                blob = None
            conn.send(("error", req, type(e).__name__, str(e), traceback.format_exc(), blob))
