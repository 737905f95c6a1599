"""Generation: each new token is one step; requests pin to steps."""

import pytest
import torch

import nnloom
from nnloom import models
from conftest import check_tensor


@pytest.fixture(scope="module")
def parts():
    return models.tiny_lm(n_layer=2, n_embd=32, n_head=4, n_positions=64, seed=3)


@pytest.fixture
def lm(parts):
    m = nnloom.LanguageModel(parts[0], tokenizer=parts[1])
    yield m
    m.unwrap()


def _hf_generate(parts, prompt, n, hook=None):
    model, tok = parts
    ids = torch.tensor([tok(prompt)["input_ids"]])
    hs, handles = [], []
    handles.append(model.transformer.h[1].register_forward_hook(lambda m, a, o: hs.append(o[0])))
    if hook is not None:
        handles.append(model.transformer.h[0].register_forward_hook(hook))
    try:
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                 min_new_tokens=n, do_sample=False, pad_token_id=0)
    finally:
        for h in handles:
            h.remove()
    return out, hs


def test_every_step_read(lm, parts):
    ref_ids, ref_hs = _hf_generate(parts, "The Eiffel", 5)
    with torch.no_grad(), lm.generate("The Eiffel", max_new_tokens=5, min_new_tokens=5,
                                      do_sample=False) as tracer:
        hs = nnloom.save([])
        for step in tracer.all():
            hs.append(lm.transformer.h[1].output[0])
    assert len(hs) == 5
    for i in range(5):
        check_tensor(hs[i], ref_hs[i], f"step {i}")
    assert torch.equal(tracer.result, ref_ids)


def test_iter_slice(lm, parts):
    _, ref_hs = _hf_generate(parts, "Hello", 4)
    with torch.no_grad(), lm.generate("Hello", max_new_tokens=4, min_new_tokens=4,
                                      do_sample=False) as tracer:
        steps = nnloom.save([])
        got = nnloom.save([])
        for step in tracer.iter[1:3]:
            steps.append(step)
            got.append(lm.transformer.h[1].output[0])
    assert steps == [1, 2]
    check_tensor(got[0], ref_hs[1], "step 1")
    check_tensor(got[1], ref_hs[2], "step 2")


def test_edit_every_step_changes_generation(lm, parts):
    def hook(m, a, o):
        return (o[0] * 0,) + tuple(o[1:])

    ref_ids, _ = _hf_generate(parts, "Hi", 3, hook=hook)
    with torch.no_grad(), lm.generate("Hi", max_new_tokens=3, min_new_tokens=3,
                                      do_sample=False) as tracer:
        for step in tracer.all():
            lm.transformer.h[0].output[0][:] = 0
    assert torch.equal(tracer.result, ref_ids)


def test_steps_past_the_end(lm):
    with pytest.raises(nnloom.OutOfOrderError, match=r"model\.lm_head\.output\.i3"):
        with torch.no_grad(), lm.generate("Hi", max_new_tokens=3, min_new_tokens=3,
                                          do_sample=False) as tracer:
            for step in tracer.iter[0:5]:
                lm.lm_head.output.save()


def test_batched_generate_equals_separate(lm, parts):
    prompts = ["The Eiffel", "Hi"]
    refs = [_hf_generate(parts, p, 3)[0][0, -3:] for p in prompts]
    with torch.no_grad(), lm.generate(max_new_tokens=3, min_new_tokens=3, do_sample=False) as tracer:
        for p in prompts:
            with tracer.invoke(p):
                pass
    for i in range(2):
        assert tracer.result[i, -3:].tolist() == refs[i].tolist()


def test_result_inside_the_body(lm, parts):
    ref_ids, _ = _hf_generate(parts, "The Eiffel", 3)
    with torch.no_grad(), lm.generate("The Eiffel", max_new_tokens=3, min_new_tokens=3,
                                      do_sample=False) as tracer:
        for step in tracer.all():
            lm.transformer.h[1].output[0].sum()
        ids = nnloom.save(tracer.result)  # waits for generate to return
    assert torch.equal(ids, ref_ids)


def test_result_rows_per_invoke(lm, parts):
    refs = [_hf_generate(parts, p, 2)[0][0, -2:] for p in ("Hi", "The Eiffel")]
    with torch.no_grad(), lm.generate(max_new_tokens=2, min_new_tokens=2, do_sample=False) as tracer:
        ids = nnloom.save([None, None])
        for i, p in enumerate(("Hi", "The Eiffel")):
            with tracer.invoke(p):
                ids[i] = tracer.result
    assert ids[0].shape[0] == 1 and ids[1].shape[0] == 1
    for i in range(2):
        assert ids[i][0, -2:].tolist() == refs[i].tolist()
