"""Many invokes, one forward: each invoke sees and edits only its rows."""

import threading

import pytest
import torch

import nnloom
from nnloom import models
from conftest import check_tensor

PROMPTS = ["The Eiffel Tower is in", "Hi", "The Colosseum is in the city of", "abc",
           "A much longer prompt than the others, with punctuation!", "x", "Paris"]


@pytest.fixture
def batched_mlp(mlp):
    m = nnloom.NNsight(mlp, batcher=nnloom.TensorBatcher())
    yield m
    m.unwrap()


@pytest.fixture(scope="module")
def lm_parts():
    return models.tiny_lm(n_layer=3, n_embd=32, n_head=4, n_positions=96, seed=0)


@pytest.fixture
def lm(lm_parts):
    model, tok = lm_parts
    m = nnloom.LanguageModel(model, tokenizer=tok)
    yield m
    m.unwrap()


def _xs(n, rows=2):
    g = torch.Generator().manual_seed(n)
    return [torch.randn(rows, 16, generator=g) for _ in range(n)]


@pytest.mark.parametrize("n", [1, 2, 7, 64])
def test_mlp_invokes_equal_separate_traces(batched_mlp, n):
    xs = _xs(n)
    # separate traces: read layer 3, scale layer 5 by (i + 1), read the output
    ref = []
    for i, x in enumerate(xs):
        with torch.no_grad(), batched_mlp.trace(x):
            r = batched_mlp.layers[3].output.save()
            batched_mlp.layers[5].output = batched_mlp.layers[5].output * (i + 1)
            o = batched_mlp.output.save()
        ref.append((r, o))
    with torch.no_grad(), batched_mlp.trace() as tracer:
        reads = nnloom.save([None] * n)
        outs = nnloom.save([None] * n)
        for i, x in enumerate(xs):
            with tracer.invoke(x):
                reads[i] = batched_mlp.layers[3].output
                batched_mlp.layers[5].output = batched_mlp.layers[5].output * (i + 1)
                outs[i] = batched_mlp.output
    for i in range(n):
        check_tensor(reads[i], ref[i][0], f"read of invoke {i}", atol=1e-6, rtol=1e-5)
        check_tensor(outs[i], ref[i][1], f"output of invoke {i}", atol=1e-6, rtol=1e-5)


def test_invoke_sees_views_of_its_rows(batched_mlp):
    xs = _xs(3, rows=2)
    with torch.no_grad(), batched_mlp.trace() as tracer:
        info = nnloom.save({})
        for i, x in enumerate(xs):
            with tracer.invoke(x):
                h = batched_mlp.layers[2].output
                info[i] = (tuple(h.shape), h.untyped_storage().data_ptr(), h.storage_offset())
        with tracer.invoke():
            whole = batched_mlp.layers[2].output
            info["all"] = (tuple(whole.shape), whole.untyped_storage().data_ptr(), 0)
    assert info["all"][0] == (6, 16)
    for i in range(3):
        assert info[i][0] == (2, 16)
        assert info[i][1] == info["all"][1]  # a view of the batch, not a copy
        assert info[i][2] == i * 2 * 16


def test_edit_stays_in_its_rows(batched_mlp):
    xs = _xs(3)
    with torch.no_grad():
        plain = [batched_mlp.trace(x, trace=False) for x in xs]
    with torch.no_grad(), batched_mlp.trace() as tracer:
        outs = nnloom.save([None] * 3)
        for i, x in enumerate(xs):
            with tracer.invoke(x):
                if i == 1:
                    batched_mlp.layers[0].output[:] = 0  # in place, invoke 1 only
                outs[i] = batched_mlp.output
    check_tensor(outs[0], plain[0], "invoke 0 untouched", atol=1e-6, rtol=1e-5)
    check_tensor(outs[2], plain[2], "invoke 2 untouched", atol=1e-6, rtol=1e-5)
    assert not torch.allclose(outs[1], plain[1])


def test_empty_invoke_edits_all_rows(batched_mlp):
    xs = _xs(2)
    with torch.no_grad(), batched_mlp.trace() as tracer:
        outs = nnloom.save([None] * 2)
        for i, x in enumerate(xs):
            with tracer.invoke(x):
                outs[i] = batched_mlp.layers[11].output
        with tracer.invoke():
            batched_mlp.layers[11].output[:] = 7.0
    for o in outs:
        assert torch.all(o == 7.0)  # same rows, edited by the empty invoke


def test_out_of_order_names_the_invoke(batched_mlp):
    xs = _xs(2)
    with pytest.raises(nnloom.OutOfOrderError) as ei:
        with torch.no_grad(), batched_mlp.trace() as tracer:
            with tracer.invoke(xs[0]):
                batched_mlp.layers[1].output.save()
            with tracer.invoke(xs[1]):
                batched_mlp.layers[4].output
                batched_mlp.layers[2].output  # OUT OF ORDER
    assert "invoke 1" in str(ei.value)
    assert "'model.layers.2.output.i0'" in str(ei.value)


def test_two_inputs_without_batcher(mlp_model):
    xs = _xs(2)
    with pytest.raises(ValueError, match="no batcher"):
        with mlp_model.trace() as tracer:
            with tracer.invoke(xs[0]):
                pass
            with tracer.invoke(xs[1]):
                pass


def test_invoke_while_running_is_an_error(batched_mlp):
    xs = _xs(1)
    with pytest.raises(ValueError, match="cannot invoke while the model runs"):
        with torch.no_grad(), batched_mlp.trace() as tracer:
            with tracer.invoke(xs[0]):
                batched_mlp.layers[0].output
                with tracer.invoke(xs[0]):
                    pass


def test_shared_names_above_invokes(batched_mlp):
    xs = _xs(3)
    with torch.no_grad(), batched_mlp.trace() as tracer:
        rows = nnloom.save([None] * 3)  # ONE list shared by all invokes
        ids = nnloom.save([])
        for i, x in enumerate(xs):
            with tracer.invoke(x):
                mine = nnloom.save(i)  # bound inside: belongs to this invoke
                rows[i] = batched_mlp.layers[0].output.shape[0]
                ids.append(id(rows))
    assert rows == [2, 2, 2]
    assert len(set(ids)) == 1
    assert mine == 2  # the last invoke's binding reaches the caller


def test_skip_module(batched_mlp, mlp):
    x = _xs(1)[0]
    with torch.no_grad(), batched_mlp.trace(x):
        batched_mlp.layers[3].skip(torch.ones(2, 16))
        inp4 = batched_mlp.layers[4].input.save()
    assert torch.equal(inp4, torch.ones(2, 16))  # relu(ones)


def test_skip_inconsistent_across_invokes(batched_mlp):
    xs = _xs(2)
    with pytest.raises(ValueError, match="skipped by 1 of 2 invokes"):
        with torch.no_grad(), batched_mlp.trace() as tracer:
            with tracer.invoke(xs[0]):
                batched_mlp.layers[3].skip(torch.ones(2, 16))
            with tracer.invoke(xs[1]):
                batched_mlp.layers[3].output.save()


def test_256_invokes_row_saves(batched_mlp):
    xs = [torch.randn(1, 16, generator=torch.Generator().manual_seed(i)) for i in range(256)]
    th = threading.active_count()
    with torch.no_grad(), batched_mlp.trace() as tracer:
        saved = nnloom.save([None] * 256)
        for i, x in enumerate(xs):
            with tracer.invoke(x):
                saved[i] = batched_mlp.layers[6].output
    assert threading.active_count() == th
    with torch.no_grad():
        full = batched_mlp.trace(torch.cat(xs), trace=False)
    base = {t.untyped_storage().data_ptr() for t in saved}
    assert len(base) == 1, "each invoke's value must be a view of the one batch buffer"
    assert sum(t.numel() for t in saved) == 256 * 16
    storage_bytes = saved[0].untyped_storage().nbytes()
    assert storage_bytes == 256 * 16 * 4  # one batch buffer, no per-invoke copies
    assert saved[5].shape == (1, 16)


# ---- language models -----------------------------------------------------


def _alone(lm_parts, prompt):
    model, tok = lm_parts
    ids = torch.tensor([tok(prompt, add_special_tokens=False)["input_ids"]])
    with torch.no_grad():
        out = model(ids, output_hidden_states=True)
    return out.logits[0, -1], out.hidden_states


def _prompts(n):
    if n <= len(PROMPTS):
        return PROMPTS[:n]
    rng = __import__("random").Random(n)
    letters = "abcdefghijklmnopqrstuvwxyz ,.!"
    return [PROMPTS[i % len(PROMPTS)][: rng.randint(1, 20)] + "".join(
        rng.choice(letters) for _ in range(rng.randint(0, 30))) for i in range(n)]


@pytest.mark.parametrize("n", [1, 2, 7, 64])
def test_lm_invokes_equal_prompts_alone(lm, lm_parts, n):
    prompts = _prompts(n)
    with torch.no_grad(), lm.trace() as tracer:
        last = nnloom.save([None] * n)
        h1 = nnloom.save([None] * n)
        for i, p in enumerate(prompts):
            with tracer.invoke(p):
                h1[i] = lm.transformer.h[1].output[0][:, -1]
                last[i] = lm.lm_head.output[:, -1]
    for i, p in enumerate(prompts):
        ref_logits, ref_hidden = _alone(lm_parts, p)
        check_tensor(last[i][0], ref_logits, f"last-token logits of {p!r}", atol=1e-5, rtol=1e-4)
        check_tensor(h1[i][0], ref_hidden[2][0, -1], f"h.1 of {p!r}", atol=1e-5, rtol=1e-4)


def test_lm_padding_is_left_with_mask_and_positions(lm):
    with torch.no_grad(), lm.trace() as tracer:
        with tracer.invoke("Hi"):
            pass
        with tracer.invoke("Hello there"):
            pass
        with tracer.invoke():
            args, kwargs = lm.inputs
            got = nnloom.save({k: v.clone() for k, v in kwargs.items() if torch.is_tensor(v)})
    ids, mask, pos = got["input_ids"], got["attention_mask"], got["position_ids"]
    assert ids.shape == (2, 11)
    assert mask[0].tolist() == [0] * 9 + [1, 1]
    assert pos[0, -2:].tolist() == [0, 1]
    assert pos[1].tolist() == list(range(11))
    assert ids[0, 0].item() == lm.tokenizer.pad_token_id


def test_lm_cross_invoke_patch_with_barrier(lm, lm_parts):
    model, tok = lm_parts
    a, b = "The Eiffel Tower is in", "The Colosseum is in"
    with torch.no_grad(), lm.trace() as tracer:
        rows = nnloom.save([None] * 3)
        barrier = tracer.barrier(2)
        with tracer.invoke(a):
            clean = lm.transformer.h[1].output[0][:, -1]
            barrier()
            rows[0] = lm.lm_head.output[:, -1].argmax(-1)
        with tracer.invoke(b):
            barrier()
            lm.transformer.h[1].output[0][:, -1] = clean
            rows[1] = lm.lm_head.output[:, -1]
        with tracer.invoke():
            rows[2] = lm.lm_head.output.shape
    # reference: b alone with a's last-token state at h.1 patched in by hand
    _, hid_a = _alone(lm_parts, a)
    clean_ref = hid_a[2][0, -1]

    def hook(mod, args, out):
        h = out[0].clone()
        h[:, -1] = clean_ref
        return (h,) + tuple(out[1:])

    hdl = model.transformer.h[1].register_forward_hook(hook)
    try:
        with torch.no_grad():
            ref = model(torch.tensor([tok(b)["input_ids"]])).logits[0, -1]
    finally:
        hdl.remove()
    check_tensor(rows[1][0], ref, "patched logits", atol=1e-5, rtol=1e-4)
    assert rows[2] == torch.Size([2, len(a), len(tok)])
    assert rows[0].shape == (1,)


def test_barrier_never_completed(batched_mlp):
    xs = _xs(2)
    with pytest.raises(RuntimeError, match="barrier"):
        with torch.no_grad(), batched_mlp.trace() as tracer:
            barrier = tracer.barrier(3)
            for x in xs:
                with tracer.invoke(x):
                    barrier()


def test_lm_single_trace_input(lm, lm_parts):
    with torch.no_grad(), lm.trace("The Eiffel Tower is in"):
        logits = lm.lm_head.output[0, -1].save()
    ref, _ = _alone(lm_parts, "The Eiffel Tower is in")
    check_tensor(logits, ref, "single prompt", atol=1e-5, rtol=1e-4)


def test_lm_needs_tokenizer(lm_parts):
    with pytest.raises(ValueError, match="tokenizer"):
        nnloom.LanguageModel(lm_parts[0])


def test_skip_in_every_invoke_joins_their_rows(batched_mlp):
    xs = _xs(3)
    with torch.no_grad(), batched_mlp.trace() as tracer:
        seen = nnloom.save([None] * 3)
        for i, x in enumerate(xs):
            with tracer.invoke(x):
                batched_mlp.layers[3].skip(torch.full((2, 16), float(i + 1)))
                seen[i] = batched_mlp.layers[4].input
    for i in range(3):
        assert torch.equal(seen[i], torch.full((2, 16), float(i + 1)))  # relu(i + 1)


def test_skip_by_the_empty_invoke_covers_the_batch(batched_mlp):
    xs = _xs(2)
    with torch.no_grad(), batched_mlp.trace() as tracer:
        seen = nnloom.save([None] * 2)
        for i, x in enumerate(xs):
            with tracer.invoke(x):
                seen[i] = batched_mlp.layers[4].input
        with tracer.invoke():
            batched_mlp.layers[3].skip(torch.ones(4, 16))
    assert all(torch.equal(s, torch.ones(2, 16)) for s in seen)


def test_rows_from_one_split_equal_narrowed_rows(batched_mlp):
    """With autograd off, rows of a boundary many invokes wait on come from one
    split; with it on, from one narrow each (their views can be edited in
    place under autograd). Both give the same rows and the same edits."""
    xs = _xs(4)
    results = []
    for grad in (False, True):
        with torch.set_grad_enabled(grad), batched_mlp.trace() as tracer:
            got = nnloom.save([None] * 4)
            for i, x in enumerate(xs):
                with tracer.invoke(x):
                    h = batched_mlp.layers[2].output
                    h[:, 0] = float(i)  # in place, own rows only
                    got[i] = batched_mlp.layers[5].output
        results.append([g.detach() for g in got])
        if grad:
            assert got[0].requires_grad  # still part of the graph
    for a, b in zip(*results):
        check_tensor(a, b, "split vs narrow", atol=1e-6, rtol=1e-5)
