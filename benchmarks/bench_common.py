"""Pieces every benchmark script shares: a wall-clock timer, a kernel-span
timer, where results go, and the options that pick cases and name a run."""

from __future__ import annotations

import datetime
import glob
import os
import statistics
import tempfile
import time

import jax

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def wall_ms(compiled, args, repeats: int, warmup: int = 1) -> float:
  """Median wall-clock milliseconds of a call, after `warmup` untimed calls."""
  for _ in range(warmup):
    jax.block_until_ready(compiled(*args))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    times.append(time.perf_counter() - start)
  return 1e3 * statistics.median(times)


def trace_spans(f, args, iterations: int):
  """Per call of `f(*args)`: (span, kernels), from a `jax.profiler` trace of
  `iterations` calls issued back to back (as CUPTI's `measure` issues them).

  span: milliseconds from the start of the call's first GPU kernel to the end
  of its last one. CUPTI's `measure` sums kernel durations instead, which
  counts twice the time two kernels of one call overlap (programmatic
  dependent launch, `fa4_jax.kernels.pipeline.LaunchChain`); the span does
  not. kernels: [(name, start offset ms, duration ms)] in start order.
  """
  from jax.profiler import ProfileData

  jax.block_until_ready(f(*args))  # compile and warm up outside the trace
  with tempfile.TemporaryDirectory() as folder:
    jax.profiler.start_trace(folder)
    try:
      jax.block_until_ready([f(*args) for _ in range(iterations)])
    finally:
      jax.profiler.stop_trace()
    (path,) = glob.glob(os.path.join(folder, "**", "*.xplane.pb"), recursive=True)
    data = ProfileData.from_file(path)
  plane = data.find_plane_with_name("/device:GPU:0")
  # The per-stream lines hold the kernels; "XLA Ops" / "XLA Modules" lines
  # repeat them under other names.
  kernels = sorted((ev.start_ns, ev.duration_ns, ev.name)
                   for line in plane.lines if line.name.startswith("Stream")
                   for ev in line.events)
  if not kernels or len(kernels) % iterations:
    raise RuntimeError(f"{len(kernels)} kernels in the trace for {iterations} calls; "
                       f"lines: {[line.name for line in plane.lines]}")
  per_call = len(kernels) // iterations
  out = []
  for i in range(iterations):
    call = kernels[i * per_call:(i + 1) * per_call]
    t0 = call[0][0]
    span = max(start + dur for start, dur, _ in call) - t0
    out.append((span / 1e6, [(name, (start - t0) / 1e6, dur / 1e6) for start, dur, name in call]))
  return out


def result_path(prefix: str, device_kind: str, tag: str = "") -> str:
  """`<dir>/<prefix>[-<tag>]-<device>-<date>.json`, the folder created if
  needed: $OUT when set (the GPU machine's folder that comes back), else
  benchmarks/results."""
  out_dir = os.environ.get("OUT") or RESULTS_DIR
  os.makedirs(out_dir, exist_ok=True)
  kind = device_kind.replace(" ", "_")
  name = "-".join(filter(None, [prefix, tag, kind, datetime.date.today().isoformat()]))
  return os.path.join(out_dir, f"{name}.json")


def add_case_options(parser) -> None:
  """--only SUBSTRING (repeatable) and --tag NAME (added to the results file name)."""
  parser.add_argument("--only", action="append", default=None,
                      help="run cases whose name contains this (repeat: any of them)")
  parser.add_argument("--tag", default="", help="added to the results file name")


def selected(cases, only):
  """The cases (tuples whose first item is the name) that `--only` picks: all
  when it was not given, else those whose name contains any of its values."""
  return [c for c in cases if not only or any(o in c[0] for o in only)]


def case_mask(causal: bool, window_left):
  """(MaskSpec, jax.nn's local_window_size) of a benchmark case: causal or
  not, and a window of `window_left` keys to the left (None: no window)."""
  from fa4_jax.scores import MaskSpec  # the scripts put the repository on sys.path first
  window = None if window_left is None else (window_left, 0)
  return MaskSpec.from_arguments(causal, window), window
