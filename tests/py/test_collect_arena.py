"""The shared-memory arena between two real processes (spawn)."""

import glob
import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest
import torch

import nnloom
from nnloom import collect

CTX = mp.get_context("spawn")


def _shm_names():
    # only this process's regions: other runs on the machine may hold theirs;
    # regions created by children are checked by name in their tests
    return set(glob.glob(f"/dev/shm/nnloom-{os.getpid()}-*"))


@pytest.fixture(autouse=True)
def no_leaked_segments():
    before = _shm_names()
    yield
    assert _shm_names() - before == set()


# ---- children (module level: spawn imports them) -------------------------


def _writer_units(name, values, out):
    """Write each value as one unit of two binaries (pickle split in two)."""
    w = collect.ArenaWriter(name, timeout=20.0)
    for v in values:
        data = collect.dumps_compact(v)
        half = len(data) // 2
        o1 = w.write_binary(data[:half])
        o2 = w.write_binary(memoryview(data)[half:])
        span = w.commit_unit()
        out.put((span, [(o1, half), (o2, len(data) - half)]))


def _writer_reuse(name, out, go):
    w = collect.ArenaWriter(name, timeout=0.5)
    offsets = []
    for tag in (b"A", b"B"):
        offsets.append(w.write_binary(tag * 4096))
        w.commit_unit()
    out.put(("written", offsets))
    go.get(timeout=30)
    try:  # both segments held by the reader: must wait, then time out
        w.write_binary(b"C" * 4096)
        out.put(("no wait", None))
        return
    except TimeoutError as exc:
        out.put(("timeout", str(exc)))
    go.get(timeout=30)
    off = _write_with_retry(w, b"C" * 4096)
    w.commit_unit()
    out.put(("reused", off))


def _write_with_retry(w, data, seconds=20.0):
    deadline = time.monotonic() + seconds
    while True:
        try:
            return w.write_binary(data)
        except TimeoutError:
            if time.monotonic() > deadline:
                raise


def _writer_dies(name, ready):
    w = collect.ArenaWriter(name, timeout=5.0)
    w.write_binary(b"partial")
    ready.put(os.getpid())
    time.sleep(60)  # killed by the parent before it commits


def _reader_owner(out):
    r = collect.ArenaReader(slots=1, slot_size=4096)
    out.put(r.name)
    time.sleep(60)  # killed by the parent


def _start(target, *args):
    p = CTX.Process(target=target, args=args, daemon=True)
    p.start()
    return p


# ---- tests ------------------------------------------------------------------


@pytest.mark.parametrize("zero_copy", [True, False])
def test_payloads_cross_intact(zero_copy):
    batch = torch.randn(8, 64, 32)
    values = [
        {"row": batch[i], "col": batch[i, :, 3], "meta": [i, "x", None]} for i in range(6)
    ]
    with collect.ArenaReader(slots=2, slot_size=1 << 20, zero_copy=zero_copy) as r:
        assert r.zero_copy is zero_copy
        out = CTX.Queue()
        p = _start(_writer_units, r.name, values, out)
        for want in values:
            span, parts = out.get(timeout=60)
            got_span, nbytes = r.next_unit(timeout=30)
            assert got_span == span and nbytes == sum(n for _, n in parts)
            views = [r.read_binary(o, n) for o, n in parts]
            assert [len(v) for v in views] == [n for _, n in parts]
            got = collect.loads(b"".join(views))
            del views
            r.end_unit(span, [])
            assert torch.equal(got["row"], want["row"]) and torch.equal(got["col"], want["col"])
            assert got["meta"] == want["meta"]
        p.join(30)
        assert p.exitcode == 0
        assert r.live_blocks == 0 and r.free_segments == 2


def test_views_stay_valid_and_storage_is_reused_after_release():
    with collect.ArenaReader(slots=2, slot_size=8192) as r:
        out, go = CTX.Queue(), CTX.Queue()
        p = _start(_writer_reuse, r.name, out, go)
        kind, offsets = out.get(timeout=60)
        assert kind == "written"
        held = []
        for tag, off in zip((b"A", b"B"), offsets):
            span, nbytes = r.next_unit(timeout=30)
            mv = r.read_binary(off, 4096)
            # every kind of export: a slice, numpy base chain, torch storage
            held.append((mv[10:20], np.frombuffer(mv, dtype=np.uint8),
                         torch.frombuffer(mv, dtype=torch.uint8)))
            del mv
            r.end_unit(span)
        assert r.free_segments == 0  # ended, but still exported
        go.put(1)
        kind, msg = out.get(timeout=60)
        assert kind == "timeout", (kind, msg)
        assert "full: no free segment" in msg
        for (sl, arr, ten), tag in zip(held, (b"A", b"B")):
            assert bytes(sl) == tag * 10 and arr.tobytes() == tag * 4096
            assert ten.sum().item() == tag[0] * 4096
        # drop the A exports one kind at a time: reuse only after the last
        sl, arr, ten = held.pop(0)
        del sl, arr
        assert r.free_segments == 0
        del ten
        assert r.free_segments == 1
        go.put(1)
        kind, off = out.get(timeout=60)
        assert kind == "reused" and off == offsets[0]  # A's segment, reused
        span, _ = r.next_unit(timeout=30)
        assert bytes(r.read_binary(off, 4096)) == b"C" * 4096
        r.end_unit(span)
        # B's views were never disturbed
        assert held[0][1].tobytes() == b"B" * 4096
        held.clear()
        p.join(30)
        assert p.exitcode == 0


def test_killed_writer_is_a_clear_error():
    with collect.ArenaReader(slots=2, slot_size=4096) as r:
        ready = CTX.Queue()
        p = _start(_writer_dies, r.name, ready)
        pid = ready.get(timeout=60)
        os.kill(pid, signal.SIGKILL)
        p.join(30)
        start = time.monotonic()
        with pytest.raises(RuntimeError) as info:
            r.next_unit(timeout=20)
        assert time.monotonic() - start < 5
        assert str(info.value) == (
            f"operation not valid in the current state: arena {r.name}: "
            f"the writer (pid {pid}) is gone"
        )


def test_killed_reader_is_a_clear_error():
    out = CTX.Queue()
    p = _start(_reader_owner, out)
    name = out.get(timeout=60)
    w = collect.ArenaWriter(name, timeout=20.0)
    w.write_binary(b"x")
    w.commit_unit()  # fills the only segment
    p.kill()
    p.join(30)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"arena {name}: the reader \(pid {p.pid}\) is gone"):
        w.write_binary(b"y")
    assert time.monotonic() - start < 5
    w.close()
    assert not os.path.exists("/dev/shm" + name)  # the writer unlinked the orphan


def test_full_arena_times_out_in_process():
    with collect.ArenaReader(slots=1, slot_size=4096) as r:
        w = collect.ArenaWriter(r.name, timeout=0.2)
        w.write_binary(b"a")
        w.commit_unit()
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="full: no free segment after 0.2 s"):
            w.write_binary(b"b")
        assert 0.15 < time.monotonic() - start < 5
        span, _ = r.next_unit(timeout=1)
        r.end_unit(span)
        with pytest.raises(nnloom._C.PoolExhaustedError, match="does not fit a 4096-byte"):
            w.write_binary(b"z" * 5000)
        w.close()


def test_reader_checks_offsets_and_units():
    with collect.ArenaReader(slots=2, slot_size=4096) as r:
        w = collect.ArenaWriter(r.name, timeout=1.0)
        off = w.write_binary(b"0123456789")
        with pytest.raises(ValueError, match="is not being read"):
            r.read_binary(off, 4)  # not committed yet
        span = w.commit_unit()
        assert r.next_unit(timeout=1) == (span, 10)
        assert bytes(r.read_binary(off + 2, 3)) == b"234"
        with pytest.raises(ValueError, match="outside unit"):
            r.read_binary(off, 11)
        with pytest.raises(ValueError, match="not in a segment"):
            r.read_binary(0, 1)
        held = r.read_binary(off, 1)
        r.end_unit(span, anchors=None)
        with pytest.raises(RuntimeError, match="already ended"):
            r.end_unit(span)  # ended but still exported
        del held
        with pytest.raises(ValueError, match="is not being read"):
            r.end_unit(span)  # ended and freed
        with pytest.raises(TimeoutError, match="no unit committed within"):
            r.next_unit(timeout=0.05)
        # reset ends a taken unit that was never ended
        w.write_binary(b"z")
        span2 = w.commit_unit()
        r.next_unit(timeout=1)
        assert r.free_segments == 1
        r.reset()
        assert r.free_segments == 2
        del span2
        w.close()


def test_close_keeps_live_views_and_unlinks():
    r = collect.ArenaReader(slots=1, slot_size=4096)
    name = r.name
    w = collect.ArenaWriter(name)
    off = w.write_binary(b"keep me")
    w.commit_unit()
    r.next_unit(timeout=1)
    w.close()
    mv = r.read_binary(off, 7)
    r.close()
    assert not os.path.exists("/dev/shm" + name)
    assert bytes(mv) == b"keep me"  # mapping alive under the view
    del mv
    with pytest.raises(ValueError, match="closed"):
        r.read_binary(off, 7)
