"""LanguageModel: NNsight for HuggingFace causal LMs, with text batching.

``LanguageModel(hf_model, tokenizer=tok)`` accepts strings (or lists of
strings, token id tensors, or tokenizer outputs) as invoke inputs. All invokes'
prompts are tokenised and padded LEFT into one batch (pad token = eos when the
tokenizer has none); the attention mask and the position ids are passed to the
model, so a padded prompt computes exactly what it computes alone.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .batching import Batcher
from .envoy import NNsight
from .tracing import Tracer

__all__ = ["LanguageModel", "TextBatcher"]


class TextBatcher(Batcher):
    """Batches text prompts for a causal LM: left padding, mask, position ids."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    # -- one invoke's input -> rows of token ids -------------------------------

    def _rows(self, args: tuple, kwargs: dict):
        """(list of id lists, list of mask lists or None, extra kwargs)."""
        kwargs = dict(kwargs)
        if args:
            if len(args) > 1:
                raise ValueError("an invoke takes one input (text, ids or tokenizer output)")
            value = args[0]
        elif "input_ids" in kwargs:
            value = kwargs.pop("input_ids")
        else:
            raise ValueError("the invoke has no input")
        mask = kwargs.pop("attention_mask", None)
        kwargs.pop("position_ids", None)  # recomputed for the combined batch
        if hasattr(value, "keys") and "input_ids" in value:  # BatchEncoding / dict
            mask = value.get("attention_mask", mask)
            value = value["input_ids"]
        if isinstance(value, str):
            value = [value]
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
            enc = self.tokenizer(list(value), add_special_tokens=False)
            ids, mask = enc["input_ids"], enc["attention_mask"]
        elif isinstance(value, torch.Tensor):
            t = value if value.dim() == 2 else value.reshape(1, -1)
            ids = t.tolist()
            if mask is not None:
                m = mask if mask.dim() == 2 else mask.reshape(1, -1)
                mask = m.tolist()
        elif isinstance(value, (list, tuple)) and value and isinstance(value[0], int):
            ids = [list(value)]
        elif isinstance(value, (list, tuple)) and value and isinstance(value[0], (list, tuple)):
            ids = [list(r) for r in value]
        else:
            raise ValueError(f"cannot make token ids from a {type(value).__name__}")
        if mask is None:
            mask = [[1] * len(r) for r in ids]
        if any(len(r) == 0 for r in ids):
            raise ValueError("an invoke's prompt is empty after tokenisation")
        return ids, [list(m) for m in mask], kwargs

    def batch_size(self, args, kwargs) -> int:
        return len(self._rows(args, kwargs)[0])

    def combine(self, inputs: Sequence[tuple]) -> tuple:
        all_ids, all_mask, extra = [], [], None
        for a, k in inputs:
            ids, mask, kw = self._rows(a, k)
            if extra is None:
                extra = kw
            elif kw.keys() != extra.keys() or any(kw[n] is not extra[n] and kw[n] != extra[n] for n in kw):
                raise ValueError("invokes pass different keyword arguments; cannot batch them")
            all_ids += ids
            all_mask += mask
        return (), self._pad(all_ids, all_mask, extra or {})

    def single(self, args, kwargs) -> tuple:
        ids, mask, kw = self._rows(args, kwargs)
        return (), self._pad(ids, mask, kw)

    def _pad(self, ids, mask, extra) -> dict:
        pad = self.tokenizer.pad_token_id
        width = max(len(r) for r in ids)
        input_ids = torch.full((len(ids), width), pad, dtype=torch.long)
        attn = torch.zeros((len(ids), width), dtype=torch.long)
        for i, (r, m) in enumerate(zip(ids, mask)):
            input_ids[i, width - len(r):] = torch.tensor(r, dtype=torch.long)
            attn[i, width - len(r):] = torch.tensor(m, dtype=torch.long)
        position_ids = (attn.cumsum(-1) - 1).clamp_min(0)
        out = dict(extra)
        out.update(input_ids=input_ids, attention_mask=attn, position_ids=position_ids)
        return out


class LanguageModel(NNsight):
    """Wrap a pre-built HuggingFace causal LM and its tokenizer for tracing.

    ``model.trace("text")`` or ``tracer.invoke("text")``; strings are tokenised
    without special tokens and padded left.
    """

    def __init__(self, model: torch.nn.Module, *, tokenizer=None, **kwargs: Any):
        if tokenizer is None:
            raise ValueError("LanguageModel needs tokenizer=...: pass the model's tokenizer "
                             "(nnloom does not download anything)")
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        tokenizer.padding_side = "left"
        super().__init__(model, batcher=TextBatcher(tokenizer), **kwargs)
        self.__dict__["tokenizer"] = tokenizer

    _GEN_INPUTS = ("input_ids", "attention_mask")

    def generate(self, *args, max_new_tokens: int = 1, **kwargs: Any) -> Tracer:
        """``with model.generate(prompt, max_new_tokens=n) as tracer:``

        The body runs interleaved with HF ``generate``; each new token is one
        step (``tracer.iter[...]``, ``tracer.all()``); ``tracer.result`` holds
        the generated ids."""
        inputs = {k: kwargs.pop(k) for k in self._GEN_INPUTS if k in kwargs}
        gen = dict(kwargs)
        gen["max_new_tokens"] = max_new_tokens
        gen.setdefault("pad_token_id", self.tokenizer.pad_token_id)
        return Tracer(self, args, inputs, method="generate", method_kwargs=gen,
                      steps=max_new_tokens)
