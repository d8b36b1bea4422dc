"""First-call (compile) time of attention, forward and `jax.grad`, one fresh process each.

Issue #28: every new shape (bucketed sequence lengths, an eval and a train
batch) pays a first call: trace, lower, compile, run. Columns, each measured
in its own child process so that no cache of one measurement helps another:

* `fa4_jax`: `fa4_jax.attention(implementation=None)`, the heuristics'
  kernels;
* `cudnn`: `jax.nn.dot_product_attention(implementation="cudnn")` (no
  segment ids: the packed row has none);
* `tokamax`: tokamax 0.0.17's Mosaic GPU attention, where installed (no
  segment ids either);
* `fa4_jax cached`: fa4_jax in a second process with JAX's persistent
  compilation cache (`jax_compilation_cache_dir`, every entry kept): one
  process fills the cache (`cache_write`), the next reads it. Tracing and
  lowering still run there (the cache key is the lowered module); the
  compile becomes a cache read.

`--new-shape`: instead, the cost of a shape a warm process has not seen
(bucketed lengths, an eval batch): each child first runs the whole first
call at half the sequence length, then measures the case's shape
(columns `fa4_jax new shape`, `cudnn new shape`, `tokamax new shape`).

Before the clock each child imports the library it measures with its
kernel modules (fa4_jax: `fa4_jax.kernels.sm90_forward` and
`sm90_backward`, which import Pallas' Mosaic GPU; tokamax: its Mosaic GPU
attention op), which a process does once whatever its shapes; `import_s`
records it. (Until 2026-11-27 fa4_jax's kernel modules were imported inside
its `trace_s`, tokamax's before the clock.)

Per measurement: `trace_s` (`jax.jit(f).trace`: Python, including our
kernel bodies), `lower_s` (`.lower()`: Pallas -> Mosaic GPU MLIR, Mosaic's
layout inference and lowering, StableHLO), `compile_s` (`.compile()`: XLA,
and for the Mosaic GPU custom calls LLVM and ptxas), `run_s` (the first call
of the compiled function, to its result), `total_s` (their sum), and
`events`: JAX's own compile-stage durations (`jax.monitoring`), summed by
name; for fa4_jax, `compile_ahead_timeline`: when each kernel's compile was
queued, started and finished on its worker thread and how long jax's compile
waited for them, in seconds from the start of the first call. The `layers`
rows call attention 4 times in one jit (same shape, as a model whose layers
are not scanned): the kernels are traced and lowered once, not once per call
site (`fa4_jax.kernels.build_cache`).

`--cpu`: no GPU needed; each child cross-lowers for CUDA with the arch set to
sm_90 (`fa4_jax.testing`), so only trace_s and lower_s are measured (on this
machine's CPU), and only the fa4_jax column runs. For trying the script and
for profiling the Python side.

Usage (GPU machine, repository root; about 6 minutes on an H100, --quick 2):
    python3 benchmarks/bench_compile.py [--quick] [--new-shape] [--only SUBSTRING]
        [--tag NAME] [--out PATH] [--budget-s 420] [--cpu]
Writes benchmarks/results/compile[-new-shape][-NAME]-<device>-<date>.json (or $OUT/, or
--out) and prints a Markdown table for BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

import bench_common  # noqa: E402  (this folder is on sys.path when run as a script)

# (name, B, S, Hq, Hkv, D, causal, segments): bf16. `segments`: two packed
# documents per row (segment ids).
CASES = [
    ("B2 S4096 H16 D128", 2, 4096, 16, 16, 128, False, False),
    ("B2 S4096 H16 D128 causal", 2, 4096, 16, 16, 128, True, False),
    ("B2 S4096 H16 D64", 2, 4096, 16, 16, 64, False, False),
    ("B2 S4096 H16 D256 causal", 2, 4096, 16, 16, 256, True, False),
    ("B2 S4096 H16/4 D128 (GQA) causal", 2, 4096, 16, 4, 128, True, False),
    ("B2 S4096 H16 D128 causal segment ids", 2, 4096, 16, 16, 128, True, True),
]
QUICK = ("B2 S4096 H16 D128", "B2 S4096 H16 D128 causal")
# The rows whose fa4_jax column is also measured with the persistent cache.
CACHED = QUICK
# Attention calls in one jit for the `layers` rows (fa4_jax only).
LAYERS = 4
LAYERS_CASE = "B2 S4096 H16 D128 causal"
PASSES = ("forward", "grad")
# fa4_jax without `fa4_jax.kernels.compile_ahead` (FA4_JAX_COMPILE_AHEAD=0):
# XLA compiles the kernels one after another, as before 2026-11-27.
SERIAL_COLUMN = "fa4_jax serial compile"
CHILD_TIMEOUT_S = 150


# ---------------------------------------------------------------------------
# The child: one measurement in a fresh process.


def _attention(column: str, causal: bool, segments: bool):
  """attention(q, k, v) of `column`."""
  import jax
  import jax.numpy as jnp

  if column in ("fa4_jax", SERIAL_COLUMN):
    import fa4_jax
    import fa4_jax.kernels.sm90_backward  # noqa: F401  (imported once per process:
    import fa4_jax.kernels.sm90_forward  # noqa: F401   before the clock, as tokamax's op)

    def ours(q, k, v):
      options = {}
      if segments:  # two documents per row, split in the middle
        ids = (jnp.arange(q.shape[1]) >= q.shape[1] // 2).astype(jnp.int32)
        ids = jnp.broadcast_to(ids, q.shape[:2])
        options = dict(query_segment_ids=ids, key_value_segment_ids=ids)
      return fa4_jax.attention(q, k, v, is_causal=causal, **options)
    return ours
  if segments:
    raise NotImplementedError(f"{column} has no segment ids")
  if column == "cudnn":
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal,
                                                        implementation="cudnn")
  if column == "tokamax":
    from tokamax._src.ops.attention import pallas_mosaic_gpu as tokamax_gpu
    op = tokamax_gpu.PallasMosaicGpuFlashAttention()
    return lambda q, k, v: op(q, k, v, is_causal=causal)
  raise ValueError(column)


def _function(spec: dict):
  """The measured function of (q, k, v): the forward, or the gradient of
  the output's sum with respect to q, k and v; `layers` calls in a row."""
  import jax
  import jax.numpy as jnp

  attend = _attention(spec["column"], spec["causal"], spec["segments"])

  def forward(q, k, v):
    out = q
    for _ in range(spec["layers"]):
      out = attend(out, k, v)
    return out

  if spec["pass"] == "forward":
    return forward
  loss = lambda q, k, v: forward(q, k, v).astype(jnp.float32).sum()
  return jax.grad(loss, argnums=(0, 1, 2))


def _operands(spec: dict, concrete: bool):
  import jax
  import jax.numpy as jnp

  B, S, Hq, Hkv, D = (spec[n] for n in ("B", "S", "Hq", "Hkv", "D"))
  shapes = [(B, S, Hq, D), (B, S, Hkv, D), (B, S, Hkv, D)]
  if not concrete:
    return [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in shapes]
  keys = jax.random.split(jax.random.key(0), 3)
  return jax.block_until_ready([jax.random.normal(key, s, jnp.bfloat16)
                                for key, s in zip(keys, shapes)])


def _events_listener(into: dict):
  """Sums JAX's duration events (trace, lowering, backend compile, cache
  reads) by name while the measurement runs."""
  import jax

  def listen(event, duration, **_):
    into[event] = into.get(event, 0.0) + duration
  jax.monitoring.register_event_duration_secs_listener(listen)


def measure(spec: dict) -> dict:
  """Runs in the child: stage times of the first call described by `spec`."""
  import jax

  if spec.get("cache_dir"):
    jax.config.update("jax_compilation_cache_dir", spec["cache_dir"])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  cpu = spec["cpu"]
  # Backend start-up and the operands' own small programs, before the clock.
  args = _operands(spec, concrete=not cpu)
  start = time.perf_counter()
  fn = _function(spec)
  import_s = time.perf_counter() - start
  if spec.get("warm_up_seq"):  # a first call at another shape, before the clock
    warm_spec = dict(spec, S=spec["warm_up_seq"])
    _first_call(_function(warm_spec), _operands(warm_spec, concrete=not cpu), cpu)
  events: dict = {}
  _events_listener(events)
  result = {"import_s": import_s}
  clock = _StageClock(result)
  origin = clock.wall
  lowered = _first_call(fn, args, cpu, stage=clock.stage)
  result["total_s"] = sum(result[f"{k}_s"] for k in clock.stages)
  result["events"] = {k: round(v, 4) for k, v in sorted(events.items())}
  result["mosaic_gpu_kernels"] = lowered.as_text().count("custom_call @mosaic_gpu")
  if spec["column"].startswith("fa4_jax"):
    from fa4_jax.kernels import compile_ahead
    result["compiled_ahead"] = compile_ahead.outcomes()
    # Seconds from the start of the first call: when each kernel's compile was
    # queued, started, finished on its worker; when jax's compile waited.
    result["compile_ahead_timeline"] = compile_ahead.timeline(since=origin)
  return result


def _first_call(fn, args, cpu: bool, stage=lambda name: None):
  """Traces, lowers, compiles and runs `fn(*args)` (with `cpu`: cross-lowers
  for sm_90 and stops there), calling `stage(name)` after each step; returns
  the lowered program."""
  import jax

  with _cross_lowering() if cpu else _nothing():
    traced = jax.jit(fn).trace(*args)
    stage("trace")
    lowered = traced.lower(lowering_platforms=("cuda",)) if cpu else traced.lower()
    stage("lower")
    if not cpu:
      compiled = lowered.compile()
      stage("compile")
      jax.block_until_ready(compiled(*args))
      stage("run")
  return lowered


class _StageClock:
  """Writes `<stage>_s` (wall clock) and `<stage>_cpu_s` (this process's CPU
  time, all threads: above the wall time where XLA compiles in parallel,
  below it where the process waits) since the previous stage into `into`."""

  def __init__(self, into: dict):
    self.into, self.stages = into, []
    self.wall, self.cpu = time.perf_counter(), time.process_time()

  def stage(self, name: str) -> None:
    wall, cpu = time.perf_counter(), time.process_time()
    self.into[f"{name}_s"], self.into[f"{name}_cpu_s"] = wall - self.wall, cpu - self.cpu
    self.stages.append(name)
    self.wall, self.cpu = wall, cpu


def _nothing():
  import contextlib
  return contextlib.nullcontext()


def _cross_lowering():
  """--cpu: fa4_jax picks and lowers its sm90 kernels as on an H100."""
  import contextlib
  from unittest import mock

  from fa4_jax import backends, testing

  stack = contextlib.ExitStack()
  stack.enter_context(mock.patch.object(backends, "device_arch_major", lambda: 9))
  stack.enter_context(testing._target_arch("sm_90"))
  return stack


def child_main(spec_json: str) -> None:
  spec = json.loads(spec_json)
  try:
    result = measure(spec)
  except Exception as e:  # reported in the row, not raised
    result = dict(error=f"{type(e).__name__}: {str(e)[:400]}")
  print("RESULT " + json.dumps(result), flush=True)


# ---------------------------------------------------------------------------
# The parent: one child per measurement.


def run_child(spec: dict) -> dict:
  env = dict(os.environ)
  if spec["cpu"]:
    env["JAX_PLATFORMS"] = "cpu"
  if spec["column"] == SERIAL_COLUMN:
    env["FA4_JAX_COMPILE_AHEAD"] = "0"
  if spec.get("dump_to"):  # Mosaic GPU writes each kernel's PTX there
    env.update(MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_DUMP_TO=spec["dump_to"])
  try:
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)],
                          capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env=env)
  except subprocess.TimeoutExpired:
    return dict(error=f"timed out after {CHILD_TIMEOUT_S} s")
  for line in proc.stdout.splitlines():
    if line.startswith("RESULT "):
      return json.loads(line[len("RESULT "):])
  return dict(error=f"child exited {proc.returncode}: {proc.stderr[-400:]}")


def columns_for(case, cpu: bool) -> list[str]:
  """The libraries measured for `case`: tokamax only where installed."""
  segments = case[7]
  if cpu:
    return ["fa4_jax"]
  others = [] if segments else ["cudnn"] + (["tokamax"] if tokamax_installed() else [])
  return ["fa4_jax", SERIAL_COLUMN] + others


def tokamax_installed() -> bool:
  import importlib.util
  return importlib.util.find_spec("tokamax") is not None


def plan(cases, cpu: bool, with_layers: bool, new_shape: bool = False):
  """(row name, pass, column, spec) of every measurement, in order."""
  out = []
  for name, B, S, Hq, Hkv, D, causal, segments in cases:
    base = dict(B=B, S=S, Hq=Hq, Hkv=Hkv, D=D, causal=causal, segments=segments, cpu=cpu,
                layers=1)
    columns = columns_for((name, B, S, Hq, Hkv, D, causal, segments), cpu)
    if new_shape:
      for pass_name in PASSES:
        for column in columns:
          out.append((name, pass_name, f"{column} new shape",
                      dict(base, column=column, warm_up_seq=S // 2, **{"pass": pass_name})))
      continue
    for pass_name in PASSES:
      for column in columns:
        out.append((name, pass_name, column, dict(base, column=column, **{"pass": pass_name})))
      if name in CACHED:
        spec = dict(base, column="fa4_jax", **{"pass": pass_name})
        out.append((name, pass_name, "fa4_jax cached", dict(spec, cache_dir="")))
        if not cpu:
          out.append((name, pass_name, "fa4_jax ptxas", dict(spec, dump_to="")))
      if with_layers and name == LAYERS_CASE:
        out.append((f"{name} x{LAYERS} layers", pass_name, "fa4_jax",
                    dict(base, column="fa4_jax", layers=LAYERS, **{"pass": pass_name})))
  return out


def run_cached(spec: dict) -> dict:
  """The second of two processes sharing a fresh persistent cache."""
  with tempfile.TemporaryDirectory() as folder:
    spec = dict(spec, cache_dir=folder)
    write = run_child(spec)
    if "error" in write:
      return dict(error="cache_write: " + write["error"])
    read = run_child(spec)
    entries = len(os.listdir(folder))
  return dict(read, cache_write=write, cache_entries=entries)


def find_ptxas() -> str | None:
  """A ptxas binary: on PATH, in jax's CUDA root, or in the nvidia-cuda-nvcc wheel."""
  import shutil

  found = shutil.which("ptxas")
  if found:
    return found
  roots = [os.path.join(p, "nvidia", "cuda_nvcc") for p in sys.path if p]
  try:
    from jax._src import lib
    roots.insert(0, lib.cuda_path or "")
  except Exception:  # the plugin's layout changed: PATH and sys.path only
    pass
  for root in roots:
    candidate = os.path.join(root, "bin", "ptxas")
    if root and os.access(candidate, os.X_OK):
      return candidate
  return None


def run_ptxas(spec: dict) -> dict:
  """fa4_jax's first call once more, its kernels' PTX dumped, then ptxas
  (sm_90a, default -O3) timed on each: roughly the ptxas share of
  compile_s (Mosaic GPU's own flags may differ)."""
  ptxas = find_ptxas()
  if ptxas is None:
    return dict(error="no ptxas found")
  with tempfile.TemporaryDirectory() as folder:
    result = run_child(dict(spec, dump_to=folder))
    if "error" in result:
      return result
    times = {}
    for name in sorted(os.listdir(folder)):
      if not name.endswith(".ptx"):
        continue
      start = time.perf_counter()
      proc = subprocess.run([ptxas, "-arch=sm_90a", os.path.join(folder, name),
                             "-o", os.path.join(folder, name + ".cubin")],
                            capture_output=True, text=True)
      times[name] = round(time.perf_counter() - start, 3)
      if proc.returncode:
        return dict(error=f"ptxas failed on {name}: {proc.stderr[-300:]}")
  return dict(result, ptxas=ptxas, ptxas_s=sum(times.values()), ptxas_per_kernel_s=times)


def markdown(rows) -> str:
  columns = ["fa4_jax", SERIAL_COLUMN, "fa4_jax cached", "cudnn", "tokamax", "fa4_jax ptxas"]
  if any(r["column"].endswith(" new shape") for r in rows):
    columns = ["fa4_jax new shape", SERIAL_COLUMN + " new shape", "cudnn new shape", "tokamax new shape"]
  lines = ["| case | pass | " + " | ".join(columns) + " |",
           "|" + "---|" * (len(columns) + 2)]

  def cell(x):
    if x is None:
      return "-"
    if "error" in x:
      return "error"
    if "ptxas_s" in x:
      return f"{x['ptxas_s']:.2f}"
    stages = "/".join(f"{x[k]:.2f}" for k in ("trace_s", "lower_s", "compile_s", "run_s")
                      if k in x)
    return f"**{x['total_s']:.2f}** ({stages})"
  by_case = collections.OrderedDict()
  for r in rows:
    by_case.setdefault((r["case"], r["pass"]), {})[r["column"]] = r
  for (case, pass_name), cols in by_case.items():
    lines.append(f"| {case} | {pass_name} | " + " | ".join(cell(cols.get(c)) for c in columns)
                 + " |")
  return "\n".join(lines)


def main():
  ap = argparse.ArgumentParser()
  bench_common.add_case_options(ap)
  ap.add_argument("--quick", action="store_true",
                  help="only the D128 dense and causal rows, no layers row")
  ap.add_argument("--cpu", action="store_true",
                  help="cross-lower on the CPU (trace and lower only, fa4_jax only)")
  ap.add_argument("--new-shape", action="store_true",
                  help="a shape new to a warm process (after a first call at S/2) instead")
  ap.add_argument("--out", default=None, help="the JSON file to write")
  ap.add_argument("--budget-s", type=float, default=420.0,
                  help="start no measurement after this many seconds (the rest are skipped)")
  ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.child is not None:
    child_main(args.child)
    return
  import jax

  device = "cpu (cross-lowering for sm_90)" if args.cpu else jax.devices()[0].device_kind
  print(device, jax.__version__, flush=True)
  cases = [c for c in CASES if not args.quick or c[0] in QUICK]
  cases = bench_common.selected(cases, args.only)
  started = time.perf_counter()
  rows = []
  for case, pass_name, column, spec in plan(cases, args.cpu, with_layers=not args.quick,
                                            new_shape=args.new_shape):
    if time.perf_counter() - started > args.budget_s:
      print(f"budget spent: skipped {case} {pass_name} {column}", flush=True)
      continue
    if "cache_dir" in spec:
      result = run_cached(spec)
    elif "dump_to" in spec:
      result = run_ptxas(spec)
    else:
      result = run_child(spec)
    row = dict(case=case, column=column, **{"pass": pass_name},
               **{k: v for k, v in spec.items()
                  if k not in ("column", "pass", "cache_dir", "dump_to")},
               **result)
    rows.append(row)
    print(json.dumps(row), flush=True)
  print(markdown(rows))
  bench_common.write_results(
      "compile-new-shape" if args.new_shape else "compile", device, args.tag,
      ("one fresh process per measurement, the library and its kernel modules "
       "imported before the clock (import_s); with --new-shape a first call at S/2 "
       "before the clock; trace/lower/compile via "
       "jax.jit(f).trace(...).lower().compile(), run = first call of the "
       "compiled function to its result; `fa4_jax cached`: the second of two "
       "processes sharing a persistent compilation cache"),
      rows, path=args.out, wall_s=time.perf_counter() - started)


if __name__ == "__main__":
  main()
