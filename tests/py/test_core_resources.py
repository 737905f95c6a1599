"""Nothing leaks: refcounts, coroutines, hooks, threads, tracing functions."""

import gc
import sys
import threading
import weakref

import greenlet
import torch

import nnloom
from nnloom import _C
from conftest import check_tensor


def n_greenlets():
    return sum(1 for o in gc.get_objects() if issubclass(type(o), greenlet.greenlet))


def torch_hook_count(module):
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in module.modules())


def test_thousand_traces_leak_nothing(mlp, mlp_model, x16):
    params = list(mlp.parameters())
    for _ in range(20):  # warm up caches (capture memo, type caches)
        with torch.no_grad(), mlp_model.trace(x16):
            h = mlp_model.layers[3].output.save()
            mlp_model.layers[5].output[:] = 0
    gc.collect()
    rc = [sys.getrefcount(p) for p in params]
    g0, hooks0, th0 = n_greenlets(), torch_hook_count(mlp), threading.active_count()
    objs0 = len(gc.get_objects())
    for i in range(1000):
        with torch.no_grad(), mlp_model.trace(x16):
            h = mlp_model.layers[3].output.save()
            mlp_model.layers[5].output[:] = 0
            if i % 100 == 0:
                try:
                    mlp_model.layers[1].output
                except nnloom.OutOfOrderError:
                    pass
    gc.collect()
    assert [sys.getrefcount(p) for p in params] == rc
    assert n_greenlets() == g0
    assert torch_hook_count(mlp) == hooks0
    assert threading.active_count() == th0
    assert len(gc.get_objects()) - objs0 < 50


def test_activations_freed_without_gc(mlp_model, x16):
    refs = []
    gc.collect()
    gc.disable()
    try:
        with torch.no_grad(), mlp_model.trace(x16):
            a = mlp_model.layers[2].output  # not saved
            refs.append(weakref.ref(a))
            kept = mlp_model.layers[4].output.save()
            refs.append(weakref.ref(kept))
        assert refs[0]() is None, "an unsaved activation outlived its trace"
        assert refs[1]() is kept
        del kept
        assert refs[1]() is None
    finally:
        gc.enable()


def test_activations_freed_after_error_without_gc(mlp_model, x16):
    refs = []
    gc.collect()
    gc.disable()
    try:
        try:
            with torch.no_grad(), mlp_model.trace(x16):
                a = mlp_model.layers[2].output
                refs.append(weakref.ref(a))
                raise LookupError("x")
        except LookupError as e:
            del e
        assert refs[0]() is None
    finally:
        gc.enable()


def test_model_freed_without_gc(x16):
    gc.collect()
    gc.disable()
    try:
        net = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU())
        r = weakref.ref(net[0].weight)
        m = nnloom.NNsight(net)
        with torch.no_grad(), m.trace(x16):
            m[0].output.save()
        del m, net
        assert r() is None, "wrapping created a reference cycle"
    finally:
        gc.enable()


def test_previous_trace_function_restored(mlp_model, x16):
    events = []

    def tracer_fn(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "marker_fn":
            events.append("call")
        return None

    def marker_fn():
        return 1

    old = sys.gettrace()
    sys.settrace(tracer_fn)
    try:
        with torch.no_grad(), mlp_model.trace(x16):
            mlp_model.layers[1].output.save()
        assert sys.gettrace() is tracer_fn
        marker_fn()
    finally:
        sys.settrace(old)
    assert events == ["call"]


def test_concurrent_traces_in_threads(mlp, mlp_model):
    results, errors = {}, []
    xs = {i: torch.randn(3, 16, generator=torch.Generator().manual_seed(i)) for i in range(4)}

    def work(i):
        try:
            for _ in range(50):
                with torch.no_grad(), mlp_model.trace(xs[i]):
                    h = mlp_model.layers[6].output.save()
                results[i] = h
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    ts = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    for i, x in xs.items():
        cap = {}
        h = mlp.layers[6].register_forward_hook(lambda m, a, o: cap.update(v=o))
        try:
            with torch.no_grad():
                mlp(x)
        finally:
            h.remove()
        check_tensor(results[i], cap["v"], f"thread {i}")


def test_no_interleaver_left_active(mlp_model, x16):
    with torch.no_grad(), mlp_model.trace(x16):
        inside = nnloom.save(_C.current_invoke())
    assert inside == 0
    assert _C.current_invoke() == -1
    assert _C.scope_depth() == 0
