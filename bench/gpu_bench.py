"""GPU benchmarks of cuda/ (run by bench/gpu_check.sh on a CUDA machine).

1. compact D2H: staging narrowed views of a batch buffer into a pinned block
   vs a plain pinned cudaMemcpy (tensor.copy_ non_blocking into pinned
   memory) of the same number of contiguous bytes: the achieved fraction.
2. pinned pool lease/release from Python (CUDA-event-backed pool).
3. a 12-layer random GPT-2 (plain torch, no downloads) forward: bare vs with
   12 block outputs saved through forward hooks and staged in one payload.
Each measure: warm-ups, repeats, median, a correctness check. Prints a
table and writes JSON to the path given as argv[1].
"""
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from nnloom import _C

DEV = "cuda"
R = {}


def cuda_time(fn, warm=3, reps=15):
    """Median wall time of fn() in seconds, device synchronised around it."""
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


# ---- 1. compact D2H vs plain pinned copy --------------------------------------
def bench_d2h(pool):
    out = {}
    S, B, H = 512, 64, 4096
    x = torch.randn(S, B, H, device=DEV, dtype=torch.float16)  # [S, B, H]: rows are strided
    bx = x.transpose(0, 1).contiguous()  # [B, S, H]: rows are contiguous
    cases = {
        "contiguous rows (B-major, 16 of 64)": [bx[i : i + 1] for i in range(0, 64, 4)],
        "strided wide rows ([S,B,H] narrowed on B)": [x[:, i : i + 1] for i in range(0, 64, 4)],
        "narrow scattered (every 8th hidden unit)": [bx[i : i + 1, :, ::8] for i in range(0, 64, 4)],
    }
    for name, views in cases.items():
        nbytes = sum(v.numel() * v.element_size() for v in views)
        src = torch.empty(nbytes // 2, device=DEV, dtype=torch.float16)
        dst = torch.empty(nbytes // 2, dtype=torch.float16, pin_memory=True)
        t_plain = cuda_time(lambda: dst.copy_(src, non_blocking=True))

        def staged():
            st = pool.stage(views)
            st.wait()

        t_stage = cuda_time(staged)
        st = pool.stage(views)
        ok = all(torch.equal(t, v.cpu()) for t, v in zip(st.tensors(), views))
        del st
        out[name] = {
            "bytes": nbytes,
            "plain_pinned_GBps": nbytes / t_plain / 1e9,
            "staged_GBps": nbytes / t_stage / 1e9,
            "fraction_of_peak": t_plain / t_stage,
            "bitwise_equal": ok,
        }
    R["d2h"] = out


# ---- 2. pool lease/release -----------------------------------------------------
def bench_pool(pool):
    for n in (4096, 1 << 20):
        h = pool.lease(n)
        del h
        reps = 20000
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(reps):
                pool.lease(n)
            ts.append((time.perf_counter() - t0) / reps)
        R.setdefault("pool", {})[f"lease+release {n} B (Python, ns)"] = statistics.median(ts) * 1e9


# ---- 3. GPT-2 forward with 12 staged saves ------------------------------------
class Block(torch.nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.h = h
        self.ln1 = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.ln2 = torch.nn.LayerNorm(d)
        self.fc = torch.nn.Linear(d, 4 * d)
        self.out = torch.nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.h, d // self.h).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


class GPT2(torch.nn.Module):
    def __init__(self, n_layer=12, d=768, h=12, vocab=50257, n_pos=1024):
        super().__init__()
        self.wte = torch.nn.Embedding(vocab, d)
        self.wpe = torch.nn.Embedding(n_pos, d)
        self.h = torch.nn.ModuleList(Block(d, h) for _ in range(n_layer))
        self.ln_f = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.h:
            x = blk(x)
        return self.head(self.ln_f(x))


def bench_gpt2(pool):
    torch.manual_seed(0)
    model = GPT2().to(DEV).eval()
    idx = torch.randint(0, 50257, (8, 256), device=DEV)
    saved = []

    def hook(m, i, o):
        saved.append(o[1:2])  # request 1's rows, as a trace would narrow them

    def with_saves():
        saved.clear()
        model(idx)
        st = pool.stage(saved)  # one payload for the 12 saves
        st.wait()
        return st

    with torch.no_grad():
        t_bare = cuda_time(lambda: model(idx), warm=3, reps=20)
        hooks = [blk.register_forward_hook(hook) for blk in model.h]
        try:
            t_saves = cuda_time(with_saves, warm=3, reps=20)
            st = with_saves()
            ref = [s.cpu() for s in saved]
            ok = all(torch.equal(a, b) for a, b in zip(st.tensors(), ref))
        finally:
            for hk in hooks:
                hk.remove()
    R["gpt2"] = {
        "bare_forward_ms": t_bare * 1e3,
        "forward_with_12_staged_saves_ms": t_saves * 1e3,
        "ratio": t_saves / t_bare,
        "saves": len(ref),
        "payload_bytes": sum(r.numel() * r.element_size() for r in ref),
        "bitwise_equal": ok,
    }


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else "gpu-bench.json"
    assert torch.cuda.is_available() and _C.cuda_available(), "needs a CUDA device"
    pool = _C.PinnedPool(events="cuda")
    R["device"] = torch.cuda.get_device_name(0)
    R["kernels"] = _C.cuda_have_kernels()
    for step in (bench_d2h, bench_pool, bench_gpt2):
        t0 = time.perf_counter()
        try:
            step(pool)
        except Exception as e:  # report, keep the other measures
            R[step.__name__] = {"error": f"{type(e).__name__}: {e}"}
        print(f"[gpu_bench] {step.__name__} {time.perf_counter() - t0:.1f}s", flush=True)
    R["pool_stats"] = pool.stats()
    with open(path, "w") as f:
        json.dump(R, f, indent=2, default=str)
    print(json.dumps(R, indent=2))


if __name__ == "__main__":
    main()
