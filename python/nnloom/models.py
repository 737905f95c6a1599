"""Small built-in models for the demo, tests and benchmarks (no downloads).

``tiny_lm()`` builds a randomly initialised GPT-2 from a ``GPT2Config`` and a
character-level tokenizer that needs no vocabulary files, so a language-model
experiment runs on a machine with no network access. ``mlp()`` is a plain
``torch.nn`` stack of Linear layers.
"""

from __future__ import annotations

import string

import torch

__all__ = ["mlp", "MLP", "tiny_lm", "char_tokenizer"]


class MLP(torch.nn.Module):
    """``depth`` Linear layers of width ``width`` with ReLU between them."""

    def __init__(self, depth: int = 12, width: int = 64):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))
        self.act = torch.nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = self.act(layer(x))
        return x


def mlp(depth: int = 12, width: int = 64, seed: int = 0) -> MLP:
    torch.manual_seed(seed)
    return MLP(depth, width).eval()


_CHARS = string.ascii_letters + string.digits + string.punctuation + " "


def char_tokenizer():
    """A ``PreTrainedTokenizerFast`` mapping each printable character to a token.

    Token 0 is ``<eos>`` (also the pad token once a wrapper sets it); the
    vocabulary has ``len(string.printable) - 5 + 1`` entries.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0}
    for c in _CHARS:
        vocab[c] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<eos>")
    return fast


def tiny_lm(n_layer: int = 4, n_embd: int = 64, n_head: int = 4, n_positions: int = 128,
            seed: int = 0):
    """(model, tokenizer): a random GPT-2 causal LM and its character tokenizer."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = char_tokenizer()
    cfg = GPT2Config(
        n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=n_positions,
        vocab_size=len(tok), bos_token_id=0, eos_token_id=0,
    )
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(cfg).eval()
    return model, tok
