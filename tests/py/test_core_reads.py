"""Reads inside a trace equal what raw torch forward hooks capture (exactly)."""

import torch

import nnloom
from conftest import check_tensor


def raw_capture(module, x, paths):
    """Outputs and inputs of the named submodules, via register_forward_hook."""
    got = {}
    handles = []
    named = dict(module.named_modules())
    for p in paths:
        def hook(mod, args, out, p=p):
            got[p] = (args, out)
        handles.append(named[p].register_forward_hook(hook))
    try:
        with torch.no_grad():
            final = module(x)
    finally:
        for h in handles:
            h.remove()
    return got, final


def test_mlp_every_layer_output(mlp, mlp_model, x16):
    paths = [f"layers.{i}" for i in range(12)]
    ref, ref_out = raw_capture(mlp, x16, paths)
    with torch.no_grad():
        with mlp_model.trace(x16):
            outs = nnloom.save([mlp_model.layers[i].output for i in range(12)])
            final = mlp_model.output.save()
    for i in range(12):
        check_tensor(outs[i], ref[f"layers.{i}"][1], f"layers.{i}")
    check_tensor(final, ref_out, "model.output")


def test_mlp_input_and_inputs(mlp, mlp_model, x16):
    ref, _ = raw_capture(mlp, x16, ["layers.3"])
    with torch.no_grad(), mlp_model.trace(x16):
        inp = mlp_model.layers[3].input.save()
        args, kwargs = mlp_model.layers[3].inputs
        pair = nnloom.save((args, kwargs))
        out = mlp_model.layers[3].output.save()
    check_tensor(inp, ref["layers.3"][0][0], "input")
    assert isinstance(pair[0], tuple) and pair[1] == {}
    check_tensor(pair[0][0], inp, "inputs[0][0]")
    check_tensor(out, ref["layers.3"][1], "output")


def test_read_values_are_live_views(mlp, mlp_model, x16):
    """The value handed to the body is the module's own tensor, not a copy."""
    seen = {}
    h = mlp.layers[5].register_forward_hook(lambda m, a, o: seen.update(ptr=o.data_ptr()))
    try:
        with torch.no_grad(), mlp_model.trace(x16):
            ptr = nnloom.save(mlp_model.layers[5].output.data_ptr())
    finally:
        h.remove()
    assert ptr == seen["ptr"]


def test_gpt2_block_outputs(gpt2_parts, gpt2, gpt2_ids):
    model, _ = gpt2_parts
    paths = [f"transformer.h.{i}" for i in range(3)] + ["lm_head", "transformer.ln_f"]
    ref, ref_out = raw_capture(model, gpt2_ids, paths)
    with torch.no_grad(), gpt2.trace(gpt2_ids):
        hs = nnloom.save([gpt2.transformer.h[i].output[0] for i in range(3)])
        ln = gpt2.transformer.ln_f.output.save()
        logits = gpt2.lm_head.output.save()
        out = gpt2.output.save()
    for i in range(3):
        assert isinstance(ref[f"transformer.h.{i}"][1], tuple)
        check_tensor(hs[i], ref[f"transformer.h.{i}"][1][0], f"h.{i}")
    check_tensor(ln, ref["transformer.ln_f"][1], "ln_f")
    check_tensor(logits, ref["lm_head"][1], "lm_head")
    check_tensor(out.logits, ref_out.logits, "logits")


def test_gpt2_keyword_inputs(gpt2_parts, gpt2, gpt2_ids):
    """.inputs gives exactly the (args, kwargs) the block was called with."""
    model, _ = gpt2_parts
    seen = {}

    def pre(mod, args, kwargs):
        seen["args"], seen["kwargs"] = args, dict(kwargs)

    h = model.transformer.h[1].register_forward_pre_hook(pre, with_kwargs=True)
    try:
        with torch.no_grad(), gpt2.trace(gpt2_ids):
            args, kwargs = gpt2.transformer.h[1].inputs
            names = nnloom.save(sorted(kwargs))
            first = gpt2.transformer.h[1].input.save()
            n_args = nnloom.save(len(args))
    finally:
        h.remove()
    assert names == sorted(seen["kwargs"])
    assert n_args == len(seen["args"])
    check_tensor(first, seen["args"][0], "h.1 input")
