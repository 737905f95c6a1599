"""Compact staging on the CPU: narrowed views of batch buffers land in one
pinned-pool block, bitwise equal, with only their own bytes."""
import gc

import pytest
import torch

from nnloom import _C

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]


def batch(dtype, shape=(16, 7, 48)):
    g = torch.Generator().manual_seed(0)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-(2**40), 2**40, shape, generator=g, dtype=dtype)


def bits(t):
    t = t.contiguous()
    return t.view(torch.uint8) if t.dim() and t.numel() else t.reshape(-1).view(torch.uint8)


def views(x):
    """(name, view) pairs a trace produces from a [B, S, H] batch."""
    sbh = x.transpose(0, 1).contiguous()  # [S, B, H] storage
    return [
        ("contiguous rows", x.narrow(0, 3, 4)),
        ("one row", x[5]),
        ("strided wide rows", sbh.narrow(1, 2, 5)),  # rows of 5*H at a pitch
        ("strided narrow rows", x[:, :, 8:12]),
        ("scattered rows", x[torch.tensor([1, 4, 9])][:, ::2]),
        ("every other row", x[::2]),
        ("transposed", x[2].t()),
        ("broadcast", x[0, 0].expand(3, 48)),
        ("empty", x[0:0]),
    ]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_stage_bitwise(dtype):
    pool = _C.PinnedPool(events="cpu")
    x = batch(dtype)
    vs = views(x)
    staged = pool.stage([v for _, v in vs])
    assert len(staged) == len(vs)
    out = staged.tensors()
    for (name, v), t in zip(vs, out):
        assert t.shape == v.shape and t.dtype == v.dtype, name
        assert t.is_contiguous(), name
        assert torch.equal(bits(t), bits(v)), name
    assert staged.payload_bytes == sum(v.numel() * v.element_size() for _, v in vs)
    del staged, out, t
    gc.collect()
    assert pool.stats()["leases_live"] == 0 and pool.stats()["exports_live"] == 0


def test_only_own_rows_are_copied():
    pool = _C.PinnedPool(events="cpu")
    x = torch.zeros(256, 128, 64)
    row = x[17:18]
    staged = pool.stage([row])
    assert staged.payload_bytes == 128 * 64 * 4
    assert staged.block_bytes < x.numel() * 4 // 100  # the batch is never copied
    t = staged.tensors()[0]
    assert t.untyped_storage().nbytes() <= staged.block_bytes


def test_staged_data_is_a_copy():
    pool = _C.PinnedPool(events="cpu")
    x = torch.arange(40.0).reshape(4, 10)
    staged = pool.stage([x[1:3]])
    x.zero_()  # the source changing later does not change the payload
    assert staged.tensors()[0].tolist() == [list(map(float, range(10, 20))),
                                             list(map(float, range(20, 30)))]


def test_handles_and_tensors_share_the_block():
    pool = _C.PinnedPool(events="cpu")
    x = torch.arange(100, dtype=torch.int64).reshape(10, 10)
    staged = pool.stage([x[2:4], x[:, 3]])
    h = staged.handles()
    assert [hh.shape for hh in h] == [(2, 10), (10,)]
    assert all(hh.pooled for hh in h) and h[0].refcount == 3  # staged + 2 handles
    t1 = torch.from_dlpack(h[1])
    assert t1.tolist() == x[:, 3].tolist()
    del staged, h
    gc.collect()
    s = pool.stats()
    assert s["leases_live"] == 0 and s["exports_live"] == 1  # t1 holds the block
    del t1
    assert pool.stats()["bytes_leased"] == 0


def test_requires_grad_and_zero_dim():
    pool = _C.PinnedPool(events="cpu")
    w = torch.randn(4, 4, requires_grad=True)
    s = torch.tensor(3.5)
    out = pool.stage([w[1:3], s]).tensors()
    assert torch.equal(out[0], w.detach()[1:3]) and out[1].shape == () and float(out[1]) == 3.5


def test_cuda_tensor_needs_cuda_pool():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pool = _C.PinnedPool(events="cpu")
    with pytest.raises(ValueError, match="CUDA"):
        pool.stage([torch.ones(4, device="cuda")])


@pytest.mark.parametrize("n", [1, 64])
def test_cpu_staging_throughput_reported(n, capsys):
    """Prints GB/s for narrowed rows (no timing assertion)."""
    import time

    pool = _C.PinnedPool(events="cpu")
    x = torch.randn(64, 128, 768)
    rows = [x[i : i + 1] for i in range(n)]
    nbytes = sum(r.numel() * 4 for r in rows)
    for _ in range(3):
        pool.stage(rows)
    reps, ts = 7, []
    for _ in range(reps):
        t0 = time.perf_counter()
        pool.stage(rows)
        ts.append(time.perf_counter() - t0)
    ts.sort()
    with capsys.disabled():
        print(f"\n[cpu staging] {n} row view(s), {nbytes / 1e6:.1f} MB: "
              f"{nbytes / ts[reps // 2] / 1e9:.2f} GB/s (median of {reps})")
