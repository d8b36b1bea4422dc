"""Pieces every benchmark script shares: a wall-clock timer and where results go."""

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


def result_path(prefix: str, device_kind: str) -> str:
  """`<dir>/<prefix>-<device>-<date>.json`, the folder created if needed: $OUT
  when set (the GPU machine's folder that comes back), else benchmarks/results."""
  out_dir = os.environ.get("OUT") or RESULTS_DIR
  os.makedirs(out_dir, exist_ok=True)
  kind = device_kind.replace(" ", "_")
  return os.path.join(out_dir, f"{prefix}-{kind}-{datetime.date.today().isoformat()}.json")
