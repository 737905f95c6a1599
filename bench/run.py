"""Run nnloom's benchmarks next to their anchors and print the ratios.

    python bench/run.py                 # full run (< 15 min on 2 CPU cores)
    python bench/run.py --quick         # short run (< 2 min)
    python bench/run.py --only saves    # one scenario
    python bench/run.py --device cuda   # time with CUDA events on a GPU

nnloom must be importable (installed, or ``PYTHONPATH=python`` after
``make dev``). Results go to ``bench/results/<scenario>.json`` and ``.png``.
Exit status 1 when any system computed wrong values or crashed.

``--device cuda`` moves models and inputs to the GPU and times each call with
a pair of CUDA events (end event waited on). It is deliberately simple and has
not been exercised on a machine without a GPU, where it refuses to start.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
import traceback
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the repository root, for `bench.*`

import torch  # noqa: E402

from bench import report  # noqa: E402
from bench.harness import Config, ScenarioResult, machine_info  # noqa: E402
from bench.scenarios import SCENARIOS  # noqa: E402


def _quiet() -> None:
    """Deprecation notices and generation chatter would bury the tables."""
    warnings.simplefilter("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    try:
        from transformers.utils import logging as hf_logging
        hf_logging.set_verbosity_error()
    except ImportError:
        pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer repeats (< 2 min)")
    ap.add_argument("--only", choices=sorted(SCENARIOS), action="append",
                    help="run only this scenario (repeatable)")
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: steadier on a shared machine)")
    ap.add_argument("--out", default=os.path.join(HERE, "results"), help="results folder")
    args = ap.parse_args(argv)

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"--device {args.device}: no CUDA device here", file=sys.stderr)
        return 2
    if args.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(args.device))
    _quiet()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)

    cfg = Config.make(args.quick, args.device)
    machine = machine_info(cfg)
    v = machine["versions"]
    print(f"nnloom {v['nnloom']} ({machine['nnloom_commit']}), nnsight {v['nnsight']}, "
          f"torch {v['torch']}, transformers {v['transformers']}, python {machine['python']}")
    print(f"{machine['cpu']}, {machine['cpus']} CPUs, torch threads {machine['torch_threads']}, "
          f"device {cfg.device}{' (' + machine['gpu'] + ')' if machine['gpu'] else ''}, "
          f"{'quick' if cfg.quick else 'full'} run: >= {cfg.min_repeats} repeats and "
          f">= {cfg.min_time}s per system, median reported\n")

    names = args.only or list(SCENARIOS)
    results: list[ScenarioResult] = []
    t0 = time.perf_counter()
    for name in names:
        t = time.perf_counter()
        try:
            res = SCENARIOS[name](cfg)
        except Exception as e:  # noqa: BLE001 - a crash in setup fails the run loudly
            res = ScenarioResult(name, "(crashed)", "", "")
            res.failures.append(f"[{name}] {type(e).__name__}: {e}\n{traceback.format_exc()}")
        results.append(res)
        print(report.format_scenario(res))
        paths = [report.write_json(res, machine, args.out)]
        try:
            png = report.plot(res, args.out)
        except Exception as e:  # noqa: BLE001 - a plot is not worth failing the run
            png = None
            print(f"   (plot failed: {type(e).__name__}: {e})")
        if png:
            paths.append(png)
        print(f"   -> {', '.join(os.path.relpath(p) for p in paths)} "
              f"[{time.perf_counter() - t:.1f}s]\n")

    summary = report.format_summary(results)
    if summary:
        print(summary)
    failures = [f for r in results for f in r.failures]
    print(f"\ntotal {time.perf_counter() - t0:.1f}s")
    if failures:
        print(f"\n!! {len(failures)} correctness failure(s) - details:", file=sys.stderr)
        for f in failures:
            print("\n" + f, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
