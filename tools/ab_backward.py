"""The sm90 backward of two checkouts side by side in one process (GPU).

For refactors: a copy of the old package, renamed `fa4_jax_before`, sits in
a folder given with --before; both backwards run on the same inputs, their
kernel spans (as `benchmarks/bench_backward.py` measures them) taken in
interleaved rounds (A B A B ...), so clock drift hits both alike.

    cp -r OLD/fa4_jax DIR/fa4_jax_before
    find DIR/fa4_jax_before -name '*.py' | xargs sed -i 's/\\bfa4_jax\\b/fa4_jax_before/g'
    python3 tools/ab_backward.py --before DIR [--only SUBSTRING] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import bench_backward  # noqa: E402
import bench_common  # noqa: E402


def kernel_call(package, case):
  """(jitted backward of `package`'s sm90 kernels, its inputs) for a case."""
  _, B, S, Hq, Hkv, D, causal, window_left, _ = case
  backward = __import__(f"{package}.kernels.sm90_backward", fromlist=["backward"])
  masks = __import__(f"{package}.scores" if package == "fa4_jax" else f"{package}.masks",
                     fromlist=["MaskSpec"])
  spec = masks.MaskSpec.from_arguments(
      causal, None if window_left is None else (window_left, 0))
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (B, S, Hq, D), jnp.bfloat16)
  k = jax.random.normal(keys[1], (B, S, Hkv, D), jnp.bfloat16)
  v = jax.random.normal(keys[2], (B, S, Hkv, D), jnp.bfloat16)
  do = jax.random.normal(keys[3], (B, S, Hq, D), jnp.bfloat16)
  # A plausible lse: the backward's speed does not depend on its values.
  lse = jnp.full((B, Hq, S), 4.0, jnp.float32)
  f = jax.jit(lambda q, k, v, o, lse, do: backward.backward(
      q, k, v, o, lse, do, None, None, scale=D ** -0.5, mask=spec))
  return f, (q, k, v, do, lse, do)


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--before", required=True, help="folder holding fa4_jax_before")
  ap.add_argument("--rounds", type=int, default=5)
  bench_common.add_case_options(ap)
  args = ap.parse_args()
  sys.path.insert(0, args.before)
  rows = []
  for case in bench_common.selected(bench_backward.CASES, args.only):
    calls = {p: kernel_call(p, case) for p in ("fa4_jax_before", "fa4_jax")}
    outs = {p: jax.block_until_ready(f(*a)) for p, (f, a) in calls.items()}
    same = all(bool(jnp.array_equal(x, y)) for x, y in zip(*outs.values()))
    spans = {p: [] for p in calls}
    for _ in range(args.rounds):
      for p, (f, a) in calls.items():
        spans[p].append(bench_backward.span_times(f, *a)[0])
    before, after = (float(np.median(spans[p])) for p in calls)
    row = dict(case=case[0], before_ms=before, after_ms=after, change=after / before - 1,
               bitwise_equal_gradients=same, rounds=spans)
    print(json.dumps(row), flush=True)
    rows.append(row)
  path = bench_common.result_path("backward-ab", jax.devices()[0].device_kind, args.tag)
  with open(path, "w") as fh:
    json.dump(dict(device=jax.devices()[0].device_kind, jax=jax.__version__,
                   method="kernel span (bench_backward.span_times), median of "
                          f"{args.rounds} interleaved rounds, one process", rows=rows), fh, indent=1)
  print("wrote", path)


if __name__ == "__main__":
  main()
