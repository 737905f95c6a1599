"""The benchmark scenarios.

Every scenario builds its models once, gives each system its own copy with the
same weights (nnloom and nnsight both wrap ``forward``, so they must never wrap
the same module object), states its reference and tolerance, and returns a
``ScenarioResult`` with the measured rows and the derived metrics next to the
DESIGN.md targets.

Systems, in every scenario where they apply:

- ``bare``      the plain forward, no interception;
- ``raw hooks`` ``register_forward_hook`` closures doing the same reads, saves and
                edits; registering and removing them is part of each timed call,
                as it is part of each trace;
- ``nnsight``   nnsight 0.8 (``nnsight.NNsight`` / ``nnsight.LanguageModel``);
- ``nnloom``    this project.

Both tracing libraries are called through their function form of save
(``nnloom.save(x)`` / ``nnsight.save(x)``): each library mounts ``.save`` on
``object`` and in one process only one of them can own that method.

All scenarios run under ``torch.no_grad()`` (set by ``run.py``).
"""

from __future__ import annotations

import copy
import io
import pickle
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .harness import (FAILED, NOT_IMPLEMENTED, OK, SKIPPED, Case, Config, CorrectnessError,
                      Metric, ScenarioResult, System, allclose, check_case, ratio,
                      run_case, time_case, time_cases)

# Model sizes. The MLP is small on purpose: its forward is cheap, so fixed and
# per-intervention costs are what the numbers show.
MLP_DEPTH = 12
MLP_WIDTH = 128
MLP_BATCH = 8
# The GPT-2 is sized so that one forward takes a few ms on one CPU thread.
LM_LAYERS = 12
LM_EMBD = 128
LM_HEADS = 4
LM_BATCH, LM_SEQ = 2, 16
GEN_PROMPT = 16
GEN_NEW_TOKENS = 20
N_INVOKES = 256
PATCH_LAYER = 6
ONE_SAVE_LAYER = 6


# ---------------------------------------------------------------------------
# Optional systems
# ---------------------------------------------------------------------------


def _nnsight():
    try:
        import nnsight
        return nnsight
    except ImportError:
        return None


def _nnsight_missing() -> System:
    return System.unavailable("nnsight", SKIPPED,
                              "nnsight is not installed (scripts/env.sh bench installs it)")


def _transformer_lens_row() -> System:
    try:
        import transformer_lens  # noqa: F401
    except ImportError:
        return System.unavailable("TransformerLens", SKIPPED, "not installed")
    return System.unavailable("TransformerLens", SKIPPED,
                              "installed, but not wired into this scenario")


def _nnsight_tensor_batched(module: torch.nn.Module):
    """``nnsight.NNsight`` that batches invokes along dim 0.

    nnsight's plain ``NNsight`` refuses more than one invoke with input; its
    documented extension points for a model that batches are ``_batch_size``
    and ``_batch``, which is what an nnsight user overrides.
    """
    nnsight = _nnsight()

    class TensorBatchedNNsight(nnsight.NNsight):
        def _batch_size(self, *inputs, **kwargs):
            return int(inputs[0].shape[0]) if inputs else 0

        def _batch(self, invokes, fn):
            if len(invokes) == 1:
                return invokes[0]
            return (torch.cat([args[0] for args, _ in invokes], 0),), {}

    return TensorBatchedNNsight(module)


# ---------------------------------------------------------------------------
# Models and references
# ---------------------------------------------------------------------------


def _mlp(cfg: Config):
    from nnloom.models import mlp
    return mlp(MLP_DEPTH, MLP_WIDTH).to(cfg.device)


def _mlp_input(cfg: Config, rows: int = MLP_BATCH, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, MLP_WIDTH, generator=g).to(cfg.device)


def mlp_reference(model, x, patch: dict[int, torch.Tensor] | None = None):
    """The MLP evaluated layer by layer by hand: (each Linear's output, final output).
    ``patch[i]`` replaces Linear i's output."""
    outs, h = [], x
    for i, layer in enumerate(model.layers):
        y = layer(h)
        if patch and i in patch:
            y = patch[i]
        outs.append(y)
        h = model.act(y)
    return outs, h


def _lm(cfg: Config):
    from nnloom.models import tiny_lm
    model, tok = tiny_lm(n_layer=LM_LAYERS, n_embd=LM_EMBD, n_head=LM_HEADS)
    return model.to(cfg.device), tok


def _lm_input(cfg: Config, tok, batch: int, seq: int, seed: int = 2) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, len(tok), (batch, seq), generator=g).to(cfg.device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def _hooked(modules: list, fn: Callable[[], Any], make_hook: Callable[[int], Callable]):
    """Run ``fn`` with ``make_hook(i)`` registered as a forward hook on
    ``modules[i]``; the hooks are removed afterwards."""
    handles = [m.register_forward_hook(make_hook(i)) for i, m in enumerate(modules)]
    try:
        return fn()
    finally:
        for h in handles:
            h.remove()


# ---------------------------------------------------------------------------
# 1. empty trace
# ---------------------------------------------------------------------------


def empty_trace(cfg: Config) -> ScenarioResult:
    res = ScenarioResult(
        "empty_trace", "empty trace on a 12-layer MLP (fixed cost)",
        reference="bare forward output; each trace must run the forward exactly once "
                  "(counted by a forward hook) and leave the model unchanged",
        tolerance="allclose rtol=1e-5 atol=1e-6 (CPU)")
    import nnloom
    nnsight = _nnsight()
    model = _mlp(cfg)
    x = _mlp_input(cfg)
    rtol, atol = cfg.tol(1e-5, 1e-6)

    lo = nnloom.NNsight(copy.deepcopy(model))

    def run_nnloom():
        with lo.trace(x):
            pass

    systems = [System("bare", lambda: model(x))]
    wrapped = {"nnloom": lo}
    if nnsight is not None:
        ns = nnsight.NNsight(copy.deepcopy(model))

        def run_nnsight():
            with ns.trace(x):
                pass

        wrapped["nnsight"] = ns
        runs = {"nnsight": run_nnsight, "nnloom": run_nnloom}
    else:
        systems.append(_nnsight_missing())
        runs = {"nnloom": run_nnloom}

    # An empty trace returns nothing; what it must do is run the forward once
    # and leave the module computing what it did before.
    def checked(name, run):
        module = wrapped[name]._module

        def check():
            calls = []
            h = module.register_forward_hook(lambda m, i, o: calls.append(o))
            try:
                run()
            finally:
                h.remove()
            if len(calls) != 1:
                raise CorrectnessError(f"the empty trace ran the forward {len(calls)} times")
            return calls[0]
        return check

    for name, run in runs.items():
        systems.append(System(name, run))
    checks = [System(s.name, checked(s.name, s.run)) if s.name in runs else s for s in systems]
    _check_then_time(Case("empty trace", checks, model(x), allclose(rtol, atol)), systems,
                     cfg, res)

    bare = res.median("empty trace", "bare")
    t_lo = res.median("empty trace", "nnloom")
    t_ns = res.median("empty trace", "nnsight")
    fixed_lo = None if t_lo is None or bare is None else t_lo - bare
    fixed_ns = None if t_ns is None or bare is None else t_ns - bare
    res.metrics += [
        Metric("nnloom fixed cost (trace - bare)", None if fixed_lo is None else fixed_lo * 1e6,
               "us", 30.0, "<= 30 us"),
        Metric("nnsight fixed cost (trace - bare)", None if fixed_ns is None else fixed_ns * 1e6,
               "us"),
        ratio("nnloom/nnsight fixed cost", fixed_lo, fixed_ns, target=0.1, target_text="<= 1/10"),
        ratio("nnloom/bare", t_lo, bare),
        ratio("nnsight/bare", t_ns, bare),
    ]
    return res


def _check_then_time(case: Case, timed: list[System], cfg: Config, res: ScenarioResult):
    """Check ``case`` (whose systems carry extra checks), then time ``timed``
    (the same systems, by name, without the checks)."""
    rows = check_case(case, res)
    time_case(case.name, timed, rows, cfg, res)


# ---------------------------------------------------------------------------
# 2. read + save: 1 and 12
# ---------------------------------------------------------------------------


def saves(cfg: Config) -> ScenarioResult:
    res = ScenarioResult(
        "saves", "read + save of Linear outputs on a 12-layer MLP: 1 save vs 12 saves",
        reference="the MLP evaluated layer by layer by hand (mlp_reference)",
        tolerance="allclose rtol=1e-5 atol=1e-6 (CPU)")
    import nnloom
    nnsight = _nnsight()
    model = _mlp(cfg)
    x = _mlp_input(cfg)
    outs, _ = mlp_reference(model, x)
    compare = allclose(*cfg.tol(1e-5, 1e-6))
    lo = nnloom.NNsight(copy.deepcopy(model))
    ns = nnsight.NNsight(copy.deepcopy(model)) if nnsight is not None else None
    L = ONE_SAVE_LAYER

    # -- one save
    def raw_one():
        saved = {}
        _hooked([model.layers[L]], lambda: model(x),
                lambda i: lambda m, inp, out: saved.__setitem__(i, out))
        return saved[0]

    def nnloom_one():
        with lo.trace(x):
            h = nnloom.save(lo.layers[L].output)
        return h

    def nnsight_one():
        with ns.trace(x):
            h = nnsight.save(ns.layers[L].output)
        return h

    # -- twelve saves
    def raw_twelve():
        saved = [None] * MLP_DEPTH

        def make(i):
            def hook(m, inp, out):
                saved[i] = out
            return hook
        _hooked(list(model.layers), lambda: model(x), make)
        return saved

    def nnloom_twelve():
        with lo.trace(x):
            hs = nnloom.save([])
            for layer in lo.layers:
                hs.append(layer.output)
        return hs

    def nnsight_twelve():
        with ns.trace(x):
            hs = nnsight.save([])
            for layer in ns.layers:
                hs.append(layer.output)
        return hs

    def systems(raw, nsf, lof):
        return [System("raw hooks", raw),
                System("nnsight", nsf) if ns is not None else _nnsight_missing(),
                System("nnloom", lof)]

    bare = System("bare", _bare(lambda: model(x)))
    c1 = Case("1 save", [bare] + systems(raw_one, nnsight_one, nnloom_one), outs[L],
              _skip_bare(compare))
    c12 = Case("12 saves", [bare] + systems(raw_twelve, nnsight_twelve, nnloom_twelve), outs,
               _skip_bare(compare))
    # timed together: the per-intervention cost is their difference
    time_cases([(c.name, c.systems, check_case(c, res)) for c in (c1, c12)], cfg, res)

    def per(system, stat=res.median):
        a, b = stat("1 save", system), stat("12 saves", system)
        return None if a is None or b is None else (b - a) / (MLP_DEPTH - 1)

    p_raw, p_ns, p_lo = per("raw hooks"), per("nnsight"), per("nnloom")
    f_raw, f_lo = per("raw hooks", res.fastest), per("nnloom", res.fastest)
    res.metrics += [
        Metric("per intervention: raw hooks", _us(p_raw), "us"),
        Metric("per intervention: nnsight", _us(p_ns), "us"),
        Metric("per intervention: nnloom", _us(p_lo), "us"),
        ratio("per intervention nnloom/raw hooks", p_lo, p_raw, target=1.5,
              target_text="<= 1.5x"),
        ratio("per intervention nnloom/nnsight", p_lo, p_ns, target=0.1, target_text="<= 1/10"),
        ratio("per intervention nnloom/raw hooks, from minima", f_lo, f_raw),
        ratio("1 save nnloom/raw hooks", res.median("1 save", "nnloom"),
              res.median("1 save", "raw hooks")),
        ratio("12 saves nnloom/raw hooks", res.median("12 saves", "nnloom"),
              res.median("12 saves", "raw hooks")),
        ratio("12 saves nnloom/nnsight", res.median("12 saves", "nnloom"),
              res.median("12 saves", "nnsight")),
    ]
    res.notes.append("per intervention = (median 12 saves - median 1 save) / 11, per system")
    return res


def _us(v: float | None) -> float | None:
    return None if v is None else v * 1e6


def _skip_bare(compare):
    """The bare forward returns the model output, not the saved values: it is
    a timing anchor only, checked in other scenarios."""
    def cmp(got, ref):
        if isinstance(got, _BareOutput):
            return
        compare(got, ref)
    return cmp


class _BareOutput:
    """Marks a bare forward's return value (not compared with saved values)."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def _bare(fn: Callable[[], Any]) -> Callable[[], Any]:
    return lambda: _BareOutput(fn())


# ---------------------------------------------------------------------------
# 3. activation patch
# ---------------------------------------------------------------------------


def patch_case(cfg: Config) -> Case:
    """The systems of scenario 3 and their reference (also used by the smoke test)."""
    import nnloom
    nnsight = _nnsight()
    model = _mlp(cfg)
    x = _mlp_input(cfg)
    value = _mlp_input(cfg, seed=3)
    _, ref = mlp_reference(model, x, patch={PATCH_LAYER: value})
    compare = allclose(*cfg.tol(1e-5, 1e-6))
    lo = nnloom.NNsight(copy.deepcopy(model))
    ns = nnsight.NNsight(copy.deepcopy(model)) if nnsight is not None else None
    L = PATCH_LAYER

    def raw():
        return _hooked([model.layers[L]], lambda: model(x), lambda i: lambda m, inp, out: value)

    def run_nnloom():
        with lo.trace(x):
            lo.layers[L].output = value
            out = nnloom.save(lo.output)
        return out

    def run_nnsight():
        with ns.trace(x):
            ns.layers[L].output = value
            out = nnsight.save(ns.output)
        return out

    systems = [System("bare", _bare(lambda: model(x))), System("raw hooks", raw),
               System("nnsight", run_nnsight) if ns is not None else _nnsight_missing(),
               System("nnloom", run_nnloom)]
    return Case("1 patch", systems, ref, _skip_bare(compare))


def patch(cfg: Config) -> ScenarioResult:
    res = ScenarioResult(
        "patch", f"one activation patch: Linear {PATCH_LAYER}'s output replaced, "
                 "final output saved (12-layer MLP)",
        reference="the MLP evaluated by hand with the patched value (mlp_reference)",
        tolerance="allclose rtol=1e-5 atol=1e-6 (CPU)")
    run_case(patch_case(cfg), cfg, res)
    m = lambda s: res.median("1 patch", s)  # noqa: E731
    res.metrics += [
        ratio("nnloom/raw hooks", m("nnloom"), m("raw hooks")),
        ratio("nnloom/nnsight", m("nnloom"), m("nnsight")),
        ratio("nnloom/bare", m("nnloom"), m("bare")),
        ratio("nnsight/raw hooks", m("nnsight"), m("raw hooks")),
    ]
    return res


# ---------------------------------------------------------------------------
# 4. untouched modules
# ---------------------------------------------------------------------------


def untouched(cfg: Config) -> ScenarioResult:
    res = ScenarioResult(
        "untouched", f"untouched modules: one save at the last block of a {LM_LAYERS}-layer "
                     f"random GPT-2 (batch {LM_BATCH} x {LM_SEQ} tokens)",
        reference="a forward hook on transformer.h[-1] capturing output[0] (plain PyTorch)",
        tolerance="allclose rtol=1e-5 atol=1e-5 (CPU)")
    import nnloom
    nnsight = _nnsight()
    model, tok = _lm(cfg)
    inp = _lm_input(cfg, tok, LM_BATCH, LM_SEQ)
    compare = allclose(*cfg.tol(1e-5, 1e-5))
    last = LM_LAYERS - 1

    def raw():
        saved = []
        _hooked([model.transformer.h[last]], lambda: model(**inp),
                lambda i: lambda m, a, out: saved.append(out[0]))
        return saved[0]

    ref = raw()

    systems = [System("bare", _bare(lambda: model(**inp))), System("raw hooks", raw)]
    if nnsight is not None:
        ns = nnsight.LanguageModel(copy.deepcopy(model), tokenizer=tok)

        def run_nnsight():
            with ns.trace(dict(inp)):
                h = nnsight.save(ns.transformer.h[last].output[0])
            return h
        systems.append(System("nnsight", run_nnsight,
                              note="nnsight.LanguageModel(model, tokenizer=tok), token ids"))
    else:
        systems.append(_nnsight_missing())

    lo = nnloom.NNsight(copy.deepcopy(model))

    def run_nnloom():
        with lo.trace(**inp):
            h = nnloom.save(lo.transformer.h[last].output[0])
        return h
    systems.append(System("nnloom", run_nnloom, note="nnloom.NNsight(model), same token ids"))
    systems.append(_transformer_lens_row())

    run_case(Case("1 late save", systems, ref, _skip_bare(compare)), cfg, res)
    m = lambda s: res.median("1 late save", s)  # noqa: E731
    res.metrics += [
        ratio("nnloom/bare", m("nnloom"), m("bare"), target=1.03, target_text="<= 1.03x"),
        ratio("nnloom/bare, from minima", res.fastest("1 late save", "nnloom"),
              res.fastest("1 late save", "bare")),
        ratio("raw hooks/bare", m("raw hooks"), m("bare")),
        ratio("nnsight/bare", m("nnsight"), m("bare")),
        ratio("nnloom/nnsight", m("nnloom"), m("nnsight")),
    ]
    return res


# ---------------------------------------------------------------------------
# 5. many invokes
# ---------------------------------------------------------------------------


def invokes(cfg: Config) -> ScenarioResult:
    n = N_INVOKES
    res = ScenarioResult(
        "invokes", f"{n} invokes of one row each, one row-save each (Linear {MLP_DEPTH - 1} "
                   "output), batched into one forward (12-layer MLP)",
        reference="the MLP evaluated by hand on the whole batch (mlp_reference), row by row",
        tolerance="allclose rtol=1e-5 atol=1e-5 (CPU)")
    import nnloom
    nnsight = _nnsight()
    model = _mlp(cfg)
    x = _mlp_input(cfg, rows=n, seed=4)
    rows_in = [x[i:i + 1] for i in range(n)]  # what each invoke gets
    outs, _ = mlp_reference(model, x)
    ref = [outs[-1][i:i + 1] for i in range(n)]
    compare = allclose(*cfg.tol(1e-5, 1e-5))
    last = MLP_DEPTH - 1

    def bare():
        return model(torch.cat(rows_in, 0))

    def raw():
        saved = []

        def hook(m, inp, out):
            for i in range(n):
                saved.append(out[i:i + 1])
        _hooked([model.layers[last]], lambda: model(torch.cat(rows_in, 0)), lambda i: hook)
        return saved

    lo = nnloom.NNsight(copy.deepcopy(model), batcher=nnloom.TensorBatcher())

    def run_nnloom():
        with lo.trace() as tracer:
            rows = nnloom.save([None] * n)
            for i in range(n):
                with tracer.invoke(rows_in[i]):
                    rows[i] = lo.layers[last].output
        return rows

    systems = [System("bare", _bare(bare), note="torch.cat of the rows + one forward"),
               System("raw hooks", raw, note="torch.cat + one forward + a hook keeping "
                                             f"{n} row views")]
    if nnsight is not None:
        ns = _nnsight_tensor_batched(copy.deepcopy(model))

        def run_nnsight():
            with ns.trace() as tracer:
                rows = nnsight.save([None] * n)
                for i in range(n):
                    with tracer.invoke(rows_in[i]):
                        rows[i] = ns.layers[last].output
            return rows
        systems.append(System("nnsight", run_nnsight,
                              note="NNsight subclass with _batch_size/_batch on dim 0"))
    else:
        systems.append(_nnsight_missing())
    systems.append(System("nnloom", run_nnloom, note="NNsight(model, batcher=TensorBatcher())"))

    case = f"{n} invokes"
    run_case(Case(case, systems, ref, _skip_bare(compare)), cfg, res)
    m = lambda s: res.median(case, s)  # noqa: E731
    res.metrics += [
        ratio("nnloom/raw hooks (bare batched + hooks)", m("nnloom"), m("raw hooks"),
              target=1.2, target_text="<= 1.2x"),
        ratio("nnloom/nnsight", m("nnloom"), m("nnsight")),
        ratio("nnloom/bare", m("nnloom"), m("bare")),
        ratio("nnsight/raw hooks", m("nnsight"), m("raw hooks")),
    ]
    for s in ("nnsight", "nnloom"):
        v = m(s)
        res.metrics.append(Metric(f"{s} per invoke", None if v is None else v / n * 1e6, "us"))
    return res


# ---------------------------------------------------------------------------
# 6. generation
# ---------------------------------------------------------------------------


def generate(cfg: Config) -> ScenarioResult:
    steps = GEN_NEW_TOKENS
    res = ScenarioResult(
        "generate", f"generation: {steps} new tokens (greedy, min_new_tokens={steps}), one save "
                    f"per layer per step ({LM_LAYERS}-layer random GPT-2, prompt {GEN_PROMPT})",
        reference="HF generate with forward hooks on every block capturing output[0] "
                  "(plain PyTorch), and its generated ids",
        tolerance="allclose rtol=1e-5 atol=1e-5 (CPU); ids equal")
    import nnloom
    nnsight = _nnsight()
    model, tok = _lm(cfg)
    inp = _lm_input(cfg, tok, 1, GEN_PROMPT, seed=5)
    gen_kw = dict(max_new_tokens=steps, min_new_tokens=steps, do_sample=False, pad_token_id=0)
    close = allclose(*cfg.tol(1e-5, 1e-5))
    blocks = list(model.transformer.h)

    def compare(got, ref):
        saves_g, ids_g = got
        saves_r, ids_r = ref
        if not torch.equal(ids_g.cpu(), ids_r.cpu()):
            raise CorrectnessError(f"generated ids differ: {ids_g.tolist()} vs {ids_r.tolist()}")
        close(saves_g, saves_r)

    def bare():
        return model.generate(**inp, **gen_kw)

    def raw():
        saved = []
        ids = _hooked(blocks, lambda: model.generate(**inp, **gen_kw),
                      lambda i: lambda m, a, out: saved.append(out[0]))
        return saved, ids

    ref = raw()
    systems = [System("bare", _bare(bare)), System("raw hooks", raw)]

    if nnsight is not None:
        ns = nnsight.LanguageModel(copy.deepcopy(model), tokenizer=tok)

        def run_nnsight():
            with ns.generate(dict(inp), **gen_kw) as tracer:
                saved = nnsight.save([])
                for step in tracer.iter[0:steps]:
                    for block in ns.transformer.h:
                        saved.append(block.output[0])
                ids = nnsight.save(tracer.result)
            return saved, ids
        systems.append(System("nnsight", run_nnsight,
                              note="LanguageModel.generate + tracer.iter[0:N]"))
    else:
        systems.append(_nnsight_missing())
    systems.append(_nnloom_generate(nnloom, model, tok, inp, gen_kw, steps))
    systems.append(_transformer_lens_row())

    def cmp(got, r):
        if isinstance(got, _BareOutput):
            return
        compare(got, r)

    run_case(Case(f"{steps} tokens", systems, ref, cmp), cfg, res)
    m = lambda s: res.median(f"{steps} tokens", s)  # noqa: E731
    res.metrics += [
        ratio("nnloom/raw hooks", m("nnloom"), m("raw hooks"),
              target=1.1 if cfg.cuda else None, target_text="<= 1.1x (GPU target)",
              why_missing=_why(res, f"{steps} tokens", "nnloom")),
        ratio("nnloom/nnsight", m("nnloom"), m("nnsight"),
              why_missing=_why(res, f"{steps} tokens", "nnloom")),
        ratio("nnsight/raw hooks", m("nnsight"), m("raw hooks")),
        ratio("raw hooks/bare", m("raw hooks"), m("bare")),
    ]
    return res


def _why(res: ScenarioResult, case: str, system: str) -> str:
    r = res.row(case, system)
    if r is None or r.status == OK:
        return ""
    return f"{system}: {r.status}" + (f" ({r.note})" if r.note else "")


def _nnloom_generate(nnloom, model, tok, inp, gen_kw, steps) -> System:
    """nnloom's generate row, if the feature exists (checked, not assumed)."""
    lm_cls = getattr(nnloom, "LanguageModel", None)
    if lm_cls is None:
        return System.unavailable("nnloom", NOT_IMPLEMENTED, "nnloom.LanguageModel does not exist")
    # A class attribute: the wrapped HF module's own .generate would otherwise
    # answer through attribute fall-through.
    if not callable(getattr(lm_cls, "generate", None)):
        return System.unavailable("nnloom", NOT_IMPLEMENTED,
                                  "nnloom.LanguageModel has no generate()")
    lo = lm_cls(copy.deepcopy(model), tokenizer=tok)

    def run_nnloom():
        with lo.generate(dict(inp), **gen_kw) as tracer:
            saved = nnloom.save([])
            for step in tracer.iter[0:steps]:
                for block in lo.transformer.h:
                    saved.append(block.output[0])
            ids = nnloom.save(tracer.result)
        return saved, ids
    return System("nnloom", run_nnloom, note="LanguageModel.generate + tracer.iter[0:N]")


# ---------------------------------------------------------------------------
# 7. compact payload
# ---------------------------------------------------------------------------


@dataclass
class _Blob:
    kind: str            # "pickle" or "torch"
    parts: list[bytes]   # one per payload

    @property
    def nbytes(self) -> int:
        return sum(len(p) for p in self.parts)

    def load(self) -> list:
        if self.kind == "pickle":
            return [pickle.loads(p) for p in self.parts]
        return [torch.load(io.BytesIO(p), weights_only=True) for p in self.parts]


def payload(cfg: Config) -> ScenarioResult:
    n = N_INVOKES
    res = ScenarioResult(
        "payload", f"compact payload: {n} per-invoke row saves (views of one "
                   f"{n} x {MLP_WIDTH} float32 batch output) dumped to bytes",
        reference="the saved rows themselves; every encoding must load back equal "
                  "(pickle.loads / torch.load)",
        tolerance="exact (torch.equal)")
    model = _mlp(cfg)
    x = _mlp_input(cfg, rows=n, seed=4)
    # the saved values: row views of one batch output, as a batched trace returns them
    views = []
    _hooked([model.layers[-1]], lambda: model(x),
            lambda i: lambda m, a, out: views.extend(out[j:j + 1] for j in range(n)))
    rows_bytes = sum(v.numel() * v.element_size() for v in views)
    assert views[0].untyped_storage().nbytes() == n * MLP_WIDTH * 4  # really views of the batch
    ref = [v.cpu() for v in views]

    def compare(got: _Blob, r):
        loaded = got.load()
        flat = [t for part in loaded for t in (part if isinstance(part, list) else [part])]
        if len(flat) != len(r) or not all(torch.equal(a.cpu(), b) for a, b in zip(flat, r)):
            raise CorrectnessError(f"{got.kind} payload does not load back to the saved rows")

    def torch_save(obj) -> bytes:
        buf = io.BytesIO()
        torch.save(obj, buf)
        return buf.getvalue()

    dumps_compact, why = _dumps_compact()

    def encoders(per_request: bool):
        def each(fn):
            return (lambda: [fn(v) for v in views]) if per_request else (lambda: [fn(views)])
        out = [
            System("pickle.dumps", lambda f=each(pickle.dumps): _Blob("pickle", f())),
            System("torch.save", lambda f=each(torch_save): _Blob("torch", f())),
        ]
        if dumps_compact is None:
            out.append(System.unavailable("nnloom dumps_compact", NOT_IMPLEMENTED, why))
        else:
            out.append(System("nnloom dumps_compact",
                              lambda f=each(dumps_compact): _Blob("pickle", f())))
        return out

    def size(system, blob: _Blob) -> dict:
        return {"bytes": blob.nbytes, "bytes_ratio": blob.nbytes / rows_bytes}

    cases = {f"{n} payloads of 1 row": encoders(True), f"1 payload of {n} rows": encoders(False)}
    for name, systems in cases.items():
        run_case(Case(name, systems, ref, compare), cfg, res, extra=size)
    res.notes.append(f"saved rows' bytes: {rows_bytes} ({n} x {MLP_WIDTH} float32)")
    res.notes.append("per-request: each invoke's row is its own payload (request mode); "
                     "one payload: all rows in one list")
    for name in cases:
        for system in ("pickle.dumps", "torch.save", "nnloom dumps_compact"):
            r = res.row(name, system)
            target = (1.01, "<= 1.01x rows' bytes") if system.startswith("nnloom") else (None, "")
            if r is not None and "bytes_ratio" in r.extra:
                res.metrics.append(Metric(f"{name}: {system} bytes / rows' bytes",
                                          r.extra["bytes_ratio"], "x", *target))
            elif r is not None:
                res.metrics.append(Metric(f"{name}: {system} bytes / rows' bytes", None, "x",
                                          *target, note=f"{r.status}: {r.note}"))
        t_c, t_p = res.median(name, "nnloom dumps_compact"), res.median(name, "pickle.dumps")
        res.metrics.append(ratio(f"{name}: dump time compact/pickle", t_c, t_p,
                                 why_missing=_why(res, name, "nnloom dumps_compact")))
    return res


def _dumps_compact():
    try:
        from nnloom import collect
    except ImportError as e:
        return None, f"nnloom.collect is missing ({type(e).__name__})"
    fn = getattr(collect, "dumps_compact", None)
    if fn is None:
        return None, "nnloom.collect has no dumps_compact"
    return fn, ""


# ---------------------------------------------------------------------------

SCENARIOS: dict[str, Callable[[Config], ScenarioResult]] = {
    "empty_trace": empty_trace,
    "saves": saves,
    "patch": patch,
    "untouched": untouched,
    "invokes": invokes,
    "generate": generate,
    "payload": payload,
}
