"""One sweep: fa4_jax.attention against jax.nn.dot_product_attention (cuDNN, XLA).

    python benchmarks/sweep.py [--quick] [--only REGEX] [--out DIR]

On a GPU (the real sweep), in one process, for every shape below:
  - implementations: `fa4_jax.attention` with `implementation=None` (what users
    get: the kernel for this GPU, else the XLA path), and
    `jax.nn.dot_product_attention` with `implementation="cudnn"` and `"xla"`;
  - passes: forward, and forward+backward (one jitted call returning the
    output and dq, dk, dv);
  - time: CUPTI kernel time, median of 10 calls, summing every kernel a call
    launches (`bench_common.kernel_ms`, the method of BENCHMARKS.md);
  - FLOPs: forward 4*B*H*S^2*D, halved when causal; backward 2.5x the
    forward, so forward+backward counts 3.5x.
  Shapes: S = 512 ... 32768; head dims 64, 128, 256; causal and not; tokens
  per call fixed (B*S = 32768) and H*D = 2048 (H = 32, 16, 8); plus GQA at
  D = 128 with 16 query / 4 KV heads (the 4:1 grouping of 32/8, at H*D = 2048).
  bfloat16 inputs, standard normal, scale 1/sqrt(D).
  A case that would not fit in GPU memory (XLA's compiled memory analysis says
  so, or the run fails with out of memory), or that an implementation refuses
  (e.g. cuDNN at some head dims), is recorded as "skipped: reason"; the sweep
  goes on.

On a machine without a GPU it says so and runs a small correctness-and-speed
check instead: S = 256 ... 1024, D = 64, float32, fa4_jax.attention (its XLA
path there) against jax.nn's XLA implementation: max |error| against an f32
einsum reference (output, and dq/dk/dv), and the median wall-clock time
(block_until_ready) of the jitted call.

Writes into benchmarks/results/ (or --out DIR):
  GPU: sweep-<device>-<date>.json, .md, and -<group>.png (one per head dim);
  CPU: sweep-cpu-check-<date>.json, .md, .png.
`--quick` runs a few shapes (files get a "-quick" suffix), `--only REGEX`
keeps the cases whose name matches (suffix "-partial").

A GPU sweep can be run in parts (`--only`, e.g. one head dim per call) with
its printed output kept in logs; `--from-logs LOG [LOG ...]` then writes the
full JSON, Markdown and plots from the rows those logs hold (no GPU needed),
in the sweep's case order; a part re-run later replaces its rows when its
log comes last.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))  # the repository, for fa4_jax
sys.path.insert(0, HERE)  # this folder, for bench_common

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import fa4_jax  # noqa: E402

import bench_common  # noqa: E402

RESULTS_DIR = os.path.join(HERE, "results")

# GPU sweep shape rules: bench_common's (bench_forward.py --short reuses them).
from bench_common import (  # noqa: E402,F401  (sweep.Case, sweep.gpu_cases, ... as before)
    BACKWARD_FLOPS_FACTOR, GQA_HEAD_DIM, GQA_KV_HEADS, GQA_Q_HEADS, HEAD_DIMS, SEQ_LENS,
    TOKENS_PER_CALL, WIDTH, Case, gpu_cases)

PASSES = ("forward", "fwd+bwd")
GPU_IMPLS = ("fa4_jax", "cudnn", "jax.nn xla")
CPU_IMPLS = ("fa4_jax", "jax.nn xla")


def cpu_cases(quick: bool) -> list[Case]:
  """Small shapes a CPU handles in seconds: B*S = 1024 tokens, 4 heads of 64."""
  seq_lens = (256, 512) if quick else (256, 512, 1024)
  return [Case(1024 // s, s, 4, 4, 64, c) for s in seq_lens for c in (False, True)]


# ----------------------------------------------------------------------------
# What gets timed.

def attention_fn(impl: str, causal: bool):
  """(q, k, v) -> output, for one implementation."""
  if impl == "fa4_jax":
    return lambda q, k, v: fa4_jax.attention(q, k, v, is_causal=causal)
  nn_impl = {"cudnn": "cudnn", "jax.nn xla": "xla"}[impl]
  return lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=causal, implementation=nn_impl)


def pass_fn(attn, pass_name: str):
  """The function a pass times: forward (q, k, v) -> out, or
  forward+backward (q, k, v, dout) -> (out, dq, dk, dv)."""
  if pass_name == "forward":
    return attn

  def forward_backward(q, k, v, dout):
    out, vjp = jax.vjp(attn, q, k, v)
    return (out, *vjp(dout))
  return forward_backward


def make_inputs(case: Case, dtype):
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (case.B, case.S, case.Hq, case.D), dtype)
  k = jax.random.normal(keys[1], (case.B, case.S, case.Hkv, case.D), dtype)
  v = jax.random.normal(keys[2], (case.B, case.S, case.Hkv, case.D), dtype)
  dout = jax.random.normal(keys[3], (case.B, case.S, case.Hq, case.D), dtype)
  return q, k, v, dout


def args_for(pass_name, q, k, v, dout):
  return (q, k, v) if pass_name == "forward" else (q, k, v, dout)


# ----------------------------------------------------------------------------
# GPU sweep.

def bytes_needed(compiled) -> int | None:
  """Arguments + outputs + temporaries of a compiled call (XLA's estimate)."""
  analysis = compiled.memory_analysis()
  if analysis is None:
    return None
  return int(analysis.argument_size_in_bytes + analysis.output_size_in_bytes
             + analysis.temp_size_in_bytes)


def size(n_bytes: int) -> str:
  return f"{n_bytes / 2**30:.1f} GiB" if n_bytes >= 2**30 else f"{n_bytes / 2**20:.1f} MiB"


def short_error(e: Exception) -> str:
  return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"


def measure_gpu(fn, args, flops, timer, memory_limit):
  """One (implementation, pass) cell: {ms, tflops} or {skipped: reason}."""
  try:
    compiled = jax.jit(fn).lower(*args).compile()
  except Exception as e:  # noqa: BLE001  e.g. cuDNN refusing a head dim
    return {"skipped": f"refused: {short_error(e)}"}
  needed = bytes_needed(compiled)
  if memory_limit and needed and needed > memory_limit:
    return {"skipped": f"out of memory: needs {size(needed)}, device has {size(memory_limit)}"}
  try:
    ms = timer(compiled, *args)
  except Exception as e:  # noqa: BLE001  never let one cell end the sweep
    kind = "out of memory" if "RESOURCE_EXHAUSTED" in str(e) else "failed"
    return {"skipped": f"{kind}: {short_error(e)}"}
  return {"ms": ms, "tflops": flops / ms / 1e9}


def gpu_sweep(cases, timer=None, memory_limit=None, impls=GPU_IMPLS):
  """Rows for the GPU sweep. `timer(f, *args) -> ms` defaults to CUPTI kernel
  time (bench_common.kernel_ms); `memory_limit` to the device's bytes_limit."""
  if timer is None:
    timer = bench_common.kernel_ms
  if memory_limit is None:
    memory_limit = (jax.devices()[0].memory_stats() or {}).get("bytes_limit")
  rows = []
  for case in cases:
    q, k, v, dout = make_inputs(case, jnp.bfloat16)
    row = dict(case=case.name, group=case.group, **dataclasses.asdict(case),
               dtype="bfloat16",
               fa4_jax_served_by=fa4_jax.which_implementation(q, k, v, is_causal=case.causal))
    for impl in impls:
      attn = attention_fn(impl, case.causal)
      row[impl] = {p: measure_gpu(pass_fn(attn, p), args_for(p, q, k, v, dout),
                                  case.flops(p), timer, memory_limit)
                   for p in PASSES}
    print(json.dumps(row), flush=True)
    rows.append(row)
    del q, k, v, dout
  return rows


# ----------------------------------------------------------------------------
# CPU check.

def reference_attention(q, k, v, causal):
  """f32 attention by einsum, the naive way (GQA by repeating K/V heads)."""
  q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
  group = q.shape[2] // k.shape[2]
  k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
  logits = jnp.einsum("btnh,bsnh->bnts", q, k, precision="highest") / math.sqrt(q.shape[-1])
  if causal:
    t, s = logits.shape[-2:]
    logits = jnp.where(jnp.tril(jnp.ones((t, s), bool)), logits, -jnp.inf)
  probs = jax.nn.softmax(logits, axis=-1)
  return jnp.einsum("bnts,bsnh->btnh", probs, v, precision="highest")


def max_error(got, want) -> float:
  return max(float(jnp.max(jnp.abs(g.astype(jnp.float32) - w))) for g, w in zip(got, want))


def cpu_check(cases, repeats):
  rows = []
  for case in cases:
    q, k, v, dout = make_inputs(case, jnp.float32)
    # The reference's output and gradients, in f32 at "highest" precision.
    reference = {p: jax.jit(pass_fn(lambda q, k, v: reference_attention(q, k, v, case.causal), p))(
        *args_for(p, q, k, v, dout)) for p in PASSES}
    reference["forward"] = (reference["forward"],)
    row = dict(case=case.name, group=case.group, **dataclasses.asdict(case),
               dtype="float32",
               fa4_jax_served_by=fa4_jax.which_implementation(q, k, v, is_causal=case.causal))
    for impl in CPU_IMPLS:
      row[impl] = {}
      for p in PASSES:
        args = args_for(p, q, k, v, dout)
        compiled = jax.jit(pass_fn(attention_fn(impl, case.causal), p)).lower(*args).compile()
        got = compiled(*args)
        got = (got,) if p == "forward" else got
        ms = bench_common.wall_ms(compiled, args, repeats)
        row[impl][p] = dict(ms=ms, gflops=case.flops(p) / ms / 1e6,
                            max_err=max_error(got, reference[p]))
    print(json.dumps(row), flush=True)
    rows.append(row)
  return rows


# ----------------------------------------------------------------------------
# Output: JSON, Markdown, plots.

def cell(entry, key, fmt):
  if "skipped" in entry:
    return "skipped (" + entry["skipped"].split(":")[0] + ")"
  return format(entry[key], fmt)


def gpu_markdown(rows) -> str:
  head = ["case", "fa4_jax runs"] + [f"{i} {p}" for p in PASSES for i in GPU_IMPLS]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in rows:
    cells = [r["case"], r["fa4_jax_served_by"]]
    cells += [cell(r[i][p], "tflops", ".0f") for p in PASSES for i in GPU_IMPLS]
    lines.append("| " + " | ".join(cells) + " |")
  lines.append("")
  lines.append("TFLOP/s; forward FLOPs 4*B*H*S^2*D (halved when causal), "
               f"fwd+bwd {1 + BACKWARD_FLOPS_FACTOR}x that. Reasons for skips are in the JSON.")
  return "\n".join(lines)


def cpu_markdown(rows) -> str:
  head = ["case"] + [f"{i} {p} ms" for p in PASSES for i in CPU_IMPLS] + [
      f"{i} {p} max err" for p in PASSES for i in CPU_IMPLS]
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for r in rows:
    cells = [r["case"]]
    cells += [cell(r[i][p], "ms", ".2f") for p in PASSES for i in CPU_IMPLS]
    cells += [cell(r[i][p], "max_err", ".1e") for p in PASSES for i in CPU_IMPLS]
    lines.append("| " + " | ".join(cells) + " |")
  lines.append("")
  lines.append("Max err: largest |value - f32 einsum reference| over the output "
               "(forward) or over dq, dk, dv (fwd+bwd).")
  return "\n".join(lines)


def plot(rows, impls, key, unit, title, path):
  """Throughput against sequence length: forward and fwd+bwd panels, a line
  per implementation (colour) and mask (solid: none, dashed: causal)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
  colours = dict(zip(GPU_IMPLS, ("tab:red", "tab:blue", "tab:gray")))
  for ax, p in zip(axes, PASSES):
    for impl in impls:
      for causal in (False, True):
        points = [(r["S"], r[impl][p][key]) for r in rows
                  if r["causal"] == causal and key in r[impl][p]]
        if points:
          xs, ys = zip(*sorted(points))
          ax.plot(xs, ys, marker="o", color=colours[impl], linestyle="--" if causal else "-",
                  label=impl + (" causal" if causal else ""))
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({r["S"] for r in rows}))
    ax.set_xticklabels([f"{s // 1024}k" if s >= 1024 else str(s)
                        for s in sorted({r["S"] for r in rows})])
    ax.set_xlabel("sequence length S")
    ax.set_title("forward" if p == "forward" else "forward + backward")
    ax.grid(alpha=0.3)
  axes[0].set_ylabel(unit)
  labelled = {line.get_label(): line for ax in axes for line in ax.lines}
  if labelled:  # one legend for both panels
    axes[1].legend(labelled.values(), labelled.keys(), fontsize=8)
  fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def cpu_description() -> str:
  model = platform.processor() or platform.machine()
  try:
    with open("/proc/cpuinfo") as fh:
      model = next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
  except (OSError, StopIteration):
    pass
  return f"cpu: {model}, {os.cpu_count()} cores visible"


def git_commit() -> str | None:
  """The repository's commit, with "+dirty" when the working tree has changes."""
  try:
    run = lambda *cmd: subprocess.run(["git", "-C", HERE, *cmd], capture_output=True,
                                      text=True, check=True).stdout.strip()
    return run("rev-parse", "--short", "HEAD") + ("+dirty" if run("status", "--porcelain",
                                                                  "--untracked-files=no") else "")
  except (OSError, subprocess.CalledProcessError):
    return None


def write(out_dir, stem, meta, markdown, plots):
  """stem.json, stem.md, and each (rows, impls, key, unit, title, suffix) plot."""
  os.makedirs(out_dir, exist_ok=True)
  meta = dict(meta, commit=meta.get("commit") or git_commit())
  written = []
  path = os.path.join(out_dir, stem + ".json")
  with open(path, "w") as fh:
    json.dump(meta, fh, indent=1)
  written.append(path)
  path = os.path.join(out_dir, stem + ".md")
  with open(path, "w") as fh:
    fh.write(f"# {meta['title']}\n\n- Device: {meta['device']}\n- jax {meta['jax']}, "
             f"{meta['date']}, commit {meta['commit']}\n- Method: {meta['method']}\n\n{markdown}\n")
  written.append(path)
  try:
    import matplotlib  # noqa: F401  (optional: pip install -e '.[flax]' or '.[test]')
  except ImportError:
    print("matplotlib is not installed: no plots written (JSON and Markdown only)")
    plots = []
  for rows, impls, key, unit, title, suffix in plots:
    path = os.path.join(out_dir, stem + suffix + ".png")
    plot(rows, impls, key, unit, title, path)
    written.append(path)
  for path in written:
    print("wrote", path)


GPU_METHOD = (
    "CUPTI kernel time (jax.experimental.mosaic.gpu.profiler.measure via "
    "bench_common.kernel_ms), median of 10 calls, every kernel of a call "
    "summed; all implementations in one process; bfloat16 inputs; FLOPs "
    f"4*B*H*S^2*D halved when causal, fwd+bwd {1 + BACKWARD_FLOPS_FACTOR}x")


def write_gpu(out_dir, rows, device_kind, jax_version, date, suffix="", commit=None):
  kind = device_kind.replace(" ", "_")
  title = f"attention sweep on {device_kind}"
  meta = dict(title=title, mode="gpu-sweep", device=device_kind, jax=jax_version,
              date=date, method=GPU_METHOD, rows=rows, commit=commit)
  plots = [([r for r in rows if r["group"] == g], GPU_IMPLS, "tflops", "TFLOP/s",
            f"{g}: {title}, {date} (CUPTI kernel time, bf16, B*S = {TOKENS_PER_CALL})",
            "-" + g)
           for g in dict.fromkeys(r["group"] for r in rows)]
  write(out_dir, f"sweep-{kind}-{date}{suffix}", meta, gpu_markdown(rows), plots)


def write_from_logs(paths, out_dir):
  """The full GPU sweep outputs from the logs of runs made in parts.

  The logs must come from one device and one jax version; they may come from
  different days (a part re-run after a kernel change): a case in several
  logs takes the row of the last log given, the files are named after the
  latest date, and each log's date and commit are recorded.
  """
  header = re.compile(r"GPU sweep on (.+), jax (\S+), (\d{4}-\d{2}-\d{2})(?:, commit (\S+))?")
  rows, runs, dates, provenance = {}, set(), set(), []
  for path in paths:  # a case in several logs: the last log's row wins
    with open(path) as fh:
      for line in fh:
        if m := header.search(line):
          runs.add(m.groups()[:2])
          dates.add(m.group(3))
          provenance.append(f"{os.path.basename(path)} ({m.group(3)}): "
                            f"{m.group(4) or 'not recorded'}")
        elif line.startswith('{"case"'):
          row = json.loads(line)
          rows[row["case"]] = row
  if len(runs) != 1:
    raise SystemExit(f"--from-logs needs logs of one device and jax version; found {sorted(runs)}")
  device_kind, jax_version = runs.pop()
  order = [c.name for c in gpu_cases(False)]
  missing = [name for name in order if name not in rows]
  if missing:
    print(f"{len(missing)} cases not in the logs (left out): {missing}")
  ordered = [rows[name] for name in order if name in rows]
  write_gpu(out_dir, ordered, device_kind, jax_version, max(dates),
            "-partial" if missing else "", commit="per log: " + "; ".join(provenance))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--quick", action="store_true", help="a few shapes only")
  ap.add_argument("--only", default=None, help="run cases whose name matches this regex")
  ap.add_argument("--out", default=RESULTS_DIR, help="output folder")
  ap.add_argument("--from-logs", nargs="+", default=None, metavar="LOG",
                  help="write the outputs from the rows printed in these sweep logs")
  args = ap.parse_args(argv)
  if args.from_logs:
    return write_from_logs(args.from_logs, args.out)

  device = jax.devices()[0]
  on_gpu = device.platform == "gpu"
  date = datetime.date.today().isoformat()
  suffix = ("-quick" if args.quick else "") + ("-partial" if args.only else "")
  cases = gpu_cases(args.quick) if on_gpu else cpu_cases(args.quick)
  if args.only:
    cases = [c for c in cases if re.search(args.only, c.name)]
  print(f"{len(cases)} cases", flush=True)

  if on_gpu:
    print(f"GPU sweep on {device.device_kind}, jax {jax.__version__}, {date}, "
          f"commit {git_commit()}", flush=True)
    write_gpu(args.out, gpu_sweep(cases), device.device_kind, jax.__version__, date, suffix)
  else:
    print("No GPU here: running the CPU correctness-and-speed check instead of the "
          "GPU sweep. Times are CPU wall clock, not GPU kernel times.", flush=True)
    repeats = 3 if args.quick else 10
    rows = cpu_check(cases, repeats)
    cpu = cpu_description()
    method = (f"CPU check (no GPU): median wall clock of {repeats} jitted calls after a "
              "warm-up, block_until_ready; float32 inputs; max error against an f32 "
              "einsum reference at 'highest' precision; fa4_jax.attention "
              "(implementation=None, the XLA path on a CPU) vs "
              "jax.nn.dot_product_attention(implementation='xla')")
    title = "attention CPU check (not a GPU benchmark)"
    meta = dict(title=title, mode="cpu-check", device=cpu, jax=jax.__version__,
                date=date, method=method, rows=rows)
    plots = [(rows, CPU_IMPLS, "gflops", "GFLOP/s (CPU wall clock)",
              f"CPU check, {cpu}, {date}: D64 H4, B*S = 1024, float32", "")]
    write(args.out, f"sweep-cpu-check-{date}{suffix}", meta, cpu_markdown(rows), plots)


if __name__ == "__main__":
  main()
