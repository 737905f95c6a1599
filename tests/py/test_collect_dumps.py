"""dumps_compact: compact tensors anywhere in the object graph, plain pickle.loads."""

import collections
import dataclasses
import pickle
import sys

import pytest
import torch

from nnloom import collect


def check_tensor(got, want):
    assert type(got) is torch.Tensor
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert got.requires_grad == want.requires_grad
    assert got.device.type == "cpu"
    if not torch.equal(got.detach(), want.detach().cpu()):
        diff = (got.detach().double() - want.detach().cpu().double()).abs()
        raise AssertionError(f"tensors differ: max abs {diff.max().item()}")


def roundtrip(value):
    return pickle.loads(collect.dumps_compact(value))


def test_row_of_batch_is_compact_and_plain_pickle_is_not():
    batch = torch.randn(256, 128, 768)
    row = batch[17]
    row_bytes = row.numel() * row.element_size()
    data = collect.dumps_compact(row)
    assert len(data) <= 1.01 * row_bytes + 1024, len(data)
    plain = pickle.dumps(row)
    assert len(plain) >= batch.numel() * batch.element_size()  # the whole storage
    got = pickle.loads(data)
    check_tensor(got, row)
    assert got.stride() == row.stride()
    assert got.untyped_storage().nbytes() == row_bytes


def test_identity_is_preserved():
    t = torch.arange(10.0)[2:5]
    value = {"a": t, "b": [t, (t,)], "c": t}
    got = roundtrip(value)
    assert got["a"] is got["b"][0] is got["b"][1][0] is got["c"]
    check_tensor(got["a"], t)


@dataclasses.dataclass
class Probe:
    name: str
    hidden: torch.Tensor
    extra: dict


Pair = collections.namedtuple("Pair", "left right")


class Custom:
    def __init__(self, t):
        self.t = t
        self.tag = "custom"


def test_nested_containers_and_classes():
    batch = torch.randn(8, 64, 96)
    value = {
        "list": [batch[0], [batch[1], {"deep": batch[2]}]],
        "tuple": (batch[3], 4, "x"),
        "dc": Probe("p", batch[4], {"k": batch[5]}),
        "nt": Pair(batch[6], batch[7, :, 1]),
        "custom": Custom(batch[0, 1]),
        "set": {1, 2, 3},
    }
    got = roundtrip(value)
    check_tensor(got["list"][0], batch[0])
    check_tensor(got["list"][1][1]["deep"], batch[2])
    check_tensor(got["tuple"][0], batch[3])
    assert got["tuple"][1:] == (4, "x")
    assert isinstance(got["dc"], Probe) and got["dc"].name == "p"
    check_tensor(got["dc"].hidden, batch[4])
    check_tensor(got["dc"].extra["k"], batch[5])
    assert isinstance(got["nt"], Pair)
    check_tensor(got["nt"].right, batch[7, :, 1])
    check_tensor(got["custom"].t, batch[0, 1])
    assert got["set"] == {1, 2, 3}
    # compact everywhere: far less than one batch per tensor
    assert len(collect.dumps_compact(value)) < batch.numel() * 4


def test_model_output():
    transformers = pytest.importorskip("transformers")
    batch = torch.randn(4, 3, 5)
    out = transformers.modeling_outputs.BaseModelOutput(
        last_hidden_state=batch[1], hidden_states=(batch[2], batch[3])
    )
    data = collect.dumps_compact(out)
    assert len(data) < 3 * 15 * 4 + 2048
    got = pickle.loads(data)
    assert type(got) is type(out)
    check_tensor(got.last_hidden_state, batch[1])
    check_tensor(got["hidden_states"][1], batch[3])


def test_non_tensor_values_unchanged():
    value = [None, True, 3, 2.5, 1 + 2j, "s", b"b", bytearray(b"ba"), {"k": (1, [2])}, frozenset({1})]
    assert collect.dumps_compact(value) == pickle.dumps(value, protocol=5)
    assert roundtrip(value) == value


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int8, torch.uint8,
     torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64],
)
def test_dtypes(dtype):
    base = (torch.randn(6, 10) * 50).to(dtype)
    for t in (base, base[2], base[:, 3:7], base[::2, ::3], base.t(), base[1, 4]):
        check_tensor(roundtrip(t), t)


def test_non_contiguous_views():
    x = torch.randn(4, 5, 6, 7)
    cases = {
        "column": x[:, :, 2],
        "step": x[..., ::2],
        "permuted": x.permute(2, 0, 3, 1),  # dense: strides kept
        "channels_last": x.contiguous(memory_format=torch.channels_last),
        "expanded": torch.randn(1, 6).expand(5, 6),
        "scalar": x[1, 2, 3, 4],
        "empty": x[:, :0],
    }
    for name, t in cases.items():
        got = roundtrip(t)
        check_tensor(got, t)
        if name in ("permuted", "channels_last"):
            assert got.stride() == t.stride(), name
        if name == "expanded":
            assert got.is_contiguous() and got.untyped_storage().nbytes() == 5 * 6 * 4


def test_requires_grad_and_parameter():
    w = torch.nn.Parameter(torch.randn(3, 4))
    got = roundtrip({"w": w, "row": w[1]})
    check_tensor(got["w"], w.detach().requires_grad_())
    assert got["w"].is_leaf
    # a row of a Parameter is a non-leaf view that requires grad
    assert got["row"].requires_grad


def test_conj_and_neg_bits_resolved():
    z = torch.randn(4, dtype=torch.complex64)
    got = roundtrip(z.conj())
    assert torch.equal(got, z.conj().resolve_conj())


def test_sparse_falls_back_to_torch():
    s = torch.eye(3).to_sparse()
    got = roundtrip(s)
    assert torch.equal(got.to_dense(), torch.eye(3))


def test_refcounts_stable():
    batch = torch.randn(16, 8)
    row = batch[3]
    value = {"r": row, "n": [1, 2]}
    before = (sys.getrefcount(row), sys.getrefcount(batch), sys.getrefcount(value))
    for _ in range(50):
        collect.dumps_compact(value)
    assert (sys.getrefcount(row), sys.getrefcount(batch), sys.getrefcount(value)) == before


def test_errors_propagate():
    class Bad:
        def __reduce__(self):
            raise RuntimeError("no pickling here")

    with pytest.raises(RuntimeError, match="no pickling here"):
        collect.dumps_compact([torch.zeros(2), Bad()])
    # local objects: pickle's own error (its class varies across Python versions)
    with pytest.raises((pickle.PicklingError, AttributeError), match="local object"):
        collect.dumps_compact(lambda: 0)


def test_compact_pickler_class_usable_directly():
    import io

    buf = io.BytesIO()
    p = collect.CompactPickler(buf, 5)
    row = torch.randn(100, 50)[7]
    p.dump(row)
    assert len(buf.getvalue()) < 50 * 4 + 1024
    check_tensor(pickle.loads(buf.getvalue()), row)


def test_staged_through_pinned_pool_equals_direct():
    """The staging path (the one CUDA tensors take) gives the same payload
    contents, here through the pool's CPU implementation."""
    import pickle

    from nnloom import _C, collect

    batch = torch.randn(16, 8, 4)
    value = {"row": batch[3], "col": batch[:, 2], "again": batch[3], "n": 1}
    value["alias"] = value["row"]
    pool = _C.PinnedPool(events="cpu")
    before = pool.stats()
    staged = pickle.loads(collect.dumps_compact(value, pool=pool))
    direct = pickle.loads(collect.dumps_compact(value))
    assert staged.keys() == direct.keys()
    for k in ("row", "col", "again", "alias"):
        assert torch.equal(staged[k], direct[k]), k
    assert staged["alias"] is staged["row"]
    assert staged["n"] == 1
    del staged
    import gc

    gc.collect()
    after = pool.stats()
    assert after["bytes_leased"] == before["bytes_leased"]  # blocks went back
