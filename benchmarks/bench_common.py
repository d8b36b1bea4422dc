"""Pieces every benchmark script shares: a wall-clock timer, where results
go, and the options that pick cases and name a run."""

from __future__ import annotations

import datetime
import os
import statistics
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
  from fa4_jax.masks import MaskSpec  # the scripts put the repository on sys.path first
  window = None if window_left is None else (window_left, 0)
  return MaskSpec.from_arguments(causal, window), window
