"""Board power, SM clock and clock-limit reasons while a backward runs back to
back for several seconds: fa4_jax's sm90 backward next to cuDNN, one process.

Why: on long rows (B1 S16384) our backward's kernel time per unit of work
rises while cuDNN's does not, and Nsight Compute saw our kernels there at
1.65-1.69 GHz against 1.80 at B2 S8192. This script asks the card directly:
`nvidia-smi` sampled every 100 ms (read-only queries; the card's settings are
left alone) while one implementation is called in a loop, the first second
of each phase dropped as ramp-up. Throughput is host wall clock over the
phase (calls x FLOPs / seconds), so launch gaps and the small XLA kernels
count; it is for comparing the columns, not a kernel time.

Usage (on the GPU machine, from the repository root):
    python3 tools/power_draw.py [--only SUBSTRING] [--seconds 6] [--repeats 2]
        [--config key=value,... (repeatable: one column per config)] [--tag NAME]
Cases are bench_backward.py's (without --only: the B1 S16384 H16 D128 rows). Writes benchmarks/results/power[-NAME]-<device>-<date>.json
(or $OUT/ when OUT is set) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import jax

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # fa4_jax
sys.path.insert(0, os.path.join(REPO, "benchmarks"))  # bench_backward's cases, bench_common
import bench_backward  # noqa: E402
import bench_common  # noqa: E402

SAMPLE_MS = 100
RAMP_SECONDS = 1.0
# Bits of nvidia-smi's clocks_event_reasons.active (NVML's clocks event reasons).
REASONS = {0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x20: "sw_thermal",
           0x40: "hw_thermal", 0x80: "hw_power_brake"}
FIELDS = ("power.draw", "clocks.sm", "temperature.gpu")
REASON_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")


def _smi_command(fields, *extra):
  """nvidia-smi asking GPU 0 for `fields` as bare CSV values."""
  return ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits",
          "-i", "0", *extra]


def _query(fields):
  return subprocess.run(_smi_command(fields), capture_output=True, text=True, check=False)


def reason_field() -> str:
  """The clock-reason field this driver knows (renamed in newer drivers)."""
  for field in REASON_FIELDS:
    if _query([field]).returncode == 0:
      return field
  raise RuntimeError("nvidia-smi knows neither of " + ", ".join(REASON_FIELDS))


class Sampler:
  """`with Sampler(fields) as s:` samples nvidia-smi every SAMPLE_MS until the
  block ends; `s.samples` is then a list of (seconds since start, {field: value})."""

  def __init__(self, fields):
    self.fields = list(fields)

  def __enter__(self):
    self._file = tempfile.TemporaryFile(mode="w+")
    self._proc = subprocess.Popen(_smi_command(["timestamp", *self.fields], f"-lms={SAMPLE_MS}"),
                                  stdout=self._file, stderr=subprocess.DEVNULL, text=True)
    return self

  def __exit__(self, *exc):
    self._proc.terminate()
    self._proc.wait()
    self._file.seek(0)
    lines = [line.strip() for line in self._file if line.strip()]
    self._file.close()
    self.samples, first = [], None
    for line in lines:
      stamp, *values = [v.strip() for v in line.split(",")]
      if len(values) != len(self.fields):
        continue
      t = datetime.datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f").timestamp()
      first = t if first is None else first
      self.samples.append((t - first, dict(zip(self.fields, values))))
    return False


def _number(text):
  """A sampled value; NaN where nvidia-smi printed e.g. "[N/A]"."""
  try:
    return float(text)
  except ValueError:
    return float("nan")


def summarize(samples, reason_key):
  steady = [s for t, s in samples if t >= RAMP_SECONDS] or [s for _, s in samples]
  power = [_number(s["power.draw"]) for s in steady]
  clock = [_number(s["clocks.sm"]) for s in steady]
  temp = [_number(s["temperature.gpu"]) for s in steady]
  bits = [int(s[reason_key], 16) for s in steady if s[reason_key].startswith("0x")]
  reasons = {name: sum(1 for b in bits if b & bit) / max(len(bits), 1)
             for bit, name in REASONS.items() if any(b & bit for b in bits)}
  return dict(samples=len(steady), power_w_mean=statistics.fmean(power),
              power_w_max=max(power), sm_mhz_median=statistics.median(clock),
              sm_mhz_min=min(clock), temp_c_max=max(temp), limit_reasons=reasons)


def run_for(f, args, seconds, batch=8):
  """(calls, seconds) of calling f back to back for about `seconds`."""
  calls, start = 0, time.perf_counter()
  while time.perf_counter() - start < seconds:
    for _ in range(batch):
      result = f(*args)
      calls += 1
    jax.block_until_ready(result)
  return calls, time.perf_counter() - start


def main():
  ap = argparse.ArgumentParser()
  bench_common.add_case_options(ap)
  ap.add_argument("--config", action="append", default=None)
  ap.add_argument("--seconds", type=float, default=6.0, help="length of one phase")
  ap.add_argument("--repeats", type=int, default=2, help="phases per column, interleaved")
  args = ap.parse_args()
  overrides = args.config or [""]

  device = jax.devices()[0]
  print(device.device_kind, jax.__version__, flush=True)
  reason_key = reason_field()
  limit = _query(["power.limit", "clocks.max.sm"]).stdout.strip()
  print("power.limit, clocks.max.sm:", limit, flush=True)
  rows = []
  for case in bench_common.selected(bench_backward.CASES, args.only or ["B1 S16384 H16 D128"]):
    name, B, S, Hq, _, D, causal, window_left, _ = case
    setup = bench_backward.CaseSetup(case, overrides)
    fl = bench_backward.flops(B, S, Hq, D, causal, window_left)
    row = dict(case=name, phases=[])
    for impl, f, f_args in setup.impls:
      jax.block_until_ready(f(*f_args))  # compile outside the phases
    for rep in range(args.repeats):
      for impl, f, f_args in setup.impls:
        with Sampler(FIELDS + (reason_key,)) as sampler:
          calls, seconds = run_for(f, f_args, args.seconds)
        phase = dict(impl=impl, repeat=rep, calls=calls, seconds=seconds,
                     wall_tflops=calls * fl / seconds / 1e12,
                     **summarize(sampler.samples, reason_key))
        print(json.dumps(phase), flush=True)
        row["phases"].append(phase)
    rows.append(row)

  path = bench_common.result_path("power", device.device_kind, args.tag)
  meta = dict(device=device.device_kind, jax=jax.__version__,
              date=datetime.date.today().isoformat(), power_limit_and_max_sm_clock=limit,
              method=(f"nvidia-smi every {SAMPLE_MS} ms while one implementation runs back "
                      f"to back for {args.seconds} s (first {RAMP_SECONDS} s dropped); "
                      f"{args.repeats} interleaved phases per column; wall-clock TFLOP/s "
                      "at 2.5x forward FLOPs"),
              rows=rows)
  with open(path, "w") as fh:
    json.dump(meta, fh, indent=1)
  print(markdown(rows))
  print("wrote", path)


def markdown(rows):
  lines = ["| case | impl | wall TFLOP/s | power W (mean) | SM MHz (median) | max °C | power-cap samples |",
           "|---|---|---|---|---|---|---|"]
  for r in rows:
    for p in r["phases"]:
      cap = p["limit_reasons"].get("sw_power_cap", 0.0)
      lines.append(f"| {r['case']} | {p['impl']} | {p['wall_tflops']:.0f} | "
                   f"{p['power_w_mean']:.0f} | {p['sm_mhz_median']:.0f} | "
                   f"{p['temp_c_max']:.0f} | {100 * cap:.0f} % |")
  return "\n".join(lines)


if __name__ == "__main__":
  main()
