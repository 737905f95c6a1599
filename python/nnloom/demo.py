"""``python -m nnloom.demo``: an activation-patching experiment on a built-in model.

A random-weight GPT-2 (built from a config, nothing downloaded) reads two
prompts, a "clean" and a "corrupted" one. For every layer, the clean run's
hidden state at the last token is patched into the corrupted run, and the
table shows how far that moves the corrupted prediction back towards the clean
one (logit difference between the clean and the corrupted top tokens). Each
patched result is checked against the same patch written by hand with torch
forward hooks, and the whole experiment is run once more as a single trace
whose invokes share one left-padded batched forward.
"""

from __future__ import annotations

import time

import torch

import nnloom
from nnloom.models import tiny_lm

CLEAN = "The Eiffel Tower is in Paris"
CORRUPT = "The Colosseum is in Rome"


def _hand_patch(model, ids, layer, vec):
    """The same patch with a raw torch forward hook (the reference)."""

    def hook(mod, args, out):
        h = out[0].clone()
        h[:, -1] = vec
        return (h,) + tuple(out[1:])

    handle = model.transformer.h[layer].register_forward_hook(hook)
    try:
        return model(ids).logits[0, -1]
    finally:
        handle.remove()


@torch.no_grad()
def main() -> int:
    torch.manual_seed(0)
    hf, tok = tiny_lm(n_layer=6, n_embd=128, n_head=4, seed=0)
    model = nnloom.NNsight(hf)
    clean = torch.tensor([tok(CLEAN)["input_ids"]])
    corrupt = torch.tensor([tok(CORRUPT)["input_ids"]])
    n_layer = hf.config.n_layer
    t0 = time.perf_counter()

    with torch.no_grad():
        # 1. the clean run: every layer's last-token hidden state, and the prediction
        with model.trace(clean):
            hidden = nnloom.save([model.transformer.h[i].output[0][:, -1].clone()
                                  for i in range(n_layer)])
            clean_logits = model.lm_head.output[0, -1].save()
        with model.trace(corrupt):
            corrupt_logits = model.lm_head.output[0, -1].save()
        a = int(clean_logits.argmax())
        b = int(corrupt_logits.argmax())
        if a == b:  # random weights: make the two answers differ
            b = int(corrupt_logits.topk(2).indices[1])
        base = float(corrupt_logits[a] - corrupt_logits[b])
        target = float(clean_logits[a] - clean_logits[b])

        # 2. patch each layer of the corrupted run with the clean state
        rows = []
        for layer in range(n_layer):
            with model.trace(corrupt):
                model.transformer.h[layer].output[0][:, -1] = hidden[layer]
                logits = model.lm_head.output[0, -1].save()
            diff = float(logits[a] - logits[b])
            ref = _hand_patch(hf, corrupt, layer, hidden[layer])
            err = float((logits - ref).abs().max())
            span = target - base
            rows.append((layer, diff, (diff - base) / span if span else float("nan"), err))
    elapsed = time.perf_counter() - t0

    # 3. the same experiment as ONE batched forward: a clean invoke and one
    #    corrupted invoke per layer; invokes are served in order at every
    #    module, so the clean state is in `clean` when invoke L patches it in
    lm = nnloom.LanguageModel(model.unwrap(), tokenizer=tok)
    t1 = time.perf_counter()
    with torch.no_grad(), lm.trace() as tracer:
        clean = {}
        batched = nnloom.save([None] * n_layer)
        with tracer.invoke(CLEAN):
            for i in range(n_layer):
                clean[i] = lm.transformer.h[i].output[0][:, -1].clone()
        for layer in range(n_layer):
            with tracer.invoke(CORRUPT):
                h = lm.transformer.h[layer].output[0]  # parks until layer `layer` runs
                h[:, -1] = clean[layer]
                batched[layer] = lm.lm_head.output[0, -1]
    elapsed_batched = time.perf_counter() - t1
    lm.unwrap()

    print(f"nnloom {nnloom.__version__} activation patching demo")
    print(f"model: random GPT-2, {n_layer} layers, d_model {hf.config.n_embd}, "
          f"char tokenizer ({len(tok)} tokens)")
    print(f"clean   : {CLEAN!r} -> top token {tok.decode([a])!r}")
    print(f"corrupt : {CORRUPT!r} -> top token {tok.decode([b])!r}")
    print(f"logit diff (clean top - corrupt top): clean run {target:+.4f}, "
          f"corrupted run {base:+.4f}\n")
    print(f"{'layer':>5}  {'patched diff':>12}  {'recovered':>9}  {'|nnloom - torch hooks|':>22}"
          f"  {'|one batched trace - alone|':>27}")
    print("-" * 84)
    worst_batched = 0.0
    for layer, diff, rec, err in rows:
        ref = _hand_patch(hf, corrupt, layer, hidden[layer])
        berr = float((batched[layer] - ref).abs().max())
        worst_batched = max(worst_batched, berr)
        print(f"{layer:>5}  {diff:>+12.4f}  {rec:>8.1%}  {err:>22.2e}  {berr:>27.2e}")
    worst = max(r[3] for r in rows)
    print("-" * 84)
    print(f"{2 + n_layer} separate traces: {elapsed * 1e3:.1f} ms; one trace of {1 + n_layer} "
          f"invokes (left-padded batch): {elapsed_batched * 1e3:.1f} ms")
    ok = worst == 0 and worst_batched < 1e-4
    print(f"patched runs match hand-written torch hooks: {'yes' if worst == 0 else 'NO'}; "
          f"batched invokes match their prompts run alone: "
          f"{'yes' if worst_batched < 1e-4 else 'NO'} (max {worst_batched:.1e})")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
