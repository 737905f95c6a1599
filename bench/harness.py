"""Measurement machinery shared by every scenario.

A scenario is a list of *cases* (one column of the table each, e.g. "1 save"
and "12 saves"); a case runs several *systems* (rows: bare forward, raw hooks,
nnsight, nnloom) that compute the same values. For each case the harness

1. runs every system once and compares what it returns with the case's
   reference (``allclose`` with the case's tolerance); a mismatch or an
   exception marks that system FAILED and the whole run exits non-zero;
2. warms up every system that passed;
3. times them in interleaved rounds (one call of each system per round, the
   order rotating), so load from other processes on a shared machine hits all
   systems alike; it stops once every system has at least ``min_repeats``
   samples and ``min_time`` seconds of samples (or at ``max_time``, but never
   before ``min_repeats``);
4. reports median, min and max per system.

Ratios are always taken between systems measured in the same rounds.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

OK = "ok"
NOT_IMPLEMENTED = "not implemented"
SKIPPED = "skipped"
FAILED = "FAILED"


class CorrectnessError(AssertionError):
    """A system computed values that differ from the reference."""


# ---------------------------------------------------------------------------
# Configuration
# ---------------------------------------------------------------------------


@dataclass
class Config:
    quick: bool = False
    device: str = "cpu"
    warmup: int = 10
    min_repeats: int = 30
    min_time: float = 2.0   # seconds of samples per system and case
    max_time: float = 12.0  # wall seconds per case, once min_repeats is reached

    @classmethod
    def make(cls, quick: bool, device: str) -> "Config":
        if quick:
            return cls(quick=True, device=device, warmup=3, min_repeats=20,
                       min_time=0.3, max_time=3.0)
        return cls(quick=False, device=device)

    @property
    def cuda(self) -> bool:
        return self.device.startswith("cuda")

    def tol(self, rtol: float, atol: float) -> tuple[float, float]:
        """Tolerances: as given on CPU; looser on CUDA (TF32, other kernels)."""
        if self.cuda:
            return max(rtol, 1e-3), max(atol, 1e-3)
        return rtol, atol


# ---------------------------------------------------------------------------
# Systems, cases and their results
# ---------------------------------------------------------------------------


@dataclass
class System:
    """One row: a callable doing the whole operation once and returning the
    values to compare with the reference."""

    name: str
    run: Callable[[], Any] | None = None
    status: str = OK
    note: str = ""

    @classmethod
    def unavailable(cls, name: str, status: str, note: str) -> "System":
        return cls(name, None, status, note)


@dataclass
class Stats:
    median_s: float
    min_s: float
    max_s: float
    n: int

    @classmethod
    def of(cls, samples: list[float]) -> "Stats":
        return cls(statistics.median(samples), min(samples), max(samples), len(samples))


@dataclass
class Row:
    system: str
    status: str
    note: str = ""
    stats: Stats | None = None
    extra: dict = field(default_factory=dict)  # e.g. payload bytes

    def to_json(self) -> dict:
        d = {"system": self.system, "status": self.status, "note": self.note}
        if self.stats is not None:
            s = self.stats
            d.update(median_us=s.median_s * 1e6, min_us=s.min_s * 1e6,
                     max_us=s.max_s * 1e6, repeats=s.n)
        d.update(self.extra)
        return d


@dataclass
class Case:
    """One column: the systems, the reference they must reproduce, and how to
    compare (``compare(got, ref)`` raises CorrectnessError)."""

    name: str
    systems: list[System]
    reference: Any
    compare: Callable[[Any, Any], None]


@dataclass
class Metric:
    """A derived number (ratio, per-intervention cost) and its target."""

    name: str
    value: float | None          # None: could not be computed (see note)
    unit: str = "x"              # "x" for ratios, "us", "B"
    target: float | None = None  # value must be <= target
    target_text: str = ""
    note: str = ""

    @property
    def met(self) -> bool | None:
        if self.value is None or self.target is None:
            return None
        return self.value <= self.target

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "met": self.met}


@dataclass
class ScenarioResult:
    name: str
    title: str
    reference: str
    tolerance: str
    cases: dict[str, list[Row]] = field(default_factory=dict)
    metrics: list[Metric] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def row(self, case: str, system: str) -> Row | None:
        for r in self.cases.get(case, []):
            if r.system == system:
                return r
        return None

    def median(self, case: str, system: str) -> float | None:
        r = self.row(case, system)
        return r.stats.median_s if r is not None and r.stats is not None else None

    def fastest(self, case: str, system: str) -> float | None:
        """The minimum: a second, noise-robust view of the intrinsic cost."""
        r = self.row(case, system)
        return r.stats.min_s if r is not None and r.stats is not None else None


# ---------------------------------------------------------------------------
# Comparing values
# ---------------------------------------------------------------------------


def flatten(value: Any) -> list[torch.Tensor]:
    """The tensors in a nest of lists/tuples/dicts, in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for k in value for t in flatten(value[k])]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in flatten(v)]
    raise CorrectnessError(f"unexpected value of type {type(value).__name__} in the results")


def allclose(rtol: float, atol: float) -> Callable[[Any, Any], None]:
    """A comparator: same number of tensors, same shapes, allclose each."""

    def compare(got: Any, ref: Any) -> None:
        g, r = flatten(got), flatten(ref)
        if len(g) != len(r):
            raise CorrectnessError(f"{len(g)} tensors returned, reference has {len(r)}")
        for i, (a, b) in enumerate(zip(g, r)):
            if tuple(a.shape) != tuple(b.shape):
                raise CorrectnessError(f"tensor {i}: shape {tuple(a.shape)}, "
                                       f"reference {tuple(b.shape)}")
            a = a.detach().to("cpu", torch.float64)
            b = b.detach().to("cpu", torch.float64)
            if not torch.allclose(a, b, rtol=rtol, atol=atol):
                diff = (a - b).abs()
                rel = diff / b.abs().clamp_min(1e-12)
                raise CorrectnessError(
                    f"tensor {i} of {len(r)} differs: max abs diff {diff.max().item():.3e}, "
                    f"max rel diff {rel.max().item():.3e} (rtol={rtol}, atol={atol})")

    return compare


# ---------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------


def _cpu_timer(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _cuda_timer(fn: Callable[[], Any]) -> float:
    """Time one call with CUDA events on the current stream. The end event is
    waited on, so host-side gaps between kernels count too: this is the
    operation's latency as the user sees it, measured on the device clock."""
    start = torch.cuda.Event(enable_timing=True)
    end = torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def timer_for(cfg: Config) -> Callable[[Callable[[], Any]], float]:
    return _cuda_timer if cfg.cuda else _cpu_timer


def check_case(case: Case, result: ScenarioResult,
               extra: Callable[[System, Any], dict] | None = None) -> list[Row]:
    """Run every available system once and compare with the reference.

    A mismatch or an exception marks the row FAILED and is recorded in
    ``result.failures`` (the run then exits non-zero); NotImplementedError marks
    it "not implemented". ``extra(system, output)`` may add fields to a row
    (payload bytes, say) from the output of this run.
    """
    rows: list[Row] = []
    for s in case.systems:
        row = Row(s.name, s.status, s.note)
        rows.append(row)
        if s.run is None or s.status != OK:
            continue
        try:
            out = s.run()
            case.compare(out, case.reference)
        except NotImplementedError as e:
            row.status, row.note = NOT_IMPLEMENTED, f"{type(e).__name__}: {e}"
            continue
        except Exception as e:  # noqa: BLE001 - any failure is reported, loudly
            row.status = FAILED
            row.note = f"{type(e).__name__}: {e}"
            result.failures.append(f"[{result.name} / {case.name} / {s.name}] {row.note}\n"
                                   + traceback.format_exc())
            continue
        if extra is not None:
            row.extra.update(extra(s, out))
        del out
    result.cases[case.name] = rows
    return rows


def time_cases(groups: list[tuple[str, list[System], list[Row]]], cfg: Config,
               result: ScenarioResult) -> None:
    """Warm up and time the systems whose row is OK, for one or more cases at
    once: every (case, system) pair runs once per round, the order rotating.
    Cases whose numbers are subtracted from each other (1 save vs 12 saves)
    are timed together so that drift in the machine's load cancels."""
    live: list[tuple[System, Row]] = []
    for case_name, systems, rows in groups:
        by_name = {r.system: r for r in rows}
        live += [(s, by_name[s.name]) for s in systems
                 if s.run is not None and by_name[s.name].status == OK]
        result.cases[case_name] = rows
    time_fn = timer_for(cfg)
    for s, _ in live:
        for _ in range(cfg.warmup):
            s.run()
    if cfg.cuda:
        torch.cuda.synchronize()
    gc.collect()

    samples: list[list[float]] = [[] for _ in live]
    t_start = time.perf_counter()
    rnd = 0
    while live:
        k = rnd % len(live)
        for i in list(range(k, len(live))) + list(range(k)):
            samples[i].append(time_fn(live[i][0].run))
        rnd += 1
        if rnd < cfg.min_repeats:
            continue
        if all(sum(v) >= cfg.min_time for v in samples):
            break
        if time.perf_counter() - t_start >= cfg.max_time * len(groups):
            break
    for (_, row), v in zip(live, samples):
        row.stats = Stats.of(v)


def time_case(case_name: str, systems: list[System], rows: list[Row], cfg: Config,
              result: ScenarioResult) -> None:
    """Warm up and time one case (see time_cases)."""
    time_cases([(case_name, systems, rows)], cfg, result)


def run_case(case: Case, cfg: Config, result: ScenarioResult,
             extra: Callable[[System, Any], dict] | None = None) -> list[Row]:
    """Check, warm up and time one case; store and return its rows."""
    rows = check_case(case, result, extra)
    time_case(case.name, case.systems, rows, cfg, result)
    return rows


# ---------------------------------------------------------------------------
# Ratios
# ---------------------------------------------------------------------------


def ratio(name: str, num: float | None, den: float | None, *, target: float | None = None,
          target_text: str = "", why_missing: str = "") -> Metric:
    """num/den, or a metric with no value (and a note) when either is missing
    or the denominator is not positive (below the timing noise)."""
    if num is None or den is None:
        return Metric(name, None, "x", target, target_text,
                      why_missing or "a side of the ratio was not measured")
    if den <= 0:
        return Metric(name, None, "x", target, target_text,
                      "anchor difference below timing noise (<= 0)")
    return Metric(name, num / den, "x", target, target_text)


# ---------------------------------------------------------------------------
# Machine and versions
# ---------------------------------------------------------------------------


def _version(mod: str) -> str | None:
    try:
        m = __import__(mod)
        return getattr(m, "__version__", "?")
    except Exception:  # noqa: BLE001
        return None


def _git_commit() -> str | None:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except Exception:  # noqa: BLE001
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def machine_info(cfg: Config) -> dict:
    info = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "device": cfg.device,
        "gpu": torch.cuda.get_device_name() if cfg.cuda else None,
        "versions": {m: _version(m) for m in
                     ("torch", "transformers", "nnsight", "nnloom", "transformer_lens")},
        "nnloom_commit": _git_commit(),
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "config": dataclasses.asdict(cfg),
    }
    return info
