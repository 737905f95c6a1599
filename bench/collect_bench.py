"""Benchmarks of collect/: compact pickles, loading, merging, the arena.

    python bench/collect_bench.py [--batch-mib 256]

Each measurement checks its result first (the loaded rows equal the saved
rows; the merged result equals the expected one), then times warm repeats and
prints the median. Anchors in the same run: plain pickle of the same views,
torch.save, and a multiprocessing pipe for the arena.
"""

from __future__ import annotations

import argparse
import io
import multiprocessing as mp
import pickle
import statistics
import time

import torch

from nnloom import collect


def _median(fn, repeats=5, warm=1):
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def bench_dumps(batch_mib: int) -> None:
    rows = 256
    width = batch_mib * (1 << 20) // 4 // rows
    batch = torch.randn(rows, width)
    views = [batch[i] for i in range(rows)]  # what 256 invokes saved
    payload = {"rows": views}
    data = collect.dumps_compact(payload)
    back = collect.loads(data)
    assert all(torch.equal(a, b) for a, b in zip(back["rows"], views))
    nbytes = batch.numel() * 4
    t_dump = _median(lambda: collect.dumps_compact(payload))
    t_load = _median(lambda: collect.loads(data))
    one = pickle.dumps(views[0])  # a plain pickle of ONE view carries the whole batch
    t_pickle_one = _median(lambda: pickle.dumps(views[0]), repeats=3)

    def tsave():
        buf = io.BytesIO()
        torch.save(payload, buf)
        return buf

    t_tsave = _median(tsave, repeats=3)
    print(f"[dumps] batch {batch_mib} MiB as 256 row views ({nbytes / 2**20:.0f} MiB of rows)")
    print(f"  dumps_compact: {len(data) / nbytes:.4f}x rows' bytes, {nbytes / t_dump / 1e9:.2f} GB/s")
    print(f"  collect.loads: {nbytes / t_load / 1e9:.2f} GB/s")
    print(f"  pickle.dumps of ONE view: {len(one) / 2**20:.0f} MiB ({len(one) / (nbytes / rows):.0f}x "
          f"that row), {t_pickle_one * 1e3:.0f} ms; all 256 views as separate payloads: "
          f"~{len(one) * rows / 2**30:.0f} GiB")
    print(f"  torch.save of the 256 views: {nbytes / t_tsave / 1e9:.2f} GB/s "
          f"(dumps_compact is {t_tsave / t_dump:.1f}x faster)")


def bench_merge(n_payloads=1000, n_saves=12) -> None:
    class Med:
        def __init__(self, presaved):
            self.presaved = presaved
            self.scope = {}

    names = [f"s{j}" for j in range(n_saves)]
    presaved = set(names[: n_saves // 2])
    per_request = []
    for i in range(n_payloads):
        p = {}
        for j, n in enumerate(names):
            if n in presaved:
                slots = [None] * n_payloads
                slots[i] = (i, j)
                p[n] = slots if j % 2 == 0 else {f"k{i}": j}
            else:
                p[n] = torch.tensor([i, j])
        per_request.append(p)
    meds = [Med(presaved) for _ in range(n_payloads)]
    merged = collect.merge_shared_saves(meds, per_request)
    assert merged["s0"][7] == (7, 0) and len(merged["s1"]) == n_payloads

    def run():
        collect.merge_shared_saves(meds, per_request)

    t = _median(run)
    print(f"[merge] {n_payloads} payloads x {n_saves} saves (half shared): {t * 1e3:.2f} ms "
          f"(target <= 10 ms)")


def _arena_writer(name, n, nbytes, q):
    w = collect.ArenaWriter(name, timeout=60)
    data = b"x" * nbytes
    for _ in range(n):
        off = w.write_binary(data)
        q.put((w.commit_unit(), off))


def _pipe_writer(conn, n, nbytes):
    data = b"x" * nbytes
    for _ in range(n):
        conn.send_bytes(data)


def bench_arena(mib=64, n=8) -> None:
    ctx = mp.get_context("spawn")
    nbytes = mib << 20
    with collect.ArenaReader(slots=2, slot_size=nbytes) as r:
        q = ctx.Queue()
        p = ctx.Process(target=_arena_writer, args=(r.name, n, nbytes, q))
        p.start()
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            span, off = q.get(timeout=120)
            got, size = r.next_unit(timeout=60)
            mv = r.read_binary(off, nbytes)
            assert len(mv) == nbytes
            del mv
            r.end_unit(got)
            ts.append(time.perf_counter() - t)
        p.join()
    a, b = ctx.Pipe()
    p = ctx.Process(target=_pipe_writer, args=(b, n, nbytes))
    p.start()
    tp = []
    for _ in range(n):
        t = time.perf_counter()
        assert len(a.recv_bytes()) == nbytes
        tp.append(time.perf_counter() - t)
    p.join()
    ma, mp_ = statistics.median(ts[1:]), statistics.median(tp[1:])
    print(f"[arena] {mib} MiB payload: arena (zero copy) {ma * 1e3:.1f} ms, pipe {mp_ * 1e3:.1f} ms "
          f"({mp_ / ma:.1f}x)")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-mib", type=int, default=256)
    args = ap.parse_args()
    torch.set_num_threads(1)
    bench_dumps(args.batch_mib)
    bench_merge()
    bench_arena()


if __name__ == "__main__":
    main()
