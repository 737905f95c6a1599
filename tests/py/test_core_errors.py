"""Errors: type, message, where they surface, and that nothing is left behind."""

import os
import subprocess
import sys
import textwrap
import traceback

import pytest
import torch

import nnloom
from nnloom import _C
from conftest import check_tensor

PKG_DIR = os.path.dirname(nnloom.__file__)


def user_frames(exc):
    return [f for f in traceback.extract_tb(exc.__traceback__)]


def assert_clean(model_fn=None):
    assert _C.current_invoke() == -1
    assert _C.scope_depth() == 0


def test_out_of_order_raised_at_user_line(mlp_model, x16):
    with pytest.raises(nnloom.OutOfOrderError) as ei:
        with torch.no_grad(), mlp_model.trace(x16):
            mlp_model.layers[5].output.save()
            mlp_model.layers[2].output  # OFFENDING
    e = ei.value
    assert str(e).startswith("'model.layers.2.output.i0' was requested but the model already ran past it")
    frames = user_frames(e)
    assert frames[-1].line.endswith("# OFFENDING")
    assert frames[-1].filename == __file__
    assert not [f for f in frames if f.filename.startswith(PKG_DIR)]
    assert_clean()


def test_out_of_order_input_after_output(mlp_model, x16):
    with pytest.raises(nnloom.OutOfOrderError, match=r"'model\.layers\.3\.input\.i0'"):
        with torch.no_grad(), mlp_model.trace(x16):
            mlp_model.layers[3].output
            mlp_model.layers[3].input


class Gated(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 4)
        self.unused = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.a(x)


def test_request_never_served():
    m = nnloom.NNsight(Gated())
    try:
        with pytest.raises(nnloom.MissedProviderError) as ei:
            with torch.no_grad(), m.trace(torch.randn(2, 4)):
                h = m.a.output.save()
                m.unused.output  # NEVER CALLED
        assert "'model.unused.output.i0' was requested but the forward never reached it" in str(ei.value)
        assert user_frames(ei.value)[-1].line.endswith("# NEVER CALLED")
        assert nnloom.MissedProviderError is nnloom.OutOfOrderError
    finally:
        m.unwrap()


def test_user_exception_keeps_type_and_traceback(mlp_model, x16):
    def helper(t):
        return t[100]  # IndexError here

    with pytest.raises(IndexError) as ei:
        with torch.no_grad(), mlp_model.trace(x16):
            h = mlp_model.layers[1].output
            helper(h)  # CALLS HELPER
    frames = user_frames(ei.value)
    assert [f.filename for f in frames] == [__file__] * len(frames)
    lines = [f.line for f in frames]
    assert any(l.endswith("# CALLS HELPER") for l in lines)
    assert lines[-1].endswith("# IndexError here")
    assert_clean()


def test_exception_before_any_request(mlp_model, x16):
    with pytest.raises(KeyError):
        with mlp_model.trace(x16):
            {}["missing"]
    assert_clean()


def test_model_runs_as_before_after_errors(mlp, mlp_model, x16):
    with torch.no_grad():
        before = mlp(x16)
    for exc in (RuntimeError, nnloom.OutOfOrderError, ValueError):
        with pytest.raises(exc):
            with torch.no_grad(), mlp_model.trace(x16):
                mlp_model.layers[4].output[:] = 0
                if exc is RuntimeError:
                    raise RuntimeError("boom")
                if exc is ValueError:
                    mlp_model.layers[6].output = torch.zeros(1)
                mlp_model.layers[0].output
    with torch.no_grad():
        after = mlp(x16)
    check_tensor(after, before, "plain run after failed traces")
    with torch.no_grad(), mlp_model.trace(x16):
        ok = mlp_model.output.save()
    check_tensor(ok, before, "traced run after failed traces")
    assert_clean()


def test_error_inside_model_forward_propagates(x16):
    class Bad(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(16, 16)

        def forward(self, x):
            raise ArithmeticError("model failure")

    m = nnloom.NNsight(Bad())
    try:
        with pytest.raises(ArithmeticError, match="model failure"):
            with m.trace(x16):
                m.a.output.save()
        assert_clean()
    finally:
        m.unwrap()


def test_no_input_message(mlp_model):
    with pytest.raises(ValueError) as ei:
        with mlp_model.trace():
            mlp_model.layers[0].output.save()
    assert str(ei.value) == "trace() needs an input, or at least one `with tracer.invoke(...)` block"


def test_output_outside_trace(mlp_model):
    with pytest.raises(ValueError, match="only be used inside the body of a trace"):
        mlp_model.layers[0].output


def _run(code, tmp_path, env=None):
    p = tmp_path / "prog.py"
    p.write_text(textwrap.dedent(code))
    e = dict(os.environ)
    e.update(env or {})
    return subprocess.run([sys.executable, str(p)], capture_output=True, text=True, env=e,
                          timeout=120)


PROLOGUE = """
import torch, nnloom
from nnloom.models import mlp
model = nnloom.NNsight(mlp(depth=4, width=8))
x = torch.randn(2, 8)
ran = []
"""


def test_body_on_with_line(tmp_path):
    r = _run(PROLOGUE + """
try:
    with model.trace(x): ran.append(1)
except nnloom.SourceError as e:
    print("ERR", e)
print("RAN", ran)
""", tmp_path)
    assert r.returncode == 0, r.stderr
    assert "is written on the `with` line" in r.stdout
    assert "RAN []" in r.stdout


def test_body_starting_with_try(tmp_path):
    r = _run(PROLOGUE + """
try:
    with model.trace(x):
        try:
            ran.append(1)
        except Exception:
            pass
except nnloom.SourceError as e:
    print("ERR", e)
print("RAN", ran)
""", tmp_path)
    assert r.returncode == 0, r.stderr
    assert "starts with `try:`" in r.stdout
    assert "RAN []" in r.stdout


def test_source_not_found(mlp_model, x16):
    code = "with model.trace(x):\n    ran.append(1)\n"
    ran = []
    with pytest.raises(nnloom.SourceError, match="compiled from a string"):
        exec(compile(code, "<string>", "exec"), {"model": mlp_model, "x": x16, "ran": ran})
    assert ran == []


def test_debug_env_shows_runtime_frames(tmp_path):
    code = PROLOGUE + """
import traceback
try:
    with model.trace(x):
        model.layers[2].output
        model.layers[1].output
except nnloom.OutOfOrderError as e:
    files = [f.filename for f in traceback.extract_tb(e.__traceback__)]
    print("INTERNAL", any("nnloom" in f and "prog.py" not in f for f in files))
"""
    r = _run(code, tmp_path)
    assert "INTERNAL False" in r.stdout, r.stderr
    r = _run(code, tmp_path, env={"NNLOOM_DEBUG": "1"})
    assert "INTERNAL True" in r.stdout, r.stderr
