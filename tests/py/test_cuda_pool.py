"""Pinned pool and retained handles (nnloom._C.PinnedPool / Retained) on the CPU.

Resources are counted before and after: leases, exports, waiting bytes,
container refcounts and Python refcounts.
"""
import gc
import sys

import pytest
import torch

from nnloom import _C


def stats(pool):
    gc.collect()
    return pool.stats()


def test_lease_reuse_and_stats():
    pool = _C.PinnedPool(events="cpu", slab_bytes=1 << 20)
    h = pool.lease(5000)
    assert h.pooled and h.block_bytes == 8192 and h.shape == (5000,)
    ptr = h.data_ptr
    s = stats(pool)
    assert s["leases_live"] == 1 and s["bytes_leased"] == 8192 and s["bytes_pinned"] == 1 << 20
    del h
    s = stats(pool)
    assert s["leases_live"] == 0 and s["bytes_leased"] == 0 and s["bytes_free"] == 8192
    h2 = pool.lease(6000)  # same class: the same block comes back
    assert h2.data_ptr == ptr and pool.stats()["reuses"] == 1


def test_bound_raises_pool_exhausted():
    pool = _C.PinnedPool(events="cpu", limit_bytes=2 << 20, slab_bytes=1 << 20)
    a = pool.lease(1 << 20)
    b = pool.lease(1 << 20)
    with pytest.raises(_C.PoolExhaustedError, match="limit"):
        pool.lease(100)
    assert isinstance(_C.PoolExhaustedError(), _C.NNloomError)
    del a
    c = pool.lease(1 << 20)  # the freed block serves it
    assert pool.stats()["bytes_pinned"] == 2 << 20
    del b, c
    with pytest.raises(ValueError):
        pool.lease(0)


def test_dlpack_export_holds_block_until_last_view():
    pool = _C.PinnedPool(events="cpu")
    h = pool.lease(4096)
    t = torch.from_dlpack(h)
    t.fill_(7)
    v = t[100:200]  # a view shares the export
    assert stats(pool)["exports_live"] == 1
    del h, t
    s = stats(pool)
    assert s["leases_live"] == 0 and s["exports_live"] == 1 and s["bytes_leased"] == 4096
    assert int(v.sum()) == 700
    del v
    s = stats(pool)
    assert s["exports_live"] == 0 and s["bytes_leased"] == 0 and s["bytes_free"] == 4096


def test_deleter_runs_exactly_once_per_export():
    pool = _C.PinnedPool(events="cpu")
    h = pool.lease(4096)
    ts = [torch.from_dlpack(h) for _ in range(5)]
    assert stats(pool)["exports_live"] == 5
    ts.pop()
    assert stats(pool)["exports_live"] == 4
    del ts
    assert stats(pool)["exports_live"] == 0
    # an export that is never consumed releases itself with its capsule
    cap = h.__dlpack__()
    assert stats(pool)["exports_live"] == 1
    del cap
    assert stats(pool)["exports_live"] == 0
    del h
    assert stats(pool)["leases_live"] == 0


def test_clone_shares_never_copies():
    pool = _C.PinnedPool(events="cpu")
    h = pool.lease(1000)
    before = stats(pool)
    c = h.clone()
    assert c.data_ptr == h.data_ptr and h.refcount == 2 and c.refcount == 2
    after = stats(pool)
    assert after["bytes_leased"] == before["bytes_leased"]
    assert after["leases_total"] == before["leases_total"]
    torch.from_dlpack(c)[:3] = torch.tensor([1, 2, 3], dtype=torch.uint8)
    assert torch.from_dlpack(h)[:3].tolist() == [1, 2, 3]
    del h
    assert c.refcount == 1 and stats(pool)["leases_live"] == 1
    del c
    assert stats(pool)["leases_live"] == 0


def test_caller_owned_is_kept_apart():
    pool = _C.PinnedPool(events="cpu")
    t = torch.arange(10.0)
    before = stats(pool)
    r = _C.Retained.from_tensor(t)
    assert not r.pooled and r.block_bytes == 0
    assert r.tensor() is t  # never substituted, never copied
    c = r.clone()
    assert c.tensor() is t and r.refcount == 2
    assert torch.equal(torch.from_dlpack(c), t)
    assert stats(pool) == before
    rc = sys.getrefcount(t)
    del r, c
    assert sys.getrefcount(t) == rc - 1
    with pytest.raises(TypeError):
        _C.Retained.from_tensor([1, 2])
    with pytest.raises(ValueError):
        _C.Retained.from_tensor(t)._record(1)


def test_fake_events_delay_reuse():
    pool = _C.PinnedPool(events="fake")
    h = pool.lease(4096)
    ptr = h.data_ptr
    h._record(0x10)
    del h
    s = stats(pool)
    assert s["bytes_waiting"] == 4096 and s["bytes_free"] == 0
    other = pool.lease(4096)  # the waiting block is not handed out
    assert other.data_ptr != ptr
    assert pool.reclaim() == 0
    _C._fake_events_complete()
    assert pool.reclaim() == 1
    s = stats(pool)
    assert s["bytes_waiting"] == 0 and s["bytes_free"] == 4096
    assert pool.lease(4096).data_ptr == ptr


def test_exports_and_events_both_required():
    pool = _C.PinnedPool(events="fake")
    h = pool.lease(4096)
    t = torch.from_dlpack(h)
    h._record(0x20)
    _C._fake_events_complete()
    h._record(0x20)  # a newer marker on the same stream, still pending
    del h
    assert stats(pool)["bytes_leased"] == 4096  # the tensor holds it
    del t
    assert stats(pool)["bytes_waiting"] == 4096  # now only the stream
    assert _C._fake_events_complete() == 1  # one marker still recorded
    assert pool.reclaim() == 1
    assert _C._fake_events_complete() == 0


def test_pool_outlives_python_object():
    pool = _C.PinnedPool(events="cpu")
    h = pool.lease(4096)
    t = torch.from_dlpack(h)
    del pool
    gc.collect()
    t.fill_(3)  # the C pool is alive while the block is held
    assert int(t.sum()) == 3 * 4096
    del h, t
    gc.collect()


def test_refcounts_stable_around_entry_points():
    pool = _C.PinnedPool(events="cpu")
    x = torch.arange(64.0).reshape(8, 8)
    for _ in range(3):  # warm
        pool.stage([x[2:4]]).tensors()
    rc_x, rc_pool = sys.getrefcount(x), sys.getrefcount(pool)
    for _ in range(50):
        s = pool.stage([x[2:4], x[:, ::2]])
        ts = s.tensors()
        hs = s.handles()
        torch.from_dlpack(hs[0])
        del s, ts, hs
        pool.lease(100).clone()
    gc.collect()
    assert sys.getrefcount(x) == rc_x and sys.getrefcount(pool) == rc_pool
    s = pool.stats()
    assert s["leases_live"] == 0 and s["exports_live"] == 0 and s["bytes_leased"] == 0


def test_bad_arguments():
    with pytest.raises(ValueError):
        _C.PinnedPool(events="sometimes")
    pool = _C.PinnedPool(events="cpu")
    with pytest.raises(TypeError):
        pool.stage([1, 2])
    with pytest.raises(TypeError):
        pool.stage(5)
    assert pool.stats()["leases_live"] == 0
