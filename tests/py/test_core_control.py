"""Calling submodules, stop(), repeated calls, HF integration, unwrapping."""

import inspect

import pytest
import torch

import nnloom
from conftest import check_tensor


class Twice(torch.nn.Module):
    """Applies the same Linear twice: one module, two occurrences per forward."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.out(self.lin(self.lin(x)))


def test_call_submodule_directly(mlp, mlp_model, x16):
    with torch.no_grad(), mlp_model.trace(x16):
        h = mlp_model.layers[2].output
        direct = mlp_model.layers[3](torch.relu(h)).save()  # runs now, no interleaving
        served = mlp_model.layers[3].output.save()  # still available afterwards
    check_tensor(direct, served, "direct call vs the forward's own call")


def test_stop_ends_forward_early(mlp, mlp_model, x16):
    calls = []
    h = mlp.layers[11].register_forward_hook(lambda m, a, o: calls.append(1))
    try:
        with torch.no_grad(), mlp_model.trace(x16) as tracer:
            a = mlp_model.layers[1].output.save()
            tracer.stop()
            never = nnloom.save("not reached")
    finally:
        h.remove()
    assert calls == []  # the forward did not reach layer 11
    assert a.shape == (4, 16)
    assert "never" not in locals()


def test_stop_before_any_request(mlp_model, x16):
    with torch.no_grad(), mlp_model.trace(x16) as tracer:
        v = nnloom.save(1)
        tracer.stop()
    assert v == 1


def test_module_called_twice():
    torch.manual_seed(0)
    net = Twice()
    m = nnloom.NNsight(net)
    x = torch.randn(3, 8)
    seen = []
    h = net.lin.register_forward_hook(lambda mod, a, o: seen.append(o))
    try:
        with torch.no_grad(), m.trace(x):
            first = m.lin.output.save()
            again = m.lin.output  # re-reading the occurrence being served
            same = nnloom.save(again is first)
            second = m.lin.next().output.save()  # the next call of the module
            m.lin.output = m.lin.output * 0  # the same (second) occurrence
            out = m.out.output.save()
    finally:
        h.remove()
        m.unwrap()
    assert same is True
    check_tensor(first, seen[0], "first call")
    check_tensor(second, net.lin(first).detach(), "second call value")
    check_tensor(seen[1], torch.zeros(3, 8), "torch hooks see the edit")
    check_tensor(out, net.out(torch.zeros(3, 8)).detach(), "after zeroing 2nd call")


def test_third_occurrence_is_missed():
    m = nnloom.NNsight(Twice())
    try:
        with pytest.raises(nnloom.OutOfOrderError, match=r"model\.lin\.output\.i2"):
            with torch.no_grad(), m.trace(torch.randn(1, 8)):
                m.lin.output
                for _ in range(2):
                    m.lin.next().output
    finally:
        m.unwrap()


def test_forward_signature_preserved(gpt2_parts, gpt2):
    model, _ = gpt2_parts
    sig = inspect.signature(model.forward)
    assert "attention_mask" in sig.parameters
    assert model.forward.__name__ == "forward"


def test_user_hooks_still_run(mlp, mlp_model, x16):
    seen = []
    h = mlp.layers[2].register_forward_hook(lambda m, a, o: seen.append(o.shape))
    try:
        with torch.no_grad(), mlp_model.trace(x16):
            mlp_model.layers[2].output.save()
        with torch.no_grad():
            mlp(x16)
    finally:
        h.remove()
    assert seen == [torch.Size([4, 16])] * 2


def test_user_hook_sees_edit(mlp, mlp_model, x16):
    """torch forward hooks run after forward, so they see nnloom's edits."""
    seen = []
    h = mlp.layers[2].register_forward_hook(lambda m, a, o: seen.append(o.clone()))
    try:
        with torch.no_grad(), mlp_model.trace(x16):
            mlp_model.layers[2].output = torch.zeros(4, 16)
    finally:
        h.remove()
    assert torch.equal(seen[0], torch.zeros(4, 16))


def test_unwrap_restores_module(mlp, x16):
    before = {n: dict(m.__dict__) for n, m in mlp.named_modules()}
    m = nnloom.NNsight(mlp)
    assert "forward" in mlp.layers[0].__dict__
    m.unwrap()
    after = {n: dict(m.__dict__) for n, m in mlp.named_modules()}
    assert before.keys() == after.keys()
    for n in before:
        assert before[n].keys() == after[n].keys(), n
    assert "forward" not in mlp.layers[0].__dict__


def test_wrapper_dropped_restores_module(mlp, x16):
    m = nnloom.NNsight(mlp)
    del m
    assert "forward" not in mlp.layers[0].__dict__


def test_instance_forward_kept_and_restored(x16):
    net = torch.nn.Linear(16, 16)
    calls = []

    def patched(x):
        calls.append(1)
        return torch.nn.Linear.forward(net, x)

    net.forward = patched
    m = nnloom.NNsight(net)
    with torch.no_grad(), m.trace(x16):
        o = m.output.save()
    assert calls == [1] and o.shape == (4, 16)
    m.unwrap()
    assert net.forward is patched


def test_trace_false_runs_plainly(mlp, mlp_model, x16):
    with torch.no_grad():
        out = mlp_model.trace(x16, trace=False)
        check_tensor(out, mlp(x16))


def test_envoy_tree(gpt2):
    assert gpt2.transformer.h[0].mlp.path == "model.transformer.h.0.mlp"
    assert gpt2.transformer.h[-1].path == "model.transformer.h.2"
    assert len(gpt2.transformer.h) == 3
    assert "GPT2LMHeadModel" in repr(gpt2)
    assert gpt2.config.n_layer == 3  # non-module attributes come from the module


def test_nested_traces(x16):
    from nnloom.models import mlp

    a = nnloom.NNsight(mlp(depth=3, width=16, seed=1))
    b = nnloom.NNsight(mlp(depth=3, width=16, seed=2))
    try:
        with torch.no_grad(), a.trace(x16):
            ha = a.layers[0].output.save()
            with b.trace(x16 * 2):  # another model, its own forward, inside a's body
                hb = b.layers[1].output.save()
                inner_only = 5  # passed up to a's body, not saved: not returned
            hc = a.layers[2].output.save()
        with torch.no_grad():
            check_tensor(hb, b.layers[1]._module(torch.relu(b.layers[0]._module(x16 * 2))), "inner")
            check_tensor(hc, a.layers[2]._module(torch.relu(a.layers[1]._module(torch.relu(ha)))), "outer")
        assert "inner_only" not in locals()
    finally:
        a.unwrap()
        b.unwrap()
