"""nnloom.collect: what leaves a trace.

- :func:`dumps_compact` pickles a value so that every tensor carries only its
  own elements (a row of a batch writes that row, not the batch); the bytes
  load with plain :func:`pickle.loads`.
- :func:`loads` is the restricted loader for payloads from another process:
  tensors, numbers, strings, bytes, None, containers and allow-listed classes;
  anything else raises :class:`nnloom.UnsafePayloadError` before it runs.
- :func:`merge_shared_saves` rebuilds, from one payload per request, the
  values that a local run shares between invokes.
- :class:`ArenaWriter` / :class:`ArenaReader` move payload bytes between a
  worker and its parent through shared memory.
"""

import collections
import io
import pickle

import torch

from . import _C

UnsafePayloadError = _C.UnsafePayloadError
PayloadError = _C.PayloadError
CompactPickler = _C.CompactPickler


class ArenaReader(_C.ArenaReader):
    """The parent's end of a shared-memory arena (it creates and unlinks it).

    ``ArenaReader(slots=4, slot_size=64 MiB, zero_copy=True, name=None)``:
    ``slots`` segments of ``slot_size`` bytes; one committed unit fills one
    segment. A worker attaches with ``ArenaWriter(reader.name)``.

    - ``next_unit(timeout=10.0) -> (span, nbytes)``: wait for the next
      committed unit; ``TimeoutError`` after ``timeout``, ``RuntimeError`` at
      once if the writer process is gone.
    - ``read_binary(offset, nbytes) -> memoryview`` of exactly ``nbytes``.
      With ``zero_copy=True`` (segment pool) it aliases shared memory, and
      the segment is not reused while anything still holds an export of it:
      slices and casts of the view, numpy arrays on it, ``torch.frombuffer``
      storages. With ``zero_copy=False`` (ring) the bytes are copied out.
    - ``end_unit(span, anchors=None)``: the unit is done: read, failed to
      load, or skipped; call it exactly once per unit. Logical only: live
      views stay valid, the segment returns to the writer with the last one.
    - ``reset()``: start a new iteration: ends units taken and not ended.
    - ``close()``: unlink the region (the mapping lives on under live views).
    """


class ArenaWriter(_C.ArenaWriter):
    """A worker's end of a shared-memory arena.

    ``ArenaWriter(name, timeout=10.0)``:

    - ``write_binary(data) -> offset``: copy a bytes-like object into the
      open unit. When every segment is held by the reader it waits, up to
      ``timeout`` seconds (then ``TimeoutError``); it never overwrites, and it
      fails at once with ``RuntimeError`` if the reader process is gone. A
      unit larger than a segment raises ``nnloom.PoolExhaustedError``.
    - ``commit_unit() -> span``: publish the open unit; send ``span`` and the
      offsets to the reader through your own channel.
    """


def dumps_compact(value, *, pool=None) -> bytes:
    """Pickle ``value``, writing each tensor as a copy of only its own elements.

    A tensor that views a larger storage (a row narrowed out of a batch, a
    column slice, a strided view) is written as its elements alone; a plain
    pickle would write the whole storage. Tensors are found wherever they sit
    (containers, dataclasses, namedtuples, ``ModelOutput``, instance state),
    because the hook is the pickler's ``reducer_override``, and an object
    reachable under two names loads as one object (pickle's memo).

    Dtype, shape, ``requires_grad`` and, for dense layouts (contiguous,
    transposed, channels-last), strides survive; other views load
    row-major contiguous. Device tensors load as CPU tensors. Plain
    ``torch.Tensor`` and ``nn.Parameter`` (which loads as a tensor) take this
    path; sparse, quantized and tensor subclasses keep torch's own pickling,
    which :func:`loads` refuses.

    The bytes load with plain :func:`pickle.loads` wherever torch is importable.

    CUDA tensors are staged in one call through a pinned host pool
    (``nnloom._C.PinnedPool``): compacted on a copy stream, one event for the
    whole payload, the host waiting once. ``pool=`` stages every tensor
    (device or not) through the given pool.
    """
    if pool is None and not _cuda_ready():
        return _C.dumps_compact(value)
    tensors = _find_tensors(value, every=pool is not None)
    if not tensors:
        return _C.dumps_compact(value)
    if pool is None:
        pool = _device_pool()
    # one staging call, one event for the whole payload; the host waits here
    host = pool.stage(tensors).tensors()
    return _C.dumps_compact(value, {id(t): h for t, h in zip(tensors, host)})


_POOL = []


def _cuda_ready() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _device_pool():
    """The process's pinned pool for payload staging (created on first use)."""
    if not _POOL:
        _POOL.append(_C.PinnedPool())
    return _POOL[0]


class _Finder(pickle.Pickler):
    """A pickling pass that only lists the payload's tensors (the pickler's own
    traversal: wherever they sit, each once)."""

    def __init__(self, every: bool):
        super().__init__(io.BytesIO(), protocol=5)
        self.every = every
        self.found: list = []

    def reducer_override(self, obj):
        if type(obj) in (torch.Tensor, torch.nn.Parameter):
            if obj.layout == torch.strided and (self.every or obj.device.type == "cuda"):
                self.found.append(obj)
            return (tuple, ())
        return NotImplemented

    def persistent_id(self, obj):
        return None


def _find_tensors(value, every: bool) -> list:
    f = _Finder(every)
    f.dump(value)
    return f.found


# ---------------------------------------------------------------------------
# Restricted loading
# ---------------------------------------------------------------------------
#
# The C unpickler does all the parsing; the only way a payload reaches a
# Python object it did not build itself (a class, a function) is through
# find_class, for GLOBAL / STACK_GLOBAL / INST / OBJ / EXT* opcodes, and it has
# no other way to run code: REDUCE, NEWOBJ and BUILD act on objects that came
# out of find_class or out of the payload's own data. So find_class is the
# whole gate. It never imports a module: it answers from a table built here
# (plus the classes the caller allows, keyed by their module and qualified
# name), and every callable it hands out either is harmless for any arguments
# or is a wrapper here that checks them. PERSID is refused by the base class
# (no persistent_load).


class _Owner:
    """Stand-in for a class whose attributes the payload may name through
    getattr: not callable, immutable (a BUILD cannot rewrite it), only
    meaningful to _safe_getattr."""

    __slots__ = ("qualname", "attrs")

    def __init__(self, qualname, attrs):
        object.__setattr__(self, "qualname", qualname)
        object.__setattr__(self, "attrs", dict(attrs))

    def __setattr__(self, name, value):
        raise _unsafe(f"setting {self.qualname}.{name}")

    def __repr__(self):
        return f"<{self.qualname}>"


_STORAGE = _Owner("torch.UntypedStorage", {"from_buffer": torch.UntypedStorage.from_buffer})
_TENSOR = _Owner(
    "torch.Tensor",
    {
        "view": torch.Tensor.view,
        "as_strided": torch.Tensor.as_strided,
        "requires_grad_": torch.Tensor.requires_grad_,
    },
)


def _unsafe(what):
    return UnsafePayloadError(f"payload refers to a forbidden object: {what}")


def _safe_getattr(owner, name, *default):
    if default or not isinstance(owner, _Owner) or type(name) is not str:
        raise _unsafe(f"builtins.getattr({owner!r}, {name!r})")
    fn = owner.attrs.get(name)
    if fn is None:
        raise _unsafe(f"{owner.qualname}.{name}")
    return fn


def _byte_tensor(storage):
    if type(storage) is not torch.UntypedStorage:
        raise _unsafe(f"torch.ByteTensor({type(storage).__name__})")
    return torch.ByteTensor(storage)


def _bytearray(data=b""):
    # bytearray(n) would allocate n zero bytes on the payload's say-so
    if not isinstance(data, (bytes, bytearray)):
        raise _unsafe(f"builtins.bytearray({type(data).__name__})")
    return bytearray(data)


def _typed(fn, qualname, *arg_types, items=None):
    """fn restricted to positional arguments of the exact types given (each
    entry a tuple of types, one per position, trailing ones optional), and,
    when `items` is given, to collections whose elements have those types.
    Keeps allowed constructors from being fed, e.g., a huge tensor view to
    iterate over."""

    def call(*args):
        ok = len(args) <= len(arg_types) and all(
            type(a) in t for a, t in zip(args, arg_types)
        )
        if ok and items is not None:
            ok = all(type(x) in items for a in args for x in a)
        if not ok:
            kinds = ", ".join(type(a).__name__ for a in args)
            raise _unsafe(f"{qualname}({kinds})")
        return fn(*args)

    call.__qualname__ = call.__name__ = qualname
    return call


_COLLECTIONS = (list, tuple, set, frozenset)


def _base_table():
    table = {
        ("builtins", "getattr"): _safe_getattr,
        ("torch._C", "StorageBase"): _STORAGE,
        ("torch", "UntypedStorage"): _STORAGE,
        ("torch.storage", "UntypedStorage"): _STORAGE,
        ("torch._C", "TensorBase"): _TENSOR,
        ("torch", "Tensor"): _TENSOR,
        ("torch._tensor", "Tensor"): _TENSOR,
        ("torch", "ByteTensor"): _byte_tensor,
        ("torch", "Size"): _typed(torch.Size, "torch.Size", (list, tuple), items=(int,)),
        ("torch", "device"): _typed(torch.device, "torch.device", (str,), (int,)),
        ("builtins", "bytearray"): _bytearray,
        ("collections", "OrderedDict"): _typed(
            collections.OrderedDict, "collections.OrderedDict", (list, tuple, dict)
        ),
        ("builtins", "complex"): _typed(complex, "builtins.complex", (int, float), (int, float)),
    }
    scalars = (type(None), bool, int, float, complex, str, bytes, tuple)
    for kind in (set, frozenset):
        table[("builtins", kind.__name__)] = _typed(
            kind, f"builtins.{kind.__name__}", _COLLECTIONS, items=scalars
        )
    # protocol 0-2 pickles name builtins by their Python 2 module
    for key in [k for k in table if k[0] == "builtins" and k[1] != "getattr"]:
        table[("__builtin__", key[1])] = table[key]
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype):
            table[("torch", name)] = value
    return table


_BASE = _base_table()


class RestrictedUnpickler(pickle.Unpickler):
    """pickle.Unpickler that resolves globals only from an allow-list.

    ``allow`` is an iterable of classes (dataclasses, namedtuples, ModelOutput
    subclasses, ...) that results may contain; each is matched by its
    ``__module__`` and ``__qualname__``, never imported."""

    def __init__(self, file, *, allow=()):
        super().__init__(file)
        table = dict(_BASE)
        for cls in allow:
            if not isinstance(cls, type):
                raise TypeError(f"allow takes classes, got {cls!r}")
            table[(cls.__module__, cls.__qualname__)] = cls
        self._table = table

    def find_class(self, module, name):
        value = self._table.get((module, name))
        if value is None:
            raise _unsafe(f"{module}.{name}")
        return value


# A payload may also try to change a global it named instead of building
# from it: BUILD (None, {"attr": x}) on an allowed class sets a class
# attribute, APPEND/SETITEM on one calls its methods. Before loading, a scan
# of the opcode stream follows which stack slots hold a global (directly or
# through the memo) and refuses those opcodes on them. The scan skips byte
# payloads by seeking, so it costs little even for large tensors.

_MUTATORS = {"BUILD", "SETITEM", "SETITEMS", "APPEND", "APPENDS", "ADDITEMS"}
_GLOBALS = {"GLOBAL", "STACK_GLOBAL", "EXT1", "EXT2", "EXT4"}
_COUNTED = {  # opcode name -> (length bytes, byte order) for payloads we skip
    "BINBYTES8": 8, "BYTEARRAY8": 8, "BINUNICODE8": 8, "BINBYTES": 4,
    "BINUNICODE": 4, "BINSTRING": 4, "LONG4": 4,
}
_MARK = object()


def _scan(data):
    import pickletools

    f = io.BytesIO(data)
    stack, memo = [], {}
    while True:
        code = f.read(1)
        if not code:
            raise pickle.UnpicklingError("pickle data was truncated")
        op = pickletools.code2op.get(code.decode("latin-1"))
        if op is None:
            raise pickle.UnpicklingError(f"invalid load key, {code!r}")
        width = _COUNTED.get(op.name)
        if width is not None:
            raw = f.read(width)
            if len(raw) != width:
                raise pickle.UnpicklingError("pickle data was truncated")
            n = int.from_bytes(raw, "little", signed=op.name in ("BINSTRING", "LONG4"))
            if n < 0 or f.seek(n, 1) > len(data):
                raise pickle.UnpicklingError("pickle data was truncated")
            arg = None
        else:
            arg = op.arg.reader(f) if op.arg is not None else None
        name = op.name
        if name == "STOP":
            return
        before = op.stack_before
        has_mark = pickletools.markobject in before
        if name in _MUTATORS:
            if has_mark:
                if _MARK not in stack:
                    raise pickle.UnpicklingError("could not find MARK")
                at = len(stack) - 1 - stack[::-1].index(_MARK) - 1
            else:
                at = len(stack) - len(before)
            if at >= 0 and stack[at] == "G":
                raise _unsafe(f"{name} on a global")
        if name in ("PUT", "BINPUT", "LONG_BINPUT", "MEMOIZE"):
            if not stack:
                raise pickle.UnpicklingError("memo store on an empty stack")
            key = len(memo) if name == "MEMOIZE" else arg
            # the C unpickler sizes its memo array by the largest index: a
            # forged index would make it allocate gigabytes
            if key > len(data):
                raise pickle.UnpicklingError(f"memo index {key} out of range")
            memo[key] = stack[-1]
            continue
        if name in ("GET", "BINGET", "LONG_BINGET"):
            stack.append(memo.get(arg, "O"))
            continue
        if name == "DUP":
            stack.append(stack[-1] if stack else "O")
            continue
        if has_mark:
            below = before.index(pickletools.markobject)
            if _MARK not in stack:
                raise pickle.UnpicklingError("could not find MARK")
            del stack[len(stack) - 1 - stack[::-1].index(_MARK):]
            if below:
                del stack[max(0, len(stack) - below):]
        else:
            del stack[max(0, len(stack) - len(before)):]
        for item in op.stack_after:
            if item is pickletools.markobject:
                stack.append(_MARK)
            else:
                stack.append("G" if name in _GLOBALS else "O")


def loads(data, *, allow=()):
    """Load a payload from another process, refusing anything that could run code.

    Accepts what results are made of: tensors (as :func:`dumps_compact` writes
    them), numbers, strings, bytes, None, lists, tuples, dicts, sets,
    ``OrderedDict``, ``torch.Size`` / ``torch.device`` / dtypes, and instances
    of the classes in ``allow`` (dataclasses, namedtuples, ``ModelOutput``
    subclasses). A reference to any other global (``os.system``,
    ``builtins.eval``, a class's ``__reduce__`` target) raises
    :class:`UnsafePayloadError` naming it, before anything is called. Any
    other defect (truncated or corrupted bytes, bad arguments to an allowed
    call) raises :class:`PayloadError` chained to the underlying error.

    Classes in ``allow`` are trusted: their ``__new__``, ``__init__`` (when a
    payload calls them) and ``__setstate__`` run with payload data.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"loads() takes bytes-like data, got {type(data).__name__}")
    unpickler = RestrictedUnpickler(io.BytesIO(data), allow=allow)
    try:
        _scan(data)
        return unpickler.load()
    except UnsafePayloadError:
        raise
    except Exception as exc:
        raise PayloadError(f"payload is malformed: {type(exc).__name__}: {exc}") from exc


# ---------------------------------------------------------------------------
# Merging per-request saves
# ---------------------------------------------------------------------------

def merge_shared_saves(mediators, per_request_saves):
    """Merge same-name saves across the requests of one multi-invoke trace.

    Locally, a name bound and saved above the invokes (``rows = [None] * n;
    rows.save()``) is ONE object every invoke writes into. In request mode
    each request carries its own copy back; this rebuilds the one object.

    Mediator protocol: each object in ``mediators`` has

    - ``presaved``: a set of the names bound and saved above the invokes;
    - ``scope``: a dict name -> value, into which the merged value of every
      merged name is written (so results read the same whichever mediator
      they are pushed from).

    ``per_request_saves`` is a list, one dict name -> value per request, in
    request order.

    Only presaved names that more than one request returned are merged:
    lists and tuples of the same length slot by slot, ``None`` meaning "not
    written"; dicts by key union; nested containers recursively; anything
    else, and any slot several requests wrote, keeps the later request's copy.
    Names an invoke saved for itself are not merged (they are separate values,
    one per invoke): the caller returns those per invoke.

    Returns the merged values by name. They are new containers: the caller
    marks them saved again.
    """
    presaved = set()
    for med in mediators:
        presaved.update(med.presaved)
    merged = {}
    names = [n for saves in per_request_saves for n in saves if n in presaved]
    for name in dict.fromkeys(names):  # first-seen order
        copies = [saves[name] for saves in per_request_saves if name in saves]
        if len(copies) < 2:
            continue
        merged[name] = _C.merge_all(copies)  # _merge folded over the copies, in C
    for med in mediators:
        med.scope.update(merged)
    return merged


__all__ = [
    "ArenaReader",
    "ArenaWriter",
    "merge_shared_saves",
    "dumps_compact",
    "loads",
    "RestrictedUnpickler",
    "CompactPickler",
    "UnsafePayloadError",
    "PayloadError",
]
