"""Edits inside a trace equal the same patch written by hand in PyTorch."""

import pytest
import torch

import nnloom
from conftest import check_tensor


def patched_run(module, x, path, fn):
    """Run `module` with a forward hook on `path` that returns fn(output)."""
    sub = dict(module.named_modules())[path]
    h = sub.register_forward_hook(lambda m, a, o: fn(o))
    try:
        with torch.no_grad():
            return module(x)
    finally:
        h.remove()


def pre_patched_run(module, x, path, fn):
    """Run `module` with a forward pre-hook on `path` that returns fn(args)."""
    sub = dict(module.named_modules())[path]
    h = sub.register_forward_pre_hook(lambda m, a: fn(a))
    try:
        with torch.no_grad():
            return module(x)
    finally:
        h.remove()


def test_inplace_edit(mlp, mlp_model, x16):
    def zero_col(o):
        o = o.clone()
        o[:, 0] = 0
        return o

    ref = patched_run(mlp, x16, "layers.5", zero_col)
    with torch.no_grad(), mlp_model.trace(x16):
        mlp_model.layers[5].output[:, 0] = 0
        out = mlp_model.output.save()
    check_tensor(out, ref, "output after in-place edit")


def test_replace_output(mlp, mlp_model, x16):
    ref = patched_run(mlp, x16, "layers.7", lambda o: o * 2)
    with torch.no_grad(), mlp_model.trace(x16):
        mlp_model.layers[7].output = mlp_model.layers[7].output * 2
        seen = mlp_model.layers[7].output.save()  # reads the new value
        out = mlp_model.output.save()
    check_tensor(out, ref, "output after replace")
    doubled = {}
    h = mlp.layers[7].register_forward_hook(lambda m, a, o: doubled.update(v=o * 2))
    try:
        with torch.no_grad():
            mlp(x16)
    finally:
        h.remove()
    check_tensor(seen, doubled["v"], "value read back after assignment")


def test_read_then_write_later_layer(mlp, mlp_model, x16):
    """Read layer 2, write it into layer 8 (a classic patch within one prompt)."""
    cap = {}
    named = dict(mlp.named_modules())
    h1 = named["layers.2"].register_forward_hook(lambda m, a, o: cap.setdefault("h", o))
    h2 = named["layers.8"].register_forward_hook(lambda m, a, o: cap["h"].clone())
    try:
        with torch.no_grad():
            ref = mlp(x16)
    finally:
        h1.remove()
        h2.remove()
    with torch.no_grad(), mlp_model.trace(x16):
        h = mlp_model.layers[2].output.clone()
        mlp_model.layers[8].output = h
        out = mlp_model.output.save()
    check_tensor(out, ref, "patched output")


def test_input_assignment(mlp, mlp_model, x16):
    ref = pre_patched_run(mlp, x16, "layers.4", lambda a: (a[0] + 1,))
    with torch.no_grad(), mlp_model.trace(x16):
        mlp_model.layers[4].input = mlp_model.layers[4].input + 1
        out = mlp_model.output.save()
    check_tensor(out, ref, "output after input edit")


def test_inputs_assignment(mlp, mlp_model, x16):
    ref = pre_patched_run(mlp, x16, "layers.4", lambda a: (a[0] * 0,))
    with torch.no_grad(), mlp_model.trace(x16):
        args, kwargs = mlp_model.layers[4].inputs
        mlp_model.layers[4].inputs = ((args[0] * 0,), kwargs)
        out = mlp_model.output.save()
    check_tensor(out, ref, "output after inputs edit")


def test_tuple_output_edit_gpt2(gpt2_parts, gpt2, gpt2_ids):
    model, _ = gpt2_parts

    def zero_last(o):
        h = o[0].clone()
        h[:, -1] = 0
        return (h,) + tuple(o[1:])

    ref = patched_run(model, gpt2_ids, "transformer.h.1", zero_last).logits
    with torch.no_grad(), gpt2.trace(gpt2_ids):
        gpt2.transformer.h[1].output[0][:, -1] = 0
        logits = gpt2.lm_head.output.save()
    check_tensor(logits, ref, "logits after tuple-element edit")


def test_tuple_output_replace_gpt2(gpt2_parts, gpt2, gpt2_ids):
    model, _ = gpt2_parts
    ref = patched_run(model, gpt2_ids, "transformer.h.0",
                      lambda o: (o[0] * 0.5,) + tuple(o[1:])).logits
    with torch.no_grad(), gpt2.trace(gpt2_ids):
        out = gpt2.transformer.h[0].output
        gpt2.transformer.h[0].output = (out[0] * 0.5,) + tuple(out[1:])
        logits = gpt2.lm_head.output.save()
    check_tensor(logits, ref, "logits after tuple replace")


def test_shape_mismatch_is_clear(mlp_model, x16):
    with pytest.raises(ValueError) as ei:
        with torch.no_grad(), mlp_model.trace(x16):
            mlp_model.layers[3].output = torch.zeros(2, 2)
    msg = str(ei.value)
    assert "model.layers.3.output.i0" in msg and "(2, 2)" in msg.replace("torch.Size([2, 2])", "(2, 2)")


def test_model_unchanged_after_edit(mlp, mlp_model, x16):
    with torch.no_grad():
        before = mlp(x16)
        with mlp_model.trace(x16):
            mlp_model.layers[0].output[:] = 0
        after = mlp(x16)
    check_tensor(after, before, "plain run after a traced edit")
