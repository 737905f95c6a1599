"""NVTX ranges in the nnloom domain, checked through an injection library
(tests/c/nvtx_inject.c) that NVTX loads from NVTX_INJECTION64_PATH and that
logs each push/pop to a file: no Nsight needed. Each case runs in a fresh
interpreter because NVTX binds its injection once per process."""
import glob
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from nnloom import _C

ROOT = Path(__file__).resolve().parents[2]
# the nnloom this test imported (installed or in-tree), for the subprocesses
PKG_PARENT = str(Path(_C.__file__).resolve().parents[1])


def inject_library(tmp_path_factory):
    for cand in sorted(glob.glob(str(ROOT / "build" / "*" / "libnnloom_nvtx_inject.so"))):
        return cand
    cc = shutil.which("cc") or shutil.which("gcc")
    inc = None
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root and (Path(root) / "include" / "nvtx3" / "nvToolsExt.h").exists():
            inc = str(Path(root) / "include")
    if cc is None or inc is None:
        return None
    out = tmp_path_factory.mktemp("nvtx") / "libnnloom_nvtx_inject.so"
    r = subprocess.run([cc, "-shared", "-fPIC", "-O1", "-I", inc, "-o", str(out),
                        str(ROOT / "tests" / "c" / "nvtx_inject.c"), "-lpthread"],
                       capture_output=True, text=True)
    return str(out) if r.returncode == 0 else None


@pytest.fixture(scope="module")
def inject(tmp_path_factory):
    if not _C.nvtx_enabled():
        pytest.skip("built without NVTX or NNLOOM_NVTX=0")
    lib = inject_library(tmp_path_factory)
    if lib is None:
        pytest.skip("no NVTX injection library and no compiler to build it")
    return lib


def run(code, inject, tmp_path, **env):
    log = tmp_path / "nvtx.log"
    e = dict(os.environ, NVTX_INJECTION64_PATH=inject, NNLOOM_NVTX_LOG=str(log),
             PYTHONPATH=os.pathsep.join([PKG_PARENT, os.environ.get("PYTHONPATH", "")]))
    e.update(env)
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=e,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lines = log.read_text().splitlines() if log.exists() else []
    return [ln for ln in lines if " nnloom" in ln or ln.startswith("create nnloom")], r.stdout


PROGRAM = """
    import torch
    from nnloom import _C
    with _C.nvtx_range("nnloom.trace"):
        with _C.nvtx_range("model.transformer.h.3"):
            pass
    try:
        with _C.nvtx_range("nnloom.invoke"):
            raise ValueError("user error")
    except ValueError:
        pass
    pool = _C.PinnedPool(events="cpu")
    x = torch.arange(24.0).reshape(4, 6)
    pool.stage([x[1:2], x[:, ::2]]).tensors()
    print(_C.nvtx_depth())
"""


def test_ranges_recorded_and_balanced(inject, tmp_path):
    lines, out = run(PROGRAM, inject, tmp_path)
    assert out.strip() == "0"
    assert lines == [
        "create nnloom",
        "push nnloom nnloom.trace",
        "push nnloom model.transformer.h.3",
        "pop nnloom",
        "pop nnloom",
        "push nnloom nnloom.invoke",
        "pop nnloom",  # popped on the error path too
        "push nnloom nnloom.compact",
        "pop nnloom",
    ]


def test_env_switch_turns_ranges_off(inject, tmp_path):
    lines, out = run(PROGRAM, inject, tmp_path, NNLOOM_NVTX="0")
    assert lines == [] and out.strip() == "0"


def test_depth_in_process():
    d = _C.nvtx_depth()
    with _C.nvtx_range("x"):
        assert _C.nvtx_depth() == d + 1
        with pytest.raises(RuntimeError):
            r = _C.nvtx_range("y")
            with r:
                with r:  # entering twice is refused and leaves nothing open
                    pass
        assert _C.nvtx_depth() == d + 1
    assert _C.nvtx_depth() == d
    _C.nvtx_push("manual")
    _C.nvtx_pop()
    assert _C.nvtx_depth() == d


TRACE_PROGRAM = """
    import torch, nnloom
    from nnloom import _C
    net = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    m = nnloom.NNsight(net)
    with torch.no_grad(), m.trace(torch.randn(2, 4)):
        h = m[0].output.save()
        m[2].output[:] = 0
    try:
        with torch.no_grad(), m.trace(torch.randn(2, 4)):
            m[2].output
            m[0].output
    except nnloom.OutOfOrderError:
        pass
    print(_C.nvtx_depth())
"""


def test_trace_invoke_and_handoff_ranges(inject, tmp_path):
    lines, out = run(TRACE_PROGRAM, inject, tmp_path)
    assert out.strip() == "0"
    assert lines == [
        "create nnloom",
        # trace 1: the body starts, parks on model.0, is handed model.0 then model.2
        "push nnloom nnloom.trace",
        "push nnloom nnloom.invoke",
        "pop nnloom",
        "push nnloom model.0",
        "push nnloom nnloom.invoke",
        "pop nnloom",
        "pop nnloom",
        "push nnloom model.2",
        "push nnloom nnloom.invoke",
        "pop nnloom",
        "pop nnloom",
        "pop nnloom",
        # trace 2: the out-of-order error unwinds through every range
        "push nnloom nnloom.trace",
        "push nnloom nnloom.invoke",
        "pop nnloom",
        "push nnloom model.2",
        "push nnloom nnloom.invoke",
        "pop nnloom",
        "pop nnloom",
        "pop nnloom",
    ]
