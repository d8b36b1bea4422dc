"""Pieces every benchmark script shares: a wall-clock timer, the CUPTI
kernel timer, a kernel-span timer, where results go, the options that pick
cases and name a run, and the sweep's GPU shapes (which `bench_forward.py
--short` reuses). The scripts import this module; it imports none of them."""

from __future__ import annotations

import dataclasses
import datetime
import glob
import os
import statistics
import tempfile
import time

import jax

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

ITERATIONS = 10  # calls per CUPTI measurement


def kernel_ms(f, *args) -> float:
  """CUPTI kernel time of `f(*args)`, median of ITERATIONS calls, summing
  every kernel a call launches (jax's Mosaic GPU profiler; GPU only)."""
  import numpy as np
  from jax.experimental.mosaic.gpu import profiler

  _, times = profiler.measure(f, iterations=ITERATIONS)(*args)
  return float(np.median(times))


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


def kernel_medians(f, args, iterations: int = ITERATIONS):
  """(span, [(name, start, duration)]) of `f(*args)`, milliseconds: medians
  over `iterations` calls (`trace_spans`), kernel by kernel (every call
  launches the same kernels in the same order)."""
  calls = trace_spans(f, args, iterations)
  kernels = [(name, statistics.median(c[1][i][1] for c in calls),
              statistics.median(c[1][i][2] for c in calls))
             for i, (name, _, _) in enumerate(calls[0][1])]
  return statistics.median(span for span, _ in calls), kernels


def span_ms(f, *args) -> float:
  """Median kernel span of `f(*args)` over ITERATIONS calls (`trace_spans`)."""
  return statistics.median(span for span, _ in trace_spans(f, args, ITERATIONS))


def kernel_sum_ms(f, *args) -> float:
  """Sum of the kernel durations of a call in a profiler trace (CUPTI
  underneath), median over ITERATIONS calls: `kernel_ms` without
  `profiler.measure`, which drops activity records on some calls (the
  packed forward, whose small XLA kernels come with it)."""
  calls = trace_spans(f, args, ITERATIONS)
  return statistics.median(sum(d for _, _, d in kernels) for _, kernels in calls)


def prepare_traced(fwd, q, k, v, do, operands=()):
  """(time the forward, time the backward) of `fwd(q, k, v, *operands)`,
  compiled and run once: the forward's kernel-duration sum and the VJP's
  kernel span in profiler traces, in milliseconds. `operands` (a bias, a
  mask, a block mask) are arguments of the jitted call, not constants in its
  program: a closure over an S x S bias would embed gigabytes in the HLO."""
  fwd = jax.jit(fwd)
  jax.block_until_ready(fwd(q, k, v, *operands))
  _, vjp = jax.vjp(lambda q, k, v: fwd(q, k, v, *operands), q, k, v)
  bwd = jax.jit(lambda vjp, do: vjp(do))
  jax.block_until_ready(bwd(vjp, do))
  return (lambda: kernel_sum_ms(fwd, q, k, v, *operands)), (lambda: span_ms(bwd, vjp, do))


def forward_backward_columns(impls, q, k, v, do, rounds: int, flops, operands=()):
  """Training columns side by side: `impls` maps a column to forward(q, k,
  v, *operands); `flops(column)` is its forward's FLOP count.

  Each is compiled with its VJP (`prepare_traced`; a failure is recorded,
  not raised), then timed in `rounds` interleaved rounds (A B C A B C ...:
  the card's clock drifts under its power cap, so each column's median
  round is compared). Returns column -> dict(fwd_ms, bwd_ms, fwd_tflops,
  bwd_tflops, fwd_ms_rounds, bwd_ms_rounds) or dict(error=...)."""
  timers, results = {}, {}
  for column, fwd in impls.items():
    try:
      timers[column] = prepare_traced(fwd, q, k, v, do, operands)
    except Exception as e:  # one failure should not hide the rest
      results[column] = dict(error=f"{type(e).__name__}: {str(e)[:400]}")
  times = {column: [] for column in timers}
  for _ in range(rounds):
    for column, (time_fwd, time_bwd) in timers.items():
      times[column].append((time_fwd(), time_bwd()))
  for column in timers:
    fwd_ms = statistics.median(f for f, _ in times[column])
    bwd_ms = statistics.median(b for _, b in times[column])
    results[column] = dict(fwd_ms=fwd_ms, bwd_ms=bwd_ms,
                           fwd_tflops=flops(column) / fwd_ms / 1e9,
                           bwd_tflops=BACKWARD_FLOPS_FACTOR * flops(column) / bwd_ms / 1e9,
                           fwd_ms_rounds=[f for f, _ in times[column]],
                           bwd_ms_rounds=[b for _, b in times[column]])
  return results


def bandwidth_columns(calls, rounds: int, nbytes: int, reference: str, timer=None):
  """Memory-bound columns side by side: `calls` maps a column to (f, args).

  Each is jitted and run once (a failure is recorded, not raised), then
  timed in `rounds` interleaved rounds (`timer`, default `kernel_sum_ms`:
  profiler traces; `kernel_ms` is CUPTI's own sum, which cannot share a
  process with traces: its activity records are dropped). Returns column ->
  dict(ms, tb_per_s = nbytes / time, max_abs_diff from the `reference`
  column's output, ms_rounds) or dict(error=...)."""
  import jax.numpy as jnp

  compiled, outs, results = {}, {}, {}
  for column, (f, args) in calls.items():
    try:
      f = jax.jit(f)
      outs[column] = jax.block_until_ready(f(*args))
      compiled[column] = (f, args)
    except Exception as e:  # one failure should not hide the rest
      results[column] = dict(error=f"{type(e).__name__}: {str(e)[:300]}")
  times = {column: [] for column in compiled}
  for _ in range(rounds):
    for column, (f, args) in compiled.items():
      times[column].append((timer or kernel_sum_ms)(f, *args))
  want = outs.get(reference)
  for column, out in outs.items():
    ms = statistics.median(times[column])
    diff = None if want is None else float(
        jnp.abs(out.astype(jnp.float32) - want.astype(jnp.float32)).max())
    results[column] = dict(ms=ms, tb_per_s=nbytes / ms / 1e9,
                           **{f"max_abs_diff_vs_{reference.replace(' ', '_')}": diff},
                           ms_rounds=times[column])
  return results


def result_path(prefix: str, device_kind: str, tag: str = "") -> str:
  """`<dir>/<prefix>[-<tag>]-<device>-<date>.json`, the folder created if
  needed: $OUT when set (the GPU machine's folder that comes back), else
  benchmarks/results."""
  out_dir = os.environ.get("OUT") or RESULTS_DIR
  os.makedirs(out_dir, exist_ok=True)
  kind = device_kind.replace(" ", "_")
  name = "-".join(filter(None, [prefix, tag, kind, datetime.date.today().isoformat()]))
  return os.path.join(out_dir, f"{name}.json")


def write_results(prefix: str, device_kind: str, tag: str, method: str, rows,
                  path: str | None = None, **extra) -> str:
  """Writes a benchmark's rows with what they were measured on and how
  (device, jax version, date, `method`, any `extra` fields) to `path`, by
  default `result_path(prefix, device_kind, tag)`; prints where."""
  import json

  path = path or result_path(prefix, device_kind, tag)
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  meta = dict(device=device_kind, jax=jax.__version__, date=datetime.date.today().isoformat(),
              method=method, **extra, rows=rows)
  with open(path, "w") as fh:
    json.dump(meta, fh, indent=1)
  print("wrote", path)
  return path


def table_cell(column, fmt) -> str:
  """A Markdown cell of one result column: "-" where the column is absent,
  "error" where it failed, else `fmt(column)`."""
  if column is None:
    return "-"
  return "error" if "error" in column else fmt(column)


def table_main(prefix: str, cases, rows_of, markdown, method, *, default_rounds: int = 1,
               add_arguments=None) -> None:
  """The command line of a benchmark that prints a Markdown table and writes
  its rows: --only and --tag (`add_case_options`), --rounds, and the
  script's own arguments (`add_arguments(parser)`). `rows_of(case, args)`:
  the rows of one selected case; `markdown(rows)`: the table;
  `method(args)`: how the rows were measured (the JSON's `method`)."""
  import argparse

  ap = argparse.ArgumentParser()
  add_case_options(ap)
  ap.add_argument("--rounds", type=int, default=default_rounds,
                  help="measure every column this many times, interleaved; report medians")
  if add_arguments is not None:
    add_arguments(ap)
  args = ap.parse_args()
  device = jax.devices()[0]
  print(device.device_kind, jax.__version__, flush=True)
  rows = []
  for case in selected(cases, args.only):
    rows += rows_of(case, args)
    print(markdown(rows[-1:]), flush=True)
    # Rewritten after every case: a run stopped at its time limit keeps what it measured.
    write_results(prefix, device.device_kind, args.tag, method(args), rows)
  print(markdown(rows))


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


# ----------------------------------------------------------------------------
# The GPU sweep's shapes (sweep.py; bench_forward.py --short takes S <= 4096).

TOKENS_PER_CALL = 32768  # B * S
WIDTH = 2048  # H * D (query heads)
SEQ_LENS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
HEAD_DIMS = (64, 128, 256)
GQA_HEAD_DIM, GQA_Q_HEADS, GQA_KV_HEADS = 128, 16, 4
BACKWARD_FLOPS_FACTOR = 2.5  # backward FLOPs / forward FLOPs


@dataclasses.dataclass(frozen=True)
class Case:
  B: int
  S: int
  Hq: int
  Hkv: int
  D: int
  causal: bool

  @property
  def name(self) -> str:
    heads = f"H{self.Hq}" if self.Hq == self.Hkv else f"H{self.Hq}/{self.Hkv}"
    return f"B{self.B} S{self.S} {heads} D{self.D}" + (" causal" if self.causal else "")

  @property
  def group(self) -> str:
    """Which plot the case belongs to: one per head dim, GQA on its own."""
    return f"D{self.D}" + ("" if self.Hq == self.Hkv else f"-GQA{self.Hq}-{self.Hkv}")

  def flops(self, pass_name: str) -> float:
    forward = 4 * self.B * self.Hq * self.S * self.S * self.D / (2 if self.causal else 1)
    return forward if pass_name == "forward" else forward * (1 + BACKWARD_FLOPS_FACTOR)


def gpu_cases(quick: bool) -> list[Case]:
  if quick:  # a few shapes: short and long, causal and not, one GQA
    return [Case(TOKENS_PER_CALL // s, s, 16, 16, 128, c)
            for s in (1024, 8192) for c in (False, True)] + [
                Case(TOKENS_PER_CALL // 8192, 8192, GQA_Q_HEADS, GQA_KV_HEADS,
                     GQA_HEAD_DIM, True)]
  cases = []
  for d in HEAD_DIMS:
    for s in SEQ_LENS:
      for c in (False, True):
        cases.append(Case(TOKENS_PER_CALL // s, s, WIDTH // d, WIDTH // d, d, c))
  for s in SEQ_LENS:
    for c in (False, True):
      cases.append(Case(TOKENS_PER_CALL // s, s, GQA_Q_HEADS, GQA_KV_HEADS,
                        GQA_HEAD_DIM, c))
  return cases
