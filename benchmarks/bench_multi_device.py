"""Multi-device scaling of fa4_jax: batch/head sharding and context parallelism.

Two measurements, each on 1 device and on every device count asked for:

* sharded: `fa4_jax.attention` under `jax.jit` with q/k/v sharded over the
  batch (`--shard batch`) or the heads (`--shard heads`). The global problem
  is fixed (strong scaling): `tokens` = B * S positions, S = `--seq`.
* context: `fa4_jax.context_parallel_attention`, causal, one sequence of
  `tokens` positions (B = 1) sharded over the devices (load-balanced layout).
  Its one-device baseline is `fa4_jax.attention` on the whole sequence.

Heads 16, head_dim 128, bf16 by default. Each case is timed forward and
forward+backward (the vjp), wall clock around `jax.block_until_ready`, after
`--warmup` calls, median of `--repeats`. TFLOP/s counts 4*B*H*S^2*D forward
(halved when causal) and 2.5x that for the backward. Scaling efficiency on n
devices = time on 1 device / (n * time on n devices).

Correctness rides along: every n-device run's output and dq, dk, dv (context:
back in natural order) are compared with the 1-device run's on the same
inputs, reported as max |difference| / max |1-device value| per tensor
(`max_rel_diff_*`); bf16 results that differ only in summation order stay
within a few bf16 ulps of the largest value (~1e-2).

Usage (from the repository root, on a machine with several GPUs):
    python3 benchmarks/bench_multi_device.py                 # 1 and all GPUs
    python3 benchmarks/bench_multi_device.py --devices 1,2,4 --tokens 131072,262144
    python3 benchmarks/bench_multi_device.py --quick         # tiny smoke run (CPU ok)
Writes benchmarks/results/multi-device-<device>-<date>.json (or $OUT/ when
OUT is set) and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


if "--quick" in sys.argv and "jax" not in sys.modules:
  # A smoke run on the CPU needs several (forced) host devices.
  os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import fa4_jax  # noqa: E402
import fa4_jax.context_parallel  # noqa: E402

import bench_common  # noqa: E402  (this folder is on sys.path when run as a script)


def flops(b, s, h, d, causal, backward):
  forward = 4 * b * h * s * s * d / (2 if causal else 1)
  return forward * (3.5 if backward else 1.0)  # forward + 2.5x backward


def timed(fn, args, warmup, repeats):
  """Median seconds of fn(*args), after warm-up calls (compilation included there)."""
  return bench_common.wall_ms(fn, args, repeats, warmup) / 1e3


def with_backward(attend):
  """Forward + backward: the vjp of attend with a fixed cotangent."""

  def fn(q, k, v, dout):
    out, vjp = jax.vjp(attend, q, k, v)
    return out, vjp(dout)

  return fn


def host_f32(tree):
  return jax.tree.map(lambda x: np.asarray(x, np.float32), tree)


def max_rel_diff(got, want):
  """Per tensor (out, dq, dk, dv): max |got - want| / max |want|."""
  names = ("out", "dq", "dk", "dv")
  return {f"max_rel_diff_{n}": float(np.max(np.abs(g - w)) / max(np.max(np.abs(w)), 1e-30))
          for n, g, w in zip(names, jax.tree.leaves(got), jax.tree.leaves(want))}


def inputs(b, s, h, d, dtype, seed=0):
  keys = jax.random.split(jax.random.key(seed), 4)
  return [jax.random.normal(kk, (b, s, h, d), dtype) for kk in keys]


def run_sharded(n, tokens, seq, heads, head_dim, dtype, shard, args):
  b = tokens // seq
  mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n])
  spec = P("x") if shard == "batch" else P(None, None, "x")
  q, k, v, dout = (jax.device_put(x, NamedSharding(mesh, spec))
                   for x in inputs(b, seq, heads, head_dim, dtype))
  attend = lambda q, k, v: fa4_jax.attention(q, k, v, implementation=args.implementation)
  fwd = jax.jit(attend)
  both = jax.jit(with_backward(attend))
  return dict(
      b=b, s=seq, causal=False,
      fwd_s=timed(fwd, (q, k, v), args.warmup, args.repeats),
      fwd_bwd_s=timed(both, (q, k, v, dout), args.warmup, args.repeats)), \
      host_f32(both(q, k, v, dout))


def run_context(n, tokens, heads, head_dim, dtype, args):
  q, k, v, dout = inputs(1, tokens, heads, head_dim, dtype)
  if n == 1:  # the baseline: the whole sequence on one device
    device = jax.devices()[0]
    q, k, v, dout = (jax.device_put(x, device) for x in (q, k, v, dout))
    attend = lambda q, k, v: fa4_jax.attention(
        q, k, v, is_causal=True, implementation=args.implementation)
  else:
    mesh = jax.make_mesh((n,), ("seq",), devices=jax.devices()[:n])
    layout = jax.jit(lambda x: fa4_jax.load_balance(x, n))
    q, k, v, dout = (jax.device_put(layout(x), NamedSharding(mesh, P(None, "seq")))
                     for x in (q, k, v, dout))
    attend = lambda q, k, v: fa4_jax.context_parallel_attention(
        q, k, v, mesh=mesh, axis_name="seq", is_causal=True,
        implementation=args.implementation)
  fwd = jax.jit(attend)
  both = jax.jit(with_backward(attend))
  timing = dict(
      b=1, s=tokens, causal=True,
      fwd_s=timed(fwd, (q, k, v), args.warmup, args.repeats),
      fwd_bwd_s=timed(both, (q, k, v, dout), args.warmup, args.repeats))
  results = jax.tree.map(lambda x: np.asarray(x, np.float32), both(q, k, v, dout))
  if n > 1:  # back to the natural order, to compare with the 1-device run
    order = np.argsort(fa4_jax.context_parallel._balanced_chunk_order(n))
    results = jax.tree.map(
        lambda x: x.reshape(1, 2 * n, -1, *x.shape[2:])[:, order].reshape(x.shape), results)
  return timing, results


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--devices", default=None,
                      help="comma-separated device counts (default: 1 and all)")
  parser.add_argument("--tokens", default="131072,262144")
  parser.add_argument("--seq", type=int, default=8192,
                      help="sequence length of the sharded (batch/heads) case")
  parser.add_argument("--heads", type=int, default=16)
  parser.add_argument("--head-dim", type=int, default=128)
  parser.add_argument("--dtype", default="bfloat16")
  parser.add_argument("--cases", default="batch,heads,context")
  parser.add_argument("--implementation", default=None)
  parser.add_argument("--warmup", type=int, default=2)
  parser.add_argument("--repeats", type=int, default=10)
  parser.add_argument("--quick", action="store_true",
                      help="tiny shapes, to check the script runs (CPU ok)")
  args = parser.parse_args()
  if args.quick:
    args.tokens, args.seq, args.heads, args.head_dim = "256", 64, 4, 16
    args.dtype, args.warmup, args.repeats = "float32", 1, 2

  available = jax.device_count()
  counts = ([int(c) for c in args.devices.split(",")] if args.devices
            else sorted({1, available}))
  counts = [c for c in counts if c <= available]
  dtype = jnp.dtype(args.dtype)
  device_kind = jax.devices()[0].device_kind
  rows = []
  for tokens in [int(t) for t in args.tokens.split(",")]:
    for case in args.cases.split(","):
      baseline = None
      for n in counts:
        if case in ("batch", "heads"):
          split = tokens // args.seq if case == "batch" else args.heads
          if split % n:
            print(f"skip {case} n={n}: {split} not divisible by {n}")
            continue
          r, results = run_sharded(n, tokens, args.seq, args.heads, args.head_dim,
                                   dtype, case, args)
        else:
          if tokens % (2 * n):
            print(f"skip context n={n}: {tokens} not divisible by {2 * n}")
            continue
          r, results = run_context(n, tokens, args.heads, args.head_dim, dtype, args)
        r.update(case=case, devices=n, tokens=tokens, heads=args.heads,
                 head_dim=args.head_dim, dtype=args.dtype)
        for key, backward in (("fwd", False), ("fwd_bwd", True)):
          f = flops(r["b"], r["s"], args.heads, args.head_dim, r["causal"], backward)
          r[f"{key}_tflops"] = f / r[f"{key}_s"] / 1e12
          r[f"{key}_tflops_per_device"] = r[f"{key}_tflops"] / n
        if n == 1:
          baseline, baseline_results = r, results
        if baseline is not None:
          for key in ("fwd", "fwd_bwd"):
            r[f"{key}_efficiency"] = baseline[f"{key}_s"] / (n * r[f"{key}_s"])
          if n > 1:
            r.update(max_rel_diff(results, baseline_results))
        del results
        rows.append(r)
        print(json.dumps(r), flush=True)

  print(f"\n{device_kind}, H{args.heads} D{args.head_dim} {args.dtype}\n")
  print("| case | tokens | devices | fwd ms | fwd TFLOP/s/dev | eff | fwd+bwd ms "
        "| fwd+bwd TFLOP/s/dev | eff | max rel diff vs 1 device (out, dq, dk, dv) |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  diffs = lambda r: ", ".join(
      f"{r[k]:.1e}" for k in (f"max_rel_diff_{n}" for n in ("out", "dq", "dk", "dv")) if k in r) or "-"
  for r in rows:
    eff = lambda k: f"{r[k]:.2f}" if k in r else "-"
    print(f"| {r['case']} | {r['tokens']} | {r['devices']} | {r['fwd_s'] * 1e3:.2f} "
          f"| {r['fwd_tflops_per_device']:.1f} | {eff('fwd_efficiency')} "
          f"| {r['fwd_bwd_s'] * 1e3:.2f} | {r['fwd_bwd_tflops_per_device']:.1f} "
          f"| {eff('fwd_bwd_efficiency')} | {diffs(r)} |")

  path = bench_common.result_path("multi-device", device_kind)
  if not args.quick:
    with open(path, "w") as f:
      json.dump(dict(device=device_kind, counts=counts, rows=rows), f, indent=1)
    print(f"\nwrote {path}")


if __name__ == "__main__":
  main()
