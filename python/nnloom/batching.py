"""Combining the inputs of several invokes into one batch.

A :class:`Batcher` is the adapter protocol a model wrapper uses:
``batch_size(args, kwargs)`` tells how many rows one invoke's input has, and
``combine(inputs)`` joins the inputs of all invokes that have one into a single
``(args, kwargs)`` whose rows are in invoke order. An invoke without input
(``tracer.invoke()``) sees and may edit the whole batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

__all__ = ["Batcher", "TensorBatcher", "BatchPlan", "plan_batch"]


class Batcher:
    """Adapter protocol: how a model's inputs are counted and combined."""

    def batch_size(self, args: tuple, kwargs: dict) -> int:
        raise NotImplementedError

    def combine(self, inputs: Sequence[tuple]) -> tuple:
        """[(args, kwargs), ...] -> (args, kwargs) of the whole batch."""
        raise NotImplementedError

    def single(self, args: tuple, kwargs: dict) -> tuple:
        """The model's call for a trace with one input invoke (default: as given)."""
        return args, dict(kwargs)


class TensorBatcher(Batcher):
    """Batch along dim 0: tensors are concatenated, everything else must be equal."""

    def batch_size(self, args, kwargs):
        for v in list(args) + list(kwargs.values()):
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                return int(v.shape[0])
        raise ValueError("TensorBatcher: the invoke's input has no tensor to count rows of")

    def combine(self, inputs):
        first_args, first_kwargs = inputs[0]
        for a, k in inputs[1:]:
            if len(a) != len(first_args) or set(k) != set(first_kwargs):
                raise ValueError("invokes must be called with the same arguments to be batched")
        args = tuple(self._join([a[i] for a, _ in inputs]) for i in range(len(first_args)))
        kwargs = {n: self._join([k[n] for _, k in inputs]) for n in first_kwargs}
        return args, kwargs

    @staticmethod
    def _join(values):
        v0 = values[0]
        if isinstance(v0, torch.Tensor):
            return torch.cat(values, 0)
        for v in values[1:]:
            if v is not v0 and v != v0:
                raise ValueError("non-tensor arguments differ between invokes; cannot batch them")
        return v0


@dataclass
class BatchPlan:
    args: tuple
    kwargs: dict
    batch_size: int
    rows: list  # per invoke: (start, size), or (-1, 0) for the whole batch


def plan_batch(batcher: Batcher | None, inputs: list) -> BatchPlan:
    """Decide the batch for invokes with inputs [(args, kwargs), ...]."""
    given = [i for i, (a, k) in enumerate(inputs) if a or k]
    if not given:
        raise ValueError("trace() needs an input: every invoke is empty")
    if len(given) == 1:
        a, k = inputs[given[0]]
        if batcher is None:
            return BatchPlan(a, dict(k), _guess_rows(a, k), [(-1, 0)] * len(inputs))
        n = batcher.batch_size(a, k)
        a, k = batcher.single(a, k)
        return BatchPlan(a, k, n, [(-1, 0)] * len(inputs))
    if batcher is None:
        raise ValueError(
            f"{len(given)} invokes have inputs, but this model has no batcher to combine them; "
            "wrap it as NNsight(module, batcher=nnloom.TensorBatcher()) or give the inputs to "
            "one invoke"
        )
    rows = []
    start = 0
    for i, (a, k) in enumerate(inputs):
        if a or k:
            n = batcher.batch_size(a, k)
            rows.append((start, n))
            start += n
        else:
            rows.append((-1, 0))
    args, kwargs = batcher.combine([inputs[i] for i in given])
    return BatchPlan(args, kwargs, start, rows)


def _guess_rows(args, kwargs) -> int:
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, torch.Tensor) and v.dim() > 0:
            return int(v.shape[0])
    return 1
