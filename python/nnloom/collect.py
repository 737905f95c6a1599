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

from . import _C

UnsafePayloadError = _C.UnsafePayloadError
PayloadError = _C.PayloadError
CompactPickler = _C.CompactPickler


def dumps_compact(value) -> bytes:
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
    """
    return _C.dumps_compact(value)


__all__ = ["dumps_compact", "CompactPickler", "UnsafePayloadError", "PayloadError"]
