"""Device staging on a real GPU (marker `gpu`; skipped without a device).

Compacts narrowed views of CUDA batch buffers into a pinned block on the
copy stream and compares them bitwise with `.cpu()` of the same views."""
import gc

import pytest
import torch

from nnloom import _C

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64]


def bits(t):
    return t.contiguous().reshape(-1).view(torch.uint8)


def batch(dtype, shape=(16, 9, 1024)):
    g = torch.Generator(device="cuda").manual_seed(0)
    if dtype.is_floating_point:
        return torch.randn(shape, device="cuda", generator=g).to(dtype)
    return torch.randint(-(2**40), 2**40, shape, device="cuda", generator=g, dtype=dtype)


def views(x):
    sbh = x.transpose(0, 1).contiguous()
    return [
        ("contiguous rows", x.narrow(0, 3, 4)),
        ("strided wide rows", sbh.narrow(1, 2, 5)),
        ("strided narrow rows", x[:, :, 8:12]),
        ("scattered", x[::3, :, ::2]),
        ("transposed", x[2].t()),
        ("single element", x[1, 2, 3:4]),
        ("empty", x[0:0]),
    ]


@pytest.fixture(scope="module")
def pool():
    p = _C.PinnedPool(events="cuda")
    assert p.device
    return p


def test_runtime_found():
    assert _C.cuda_available()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_device_stage_bitwise(pool, dtype):
    x = batch(dtype)
    vs = views(x)
    staged = pool.stage([v for _, v in vs])
    out = staged.tensors()
    for (name, v), t in zip(vs, out):
        assert t.device.type == "cpu" and t.is_contiguous(), name
        assert t.shape == v.shape and t.dtype == v.dtype, name
        assert torch.equal(bits(t), bits(v.cpu())), name
        if t.numel():
            assert t.is_pinned(), name


def test_copy_waits_for_compute_stream(pool):
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        a = torch.randn(4096, 4096, device="cuda")
        for _ in range(4):
            a = a @ a / 64.0  # long work queued on s
        view = a[100:200]
        staged = pool.stage([view])  # ordered after the matmuls on s
    torch.cuda.synchronize()
    assert torch.equal(staged.tensors()[0], view.cpu())


def test_sources_kept_alive_until_copied(pool):
    x = batch(torch.float32, (64, 128, 1024))
    want = x[7:9].cpu()
    staged = pool.stage([x[7:9]])
    del x  # the caching allocator may hand this memory out at once
    junk = torch.full((64, 128, 1024), float("nan"), device="cuda")
    assert torch.equal(staged.tensors()[0], want)
    del junk


def test_block_reused_after_events(pool):
    x = batch(torch.float16)
    s0 = pool.stats()
    for _ in range(20):
        st = pool.stage([x[1:3], x[:, :, ::4]])
        st.wait()
        assert st.ready()
        del st
    gc.collect()
    pool.reclaim()
    s1 = pool.stats()
    assert s1["leases_live"] == s0["leases_live"]
    assert s1["bytes_pinned"] - s0["bytes_pinned"] <= 64 << 20  # reused, not grown
    assert s1["reuses"] > s0["reuses"]


def test_no_host_sync_until_read(pool):
    a = torch.randn(8192, 8192, device="cuda")
    for _ in range(8):
        a = a @ a / 128.0
    staged = pool.stage([a[:16]])
    assert not staged.ready()  # queued behind the matmuls, host did not wait
    staged.wait()
    assert staged.ready()
