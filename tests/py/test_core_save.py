"""save() semantics and how values reach the caller's frame."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import nnloom
from conftest import check_tensor

PY = sys.executable


def test_save_any_object(mlp_model, x16):
    with torch.no_grad(), mlp_model.trace(x16):
        a = [1, 2].save()
        b = {"k": mlp_model.layers[0].output.shape}.save()
        c = nnloom.save(41 + 1)
        d = nnloom.save("text")
        t = mlp_model.layers[1].output.save()
    assert a == [1, 2]
    assert b == {"k": torch.Size([4, 16])}
    assert c == 42 and d == "text"
    assert isinstance(t, torch.Tensor)


def test_only_saved_names_come_back(mlp_model, x16):
    kept = "before"
    with torch.no_grad(), mlp_model.trace(x16):
        kept = nnloom.save("after")
        not_saved = mlp_model.layers[0].output
        tmp = 5
    assert kept == "after"
    assert "not_saved" not in locals()
    assert "tmp" not in locals()


def test_save_marks_the_object_not_the_expression(mlp_model, x16):
    with torch.no_grad(), mlp_model.trace(x16):
        x = mlp_model.layers[2].output
        y = x.save() * 2  # saves x; y is a new tensor, not saved
        z = x.save()
    assert "y" not in locals()
    check_tensor(z, z)  # z came back


def test_save_returns_same_object(mlp_model, x16):
    with torch.no_grad(), mlp_model.trace(x16):
        o = mlp_model.layers[0].output
        same = nnloom.save(o.save() is o)
    assert same is True


def test_save_outside_trace_is_an_error():
    with pytest.raises(ValueError, match="inside a trace"):
        nnloom.save([])
    # the method form: ours, or another library's `object.save` we hand over to
    with pytest.raises(ValueError, match="trace"):
        [].save()


def test_coexists_with_nnsight(tmp_path):
    """nnsight mounts its own object.save at import; both libraries' traces
    must still save (whichever is imported first)."""
    pytest.importorskip("nnsight")
    code = """
import torch, nnloom, nnsight
net = torch.nn.Sequential(torch.nn.Linear(4, 4))
a = nnloom.NNsight(net)
with a.trace(torch.randn(2, 4)):
    h = a[0].output.save()
a.unwrap()
b = nnsight.NNsight(net)
with b.trace(torch.randn(2, 4)):
    g = b[0].output.save()
print("OK", tuple(h.shape), tuple(g.shape))
"""
    for first, second in (("nnloom", "nnsight"), ("nnsight", "nnloom")):
        src = code.replace("import torch, nnloom, nnsight", f"import torch, {first}, {second}")
        r = subprocess.run([PY, "-c", src], capture_output=True, text=True, timeout=300)
        assert "OK (2, 4) (2, 4)" in r.stdout, r.stderr[-2000:]


def test_list_appended_in_body(mlp_model, x16):
    with torch.no_grad(), mlp_model.trace(x16):
        shapes = nnloom.save([])
        for i in range(3):
            shapes.append(mlp_model.layers[i].output.shape)
    assert shapes == [torch.Size([4, 16])] * 3


def test_values_from_outside_and_control_flow(mlp_model, x16):
    scale = 3.0
    layers = [1, 4]

    def helper(t):
        return t.sum().item()

    with torch.no_grad(), mlp_model.trace(x16):
        sums = nnloom.save({})
        for i in range(6):
            if i in layers:
                sums[i] = helper(mlp_model.layers[i].output * scale)
        print("inside the body", len(sums))
    assert sorted(sums) == layers


def test_outer_value_mutation_visible(mlp_model, x16):
    box = []
    with torch.no_grad(), mlp_model.trace(x16):
        box.append(mlp_model.layers[0].output.shape)
    assert box == [torch.Size([4, 16])]  # same object, mutated in the body


def _run(code: str, tmp_path, name="prog.py"):
    p = tmp_path / name
    p.write_text(textwrap.dedent(code))
    env = dict(os.environ)
    r = subprocess.run([PY, str(p)], capture_output=True, text=True, env=env, timeout=120)
    return r


PROLOGUE = """
import torch, nnloom
from nnloom.models import mlp
model = nnloom.NNsight(mlp(depth=4, width=8))
x = torch.randn(2, 8)
"""


def test_module_level_push(tmp_path):
    r = _run(PROLOGUE + """
with model.trace(x):
    h = model.layers[1].output.save()
print("OK", tuple(h.shape))
""", tmp_path)
    assert r.returncode == 0, r.stderr
    assert "OK (2, 8)" in r.stdout


def test_python_dash_c(tmp_path):
    code = PROLOGUE + "with model.trace(x):\n    h = model.layers[1].output.save()\nprint('OK', tuple(h.shape))\n"
    r = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "OK (2, 8)" in r.stdout


def test_nested_function_and_closure_push(tmp_path):
    r = _run(PROLOGUE + """
def f():
    cell = 1
    def g():
        return cell
    with model.trace(x):
        cell = nnloom.save(7)
        h = model.layers[0].output.save()
    return cell, g(), tuple(h.shape)
print("OK", f())
""", tmp_path)
    assert r.returncode == 0, r.stderr
    assert "OK (7, 7, (2, 8))" in r.stdout


def test_trace_in_a_loop_is_memoised(mlp_model, x16):
    from nnloom import _capture
    res = []
    for i in range(5):
        with torch.no_grad(), mlp_model.trace(x16):
            v = nnloom.save(mlp_model.layers[i].output.sum().item())
        res.append(v)
    assert len(res) == 5 and len(set(res)) == 5
    sites = [k for k in _capture._SITES if k[0].co_name == "test_trace_in_a_loop_is_memoised"]
    assert len(sites) == 1


def test_notebook_cell_source(mlp_model, x16):
    """IPython registers each cell's source in linecache under a made-up name;
    a trace in such a cell is captured from there."""
    import linecache

    name = "<ipython-input-7-feedc0ffee>"
    src = "with model.trace(x):\n    h = model.layers[1].output.save()\nresult.append(h)\n"
    linecache.cache[name] = (len(src), None, src.splitlines(True), name)
    try:
        result = []
        exec(compile(src, name, "exec"), {"model": mlp_model, "x": x16, "result": result,
                                          "torch": torch})
        assert result[0].shape == (4, 16)
    finally:
        del linecache.cache[name]
