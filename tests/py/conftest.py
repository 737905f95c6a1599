"""Shared fixtures: small models built from configs (random weights, no downloads)."""

import os
import sys

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import nnloom  # noqa: E402
from nnloom import models  # noqa: E402


def check_tensor(a: torch.Tensor, b: torch.Tensor, name: str = "", atol=0.0, rtol=0.0):
    """Assert a == b (within tolerances), printing the max abs/rel difference."""
    assert a.shape == b.shape, f"{name}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert a.dtype == b.dtype, f"{name}: dtype {a.dtype} != {b.dtype}"
    if atol == 0.0 and rtol == 0.0:
        ok = torch.equal(a, b)
    else:
        ok = torch.allclose(a, b, atol=atol, rtol=rtol)
    if not ok:
        d = (a.double() - b.double()).abs()
        rel = d / b.double().abs().clamp_min(1e-12)
        pytest.fail(f"{name}: max abs diff {d.max().item():.3g}, max rel diff {rel.max().item():.3g}")


@pytest.fixture
def mlp():
    return models.mlp(depth=12, width=16, seed=0)


@pytest.fixture
def mlp_model(mlp):
    m = nnloom.NNsight(mlp)
    yield m
    m.unwrap()


@pytest.fixture(scope="session")
def gpt2_parts():
    model, tok = models.tiny_lm(n_layer=3, n_embd=32, n_head=4, n_positions=64, seed=0)
    return model, tok


@pytest.fixture
def gpt2(gpt2_parts):
    model, _ = gpt2_parts
    m = nnloom.NNsight(model)
    yield m
    m.unwrap()


@pytest.fixture
def gpt2_ids(gpt2_parts):
    _, tok = gpt2_parts
    return torch.tensor([tok("The Eiffel Tower is in")["input_ids"]])


@pytest.fixture
def x16():
    torch.manual_seed(1)
    return torch.randn(4, 16)
