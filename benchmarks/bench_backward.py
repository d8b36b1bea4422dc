"""Attention backward on one GPU: fa4_jax's sm90 backward next to cuDNN, one process.

Time of one call (default, `--timing span`): its span in a profiler trace
(CUPTI underneath, `bench_common.trace_spans`), from its first kernel's
start to its last kernel's end, median of ITERATIONS calls. Our kernels
overlap (`BackwardConfig.overlap_kernels`), so the sum of kernel durations
would count the overlap twice; the span also counts the gaps between
kernels. `--timing cupti` sums the CUPTI durations of every kernel one call
launches (`jax.experimental.mosaic.gpu.profiler.measure`, DESIGN.md's
method), right only where no kernels overlap (cuDNN's span is its sum +
0.015 ms). The kernels: for us the lse conversion and, where the dQ kernel
does not compute delta (all but causal rows without a window at head dim
<= 128), the delta reduction (XLA fusions), the dK/dV kernel (two passes,
dK and dV, at head dim 192) and the dQ kernel, each also reported on its
own with its start offset; for cuDNN the kernels of its VJP, given saved
residuals. TFLOP/s counts 2.5 x the forward's 4*B*H*S^2*D, halved when
causal; a causal window counts 2.5 x 4*B*H*S*W*D (W = window + 1).

The rows `B2 S8192 H16 D192/128 [causal]` give V, O, dO and dV a head dim of
their own (`VALUE_HEAD_DIMS`; DeepSeek's 192 / 128, issue #56): TFLOP/s count
2.5 x 2*B*H*S^2*(D + Dv), and `--config` starts from
`sm90_backward.choose_config` at that pair (two passes); the candidates of
docs/performance-notes.md ("192 / 128: candidates screened on the CPU"),
e.g. `--config dkv.dk_dv=dv_dk_split,dkv.producer_registers=24,
dkv.consumer_registers=240`. cuDNN's column there records jax.nn's refusal
(one head dim).

Errors (cases marked `check`): dq, dk, dv of both implementations on the same
bf16 inputs against an f32 reference (fa4_jax's memory-linear XLA forward and
backward on the upcast inputs at "highest" matmul precision): max absolute
error and relative L2 error.

Usage (on the GPU machine, from the repository root):
    python3 benchmarks/bench_backward.py [--quick] [--only SUBSTRING (repeatable)]
        [--config key=value,... (repeatable: one column per config; a kernel's
         fields as dkv.KEY=... or dq.KEY=...)] [--tag NAME]
        [--rounds N (measure the columns N times, interleaved)] [--no-check | --check-all]
        [--timing span|cupti] [--nondeterministic]
`--nondeterministic` adds the column `fa4_sm90_nd`: `deterministic=False`'s
one kernel (dQ summed in float32 by TMA reduce-adds,
`sm90_backward_fused_dq`; the config text "nd", whose overrides
`--config nd,ds_slots=1,dkv.KEY=...` take too), beside the default and cuDNN;
rows it cannot serve (head dims other than 128) record its error.
Writes benchmarks/results/backward[-NAME]-<device>-<date>.json (or $OUT/ when
OUT is set) and prints a Markdown table. cuDNN runs as XLA configures it: its
non-deterministic backward unless XLA_FLAGS has --xla_gpu_deterministic_ops=true.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import math
import os
import sys

import numpy as np

import jax
import jax.numpy as jnp
from jax.experimental.mosaic.gpu import profiler

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from fa4_jax import xla_attention  # noqa: E402
from fa4_jax.scores import ScoreFunction, Scores  # noqa: E402
from fa4_jax.kernels import sm90_backward  # noqa: E402

import bench_common  # noqa: E402  (this folder is on sys.path when run as a script)

ITERATIONS = 10

# (name, B, S, Hq, Hkv, D, causal, window_left, check errors)
CASES = [
    ("B2 S8192 H16 D128", 2, 8192, 16, 16, 128, False, None, True),
    ("B2 S8192 H16 D128 causal", 2, 8192, 16, 16, 128, True, None, True),
    ("B1 S16384 H16 D128", 1, 16384, 16, 16, 128, False, None, False),
    ("B1 S16384 H16 D128 causal", 1, 16384, 16, 16, 128, True, None, False),
    ("B2 S8192 H32 D64", 2, 8192, 32, 32, 64, False, None, False),
    ("B2 S8192 H32 D64 causal", 2, 8192, 32, 32, 64, True, None, False),
    ("B2 S8192 H32/8 D128 (GQA) causal", 2, 8192, 32, 8, 128, True, None, False),
    ("B1 S16384 H16 D128 causal window 1024", 1, 16384, 16, 16, 128, True, 1023, False),
    # DESIGN.md's other H200 rows (peers/h200-variants-2026-11-21.json)
    ("B2 S8192 H32/8 D128 (GQA)", 2, 8192, 32, 8, 128, False, None, False),
    ("B1 S32768 H16 D128 causal window 4096", 1, 32768, 16, 16, 128, True, 4095, False),
    ("B2 S8192 H8 D256", 2, 8192, 8, 8, 256, False, None, True),
    ("B2 S8192 H8 D256 causal", 2, 8192, 8, 8, 256, True, None, True),
    # DESIGN.md's short-sequence rows: many CTAs with little work each
    ("B8 S2048 H16 D128", 8, 2048, 16, 16, 128, False, None, True),
    ("B8 S2048 H16 D128 causal", 8, 2048, 16, 16, 128, True, None, True),
    # not in DESIGN.md's table: the two-pass dK/dV scheme of head dim 192
    ("B2 S8192 H8 D192", 2, 8192, 8, 8, 192, False, None, True),
    ("B2 S8192 H8 D192 causal", 2, 8192, 8, 8, 192, True, None, False),
    # DeepSeek's training head dims (issue #56): V, O, dO and dV 128 wide
    # beside Q and K at 192 (`VALUE_HEAD_DIMS`)
    ("B2 S8192 H16 D192/128", 2, 8192, 16, 16, 192, False, None, True),
    ("B2 S8192 H16 D192/128 causal", 2, 8192, 16, 16, 192, True, None, True),
]

# V's head dim of the cases where it is not D, by name: the tuples above keep
# their nine fields for the tools that unpack them.
VALUE_HEAD_DIMS = {"B2 S8192 H16 D192/128": 128, "B2 S8192 H16 D192/128 causal": 128}


def flops(B, S, H, D, causal, window_left, value_head_dim=None):
  """2.5 x the forward's 4*B*H*S^2*D (2*B*H*S^2*(D + Dv) where V has a head
  dim of its own, `value_head_dim`), halved when causal."""
  width = 2 * D if value_head_dim is None else D + value_head_dim
  if window_left is not None:
    return 2.5 * 2 * B * H * S * (window_left + 1) * width
  return 2.5 * 2 * B * H * S * S * width / (2 if causal else 1)


def kernel_times(f, *args):
  """(total ms, {kernel name: ms}) medians over ITERATIONS calls."""
  _, per_iter = profiler.measure(f, aggregate=False, iterations=ITERATIONS)(*args)
  names = [name for name, _ in per_iter[0]]
  per_kernel = {}
  for i, name in enumerate(names):
    per_kernel[f"{i}:{name[:60]}"] = float(np.median([it[i][1] for it in per_iter]))
  total = float(np.median([sum(t for _, t in it) for it in per_iter]))
  return total, per_kernel


def span_times(f, *args):
  """(span ms, {kernel name: ms}) medians over ITERATIONS calls, the span from
  a profiler trace (first kernel's start to last kernel's end; see
  `bench_common.trace_spans`), per-kernel durations as in `kernel_times`."""
  span, kernels = bench_common.kernel_medians(f, args, ITERATIONS)
  per_kernel = {}
  for i, (name, start, duration) in enumerate(kernels):
    per_kernel[f"{i}:{name[:60]}"] = float(duration)
    per_kernel[f"{i}:starts_at"] = float(start)
  return float(span), per_kernel


def errors(grads, ref):
  out = {}
  for name, g, r in zip(("dq", "dk", "dv"), grads, ref):
    diff = g.astype(jnp.float32) - r
    out[name] = dict(max_abs=float(jnp.max(jnp.abs(diff))),
                     rel_l2=float(jnp.linalg.norm(diff) / jnp.linalg.norm(r)))
  return out


# The first item of a `--config` text that asks for the one kernel with dQ
# summed in float32 (`deterministic=False`: `sm90_backward_fused_dq`).
NONDETERMINISTIC = "nd"


def config_for(text, head_dim, mask, group=1, value_head_dim=None):
  """The heuristic's config for (head dim, mask, GQA group), with the
  `key=value,...` overrides of `text`: a `BackwardConfig` field
  (`delta_in_dq=False`) or one of a kernel's, prefixed with its name
  (`dkv.stats_first=False`, `dq.num_consumers=2`). A text whose first item
  is "nd" (`NONDETERMINISTIC`) gives the one kernel's `FusedDqConfig`
  instead (`sm90_backward.choose_fused_dq_config`; its fields `ds_slots=`,
  `dq_stages=`, its dK/dV part's `dkv.KEY=`). `value_head_dim`: V's where it
  has its own (192 / 128; `sm90_backward.choose_config`)."""
  items = list(filter(None, text.split(",")))
  one_kernel = bool(items) and items[0] == NONDETERMINISTIC
  if one_kernel:
    items = items[1:]
    config = sm90_backward.choose_fused_dq_config(head_dim, mask, group)
  else:
    config = sm90_backward.choose_config(head_dim, mask, group, value_head_dim=value_head_dim)
  changes = {"": {}, "dkv": {}, "dq": {}}
  for item in items:
    key, value = item.split("=")
    kernel, _, field = key.rpartition(".")
    if value in ("True", "False"):
      changes[kernel][field] = value == "True"
    else:
      changes[kernel][field] = int(value) if value.lstrip("-").isdigit() else value
  if one_kernel:
    return dataclasses.replace(config, dkv=dataclasses.replace(config.dkv, **changes["dkv"]),
                               **changes[""])
  return dataclasses.replace(
      config, dkv=dataclasses.replace(config.dkv, **changes["dkv"]),
      dq=dataclasses.replace(config.dq, **changes["dq"]), **changes[""])


def column_name(i: int, text: str) -> str:
  """The results' key of config override `text` (the `i`-th)."""
  if text == NONDETERMINISTIC:
    return "fa4_sm90_nd"
  return "fa4_sm90" if i == 0 else f"fa4_sm90[{text}]"


class CaseSetup:
  """Inputs and jitted backwards of one case: ours once per config override
  (a `key=value,...` string, "" for the heuristic's), then cuDNN's VJP.

  `impls` is a list of (column name, function, args); `cudnn_error` says why
  cuDNN is missing when it refused the case."""

  def __init__(self, case, overrides=("",)):
    name, B, S, Hq, Hkv, D, causal, window_left, _ = case
    self.value_head_dim = Dv = VALUE_HEAD_DIMS.get(name, D)
    keys = jax.random.split(jax.random.key(0), 4)
    self.q = jax.random.normal(keys[0], (B, S, Hq, D), jnp.bfloat16)
    self.k = jax.random.normal(keys[1], (B, S, Hkv, D), jnp.bfloat16)
    self.v = jax.random.normal(keys[2], (B, S, Hkv, Dv), jnp.bfloat16)
    self.do = jax.random.normal(keys[3], (B, S, Hq, Dv), jnp.bfloat16)
    self.scale = scale = 1 / math.sqrt(D)
    mask, window = bench_common.case_mask(causal, window_left)
    self.mask = mask
    self.xla_fwd = jax.jit(lambda q, k, v: xla_attention.forward(
        q, k, v, None, None, Scores(mask=mask, scale=scale)))
    out, lse = self.xla_fwd(self.q, self.k, self.v)

    self.impls, self.configs = [], []
    for i, text in enumerate(overrides):
      config = config_for(text, D, mask, Hq // Hkv, value_head_dim=Dv if Dv != D else None)
      self.configs.append(dataclasses.asdict(config))
      f = jax.jit(functools.partial(
          lambda q, k, v, o, l, do, config: sm90_backward.backward(
              q, k, v, o, l, do, None, None, score=ScoreFunction(scale), mask=mask,
              config=config),
          config=config))
      self.impls.append((column_name(i, text), f, (self.q, self.k, self.v, out, lse, self.do)))
    cudnn_fwd = lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=causal, local_window_size=window, implementation="cudnn")
    self.cudnn_error = None
    try:
      _, cudnn_vjp = jax.vjp(cudnn_fwd, self.q, self.k, self.v)
      self.impls.append(("cudnn", jax.jit(lambda vjp, do: vjp(do)), (cudnn_vjp, self.do)))
    except Exception as e:  # noqa: BLE001
      self.cudnn_error = f"{type(e).__name__}: {str(e)[:300]}"

  def reference(self):
    """(dq, dk, dv) in f32: the XLA path on the upcast inputs at "highest"
    matmul precision."""
    with jax.default_matmul_precision("highest"):
      f32 = [x.astype(jnp.float32) for x in (self.q, self.k, self.v, self.do)]
      out32, lse32 = self.xla_fwd(*f32[:3])
      mask, scale = self.mask, self.scale
      ref = jax.jit(lambda q, k, v, o, l, do: xla_attention.backward(
          q, k, v, None, None, Scores(mask=mask, scale=scale), o, l, do)[:3])(
              *f32[:3], out32, lse32, f32[3])
      return jax.block_until_ready(ref)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true", help="first two shapes only")
  bench_common.add_case_options(ap)
  ap.add_argument("--config", action="append", default=None)
  ap.add_argument("--no-check", action="store_true", help="skip error checks")
  ap.add_argument("--check-all", action="store_true",
                  help="check errors in every case, not only the marked ones")
  ap.add_argument("--rounds", type=int, default=1,
                  help="measure every column this many times, interleaved (A B A B ...), "
                       "and report the median round: the card's clock drifts over a run")
  ap.add_argument("--timing", choices=("span", "cupti"), default="span",
                  help="span: first kernel's start to last kernel's end in a profiler "
                       "trace (kernels of one call overlap); cupti: sum of the kernels' "
                       "CUPTI durations (DESIGN.md's method, double-counts overlap)")
  ap.add_argument("--nondeterministic", action="store_true",
                  help="also time deterministic=False's one kernel (column fa4_sm90_nd)")
  args = ap.parse_args()
  overrides = args.config or [""]
  if args.nondeterministic and NONDETERMINISTIC not in overrides:
    overrides = [*overrides, NONDETERMINISTIC]
  timer = span_times if args.timing == "span" else kernel_times

  device = jax.devices()[0]
  print(device.device_kind, jax.__version__, flush=True)
  cases = CASES[:2] if args.quick else CASES
  cases = bench_common.selected(cases, args.only)
  rows = []
  for case in cases:
    name, B, S, Hq, Hkv, D, causal, window_left, check = case
    setup = CaseSetup(case, overrides)
    row = dict(case=name, B=B, S=S, Hq=Hq, Hkv=Hkv, D=D, causal=causal,
               window_left=window_left, dtype="bfloat16", config=setup.configs[0])
    if setup.value_head_dim != D:
      row["Dv"] = setup.value_head_dim
    fl = flops(B, S, Hq, D, causal, window_left, setup.value_head_dim)
    ref = setup.reference() if (check or args.check_all) and not args.no_check else None
    impls = setup.impls
    if setup.cudnn_error:
      row["cudnn"] = dict(error=setup.cudnn_error)

    measured = {}  # impl -> [(total ms, {kernel: ms}) per round]
    for rnd in range(args.rounds):
      for impl, f, f_args in impls:
        if rnd and impl not in measured:
          continue  # failed in the first round
        try:
          if rnd == 0:
            grads = jax.block_until_ready(f(*f_args))
            row[impl] = {}
            if ref is not None:
              row[impl]["errors"] = errors(grads, ref)
            del grads
          measured.setdefault(impl, []).append(timer(f, *f_args))
        except Exception as e:  # keep going: one failure should not hide the rest
          row[impl] = dict(error=f"{type(e).__name__}: {str(e)[:500]}")
          measured.pop(impl, None)
    for impl, rounds in measured.items():
      totals = [total for total, _ in rounds]
      ms, per_kernel = sorted(rounds, key=lambda r: r[0])[(len(rounds) - 1) // 2]
      row[impl].update(ms=ms, tflops=fl / ms / 1e9, kernels_ms=per_kernel)
      if len(rounds) > 1:
        row[impl]["ms_rounds"] = totals
    print(json.dumps(row), flush=True)
    rows.append(row)

  date = datetime.date.today().isoformat()
  path = bench_common.result_path("backward", device.device_kind, args.tag)
  meta = dict(device=device.device_kind, jax=jax.__version__, date=date,
              xla_flags=os.environ.get("XLA_FLAGS", ""),
              method=(("CUPTI kernel time" if args.timing == "cupti"
                       else "kernel span in a profiler trace") + f", median of {ITERATIONS}"
                      + (f", median round of {args.rounds} interleaved" if args.rounds > 1 else "")
                      + "; FLOPs 2.5x forward"),
              rows=rows)
  with open(path, "w") as fh:
    json.dump(meta, fh, indent=1)
  print(markdown(rows))
  print("wrote", path)


def _cell(r, fmt_fn):
  return "error" if r is None or "error" in r else fmt_fn(r)


def markdown(rows):
  if any(column_name(1, NONDETERMINISTIC) in r for r in rows):
    return _markdown_with_nondeterministic(rows)
  lines = ["| case | ours TFLOP/s | cuDNN TFLOP/s | ours dq/dk/dv rel err | cuDNN rel err |",
           "|---|---|---|---|---|"]
  errs = lambda r: ("/".join(f"{r['errors'][g]['rel_l2']:.1e}" for g in ("dq", "dk", "dv"))
                    if "errors" in r else "-")
  tflops = lambda r: f"{r['tflops']:.0f}"
  for r in rows:
    ours, cud = r.get("fa4_sm90"), r.get("cudnn")
    lines.append(f"| {r['case']} | {_cell(ours, tflops)} | {_cell(cud, tflops)} | "
                 f"{_cell(ours, errs)} | {_cell(cud, errs)} |")
  return "\n".join(lines)


def _markdown_with_nondeterministic(rows):
  nd = column_name(1, NONDETERMINISTIC)
  lines = ["| case | ours TFLOP/s | ours, deterministic=False | cuDNN TFLOP/s | "
           "ours / nd / cuDNN dq/dk/dv rel err |", "|---|---|---|---|---|"]
  errs = lambda r: ("/".join(f"{r['errors'][g]['rel_l2']:.1e}" for g in ("dq", "dk", "dv"))
                    if "errors" in r else "-")
  tflops = lambda r: f"{r['tflops']:.0f}"
  for r in rows:
    cells = [r.get("fa4_sm90"), r.get(nd), r.get("cudnn")]
    lines.append(f"| {r['case']} | " + " | ".join(_cell(c, tflops) for c in cells) + " | "
                 + " ; ".join(_cell(c, errs) for c in cells) + " |")
  return "\n".join(lines)


if __name__ == "__main__":
  main()
