"""Request mode: each invoke its own request; merged results equal local ones."""

import importlib.util
import random
import sys
import textwrap

import pytest
import torch

import nnloom
from nnloom import models

N_LAYERS = 6


@pytest.fixture(scope="module")
def model():
    m = nnloom.NNsight(models.mlp(depth=N_LAYERS, width=8, seed=4), batcher=nnloom.TensorBatcher())
    yield m
    m.unwrap()


def _gen_program(k: int, rng: random.Random) -> str:
    """Source of prog_k(m, xs, backend): a random trace over shared slot
    lists, shared dicts, nested containers, per-invoke saves and conflicting
    writes (the later invoke wins, locally and after the merge)."""
    n = rng.randint(1, 4)
    lines = [
        f"def prog_{k}(m, xs, backend):",
        "    with torch.no_grad(), m.trace(backend=backend) as tracer:",
        f"        slots = nnloom.save([None] * {n + 1})",
        "        table = nnloom.save({})",
        f"        nested = nnloom.save({{'a': [None] * {n}, 'b': {{}}}})",
        "        untouched = nnloom.save([0, 1])",
    ]
    for i in range(n):
        lines.append(f"        with tracer.invoke(xs[{i}]):")
        layers = sorted(rng.sample(range(N_LAYERS), rng.randint(1, 3)))
        body = []
        for L in layers:
            kind = rng.choice(["slot", "conflict", "key", "shared_key", "nested", "own", "mine"])
            v = f"m.layers[{L}].output"
            if kind == "slot":
                body.append(f"slots[{i}] = {v}[0].clone()")
            elif kind == "conflict":
                body.append(f"slots[{n}] = {v}.sum()")
            elif kind == "key":
                body.append(f"table['k{i}'] = {v}.mean()")
            elif kind == "shared_key":
                body.append(f"table['shared'] = ({i}, {v}.max())")
            elif kind == "nested":
                body.append(f"nested['a'][{i}] = {v}[:, 0]")
                body.append(f"nested['b']['x{i}'] = [{v}.min(), {i}]")
            elif kind == "own":
                body.append(f"own_{i} = {v}.save()")
            else:
                body.append(f"mine = nnloom.save(({i}, {v}.shape))")
        lines += ["            " + b for b in body]
    lines.append("    return {k: v for k, v in locals().items() if k not in ('m', 'xs', 'backend', 'tracer')}")
    return "\n".join(lines) + "\n"


def _same(a, b, where):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-6, rtol=1e-5), where
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            _same(a[k], b[k], f"{where}[{k!r}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
    rng = random.Random(1234)
    src = "import torch, nnloom\n\n" + "\n".join(_gen_program(k, rng) for k in range(30))
    path = tmp_path_factory.mktemp("progs") / "generated_programs.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("generated_programs", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("k", range(30))
def test_generated_programs_request_equals_local(model, programs, k):
    g = torch.Generator().manual_seed(k)
    xs = [torch.randn(2, 8, generator=g) for _ in range(4)]
    prog = getattr(programs, f"prog_{k}")
    local = prog(model, xs, None)
    remote = prog(model, xs, "requests")
    _same(local, remote, f"prog_{k}")


def test_request_sees_its_own_copy(model):
    xs = [torch.randn(2, 8) for _ in range(2)]
    with torch.no_grad(), model.trace(backend="requests") as tracer:
        seen = nnloom.save([None, None])
        for i, x in enumerate(xs):
            with tracer.invoke(x):
                seen[i] = sum(v is not None for v in seen)  # others' writes invisible
    assert seen == [0, 0]
    assert len(tracer.requests) == 2


def test_request_error_reaches_caller(model):
    xs = [torch.randn(2, 8) for _ in range(2)]
    with pytest.raises(ZeroDivisionError) as ei:
        with torch.no_grad(), model.trace(backend="requests") as tracer:
            out = nnloom.save([None, None])
            for i, x in enumerate(xs):
                with tracer.invoke(x):
                    out[i] = model.layers[0].output
                    if i == 1:
                        1 / 0  # REQUEST 1 FAILS
    assert "out" not in locals()  # nothing reported as complete
    assert ei.traceback[-1].statement.lines[-1].strip().endswith("# REQUEST 1 FAILS")


def test_request_mode_needs_invokes(model):
    with pytest.raises(ValueError, match="invoke"):
        with model.trace(torch.randn(2, 8), backend="requests"):
            model.layers[0].output.save()


def test_unknown_backend(model):
    with pytest.raises(ValueError, match="unknown backend"):
        model.trace(backend="remote")


# ---- worker processes ----------------------------------------------------------


@pytest.fixture(scope="module")
def workers():
    be = nnloom.Requests(processes=2, timeout=120)
    yield be
    be.close()


@pytest.mark.parametrize("k", [0, 3, 7, 11, 19])
def test_worker_processes_equal_local(model, programs, workers, k):
    g = torch.Generator().manual_seed(k)
    xs = [torch.randn(2, 8, generator=g) for _ in range(4)]
    prog = getattr(programs, f"prog_{k}")
    local = prog(model, xs, None)
    remote = prog(model, xs, workers)
    _same(local, remote, f"prog_{k} in worker processes")


def test_worker_error_reaches_caller(model, workers):
    xs = [torch.randn(2, 8) for _ in range(3)]
    with pytest.raises(KeyError) as ei:
        with torch.no_grad(), model.trace(backend=workers) as tracer:
            out = nnloom.save([None] * 3)
            for i, x in enumerate(xs):
                with tracer.invoke(x):
                    out[i] = model.layers[1].output
                    if i == 2:
                        {}["missing in a worker"]
    assert "out" not in locals()
    cause = ei.value.__cause__
    assert isinstance(cause, nnloom._workers.WorkerError)
    assert "missing in a worker" in str(cause) and "Traceback" in str(cause)


def test_worker_killed_is_a_clear_error(model):
    be = nnloom.Requests(processes=1, timeout=60)
    try:
        x = torch.randn(2, 8)
        with torch.no_grad(), model.trace(backend=be) as tracer:
            with tracer.invoke(x):
                a = model.layers[0].output.save()
        proc = be._pool.workers[0][0]
        proc.kill()
        proc.join(timeout=10)
        with pytest.raises(RuntimeError, match="died|broken|reset"):
            with torch.no_grad(), model.trace(backend=be) as tracer:
                with tracer.invoke(x):
                    b = model.layers[0].output.save()
    finally:
        be.close()


def test_unpicklable_name_is_a_clear_error(model, workers):
    import threading

    lock = threading.Lock()
    with pytest.raises(TypeError, match="cannot send lock"):
        with torch.no_grad(), model.trace(backend=workers) as tracer:
            with tracer.invoke(torch.randn(2, 8)):
                with lock:
                    model.layers[0].output.save()
