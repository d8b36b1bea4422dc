"""One forward call of the sm90 kernel, for a profiler to attach to.

Runs one benchmark case of `bench_forward.py` (exact name) twice: a warm-up
call and the call to profile, on random inputs. Meant to run under Nsight
Compute on the GPU machine, skipping the warm-up launch:

    XLA_PYTHON_CLIENT_PREALLOCATE=false ncu --clock-control none \\
        --kernel-name regex:mosaic --launch-skip 1 --launch-count 1 \\
        --set full -o report python3 benchmarks/profile_forward.py \\
        --case "B2 S8192 H32 D64 causal" [--config key=value,...]

(Preallocation off: ncu saves and restores the memory a replayed kernel can
reach, and XLA's default pool would make that most of the GPU.)
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import jax
import jax.numpy as jnp

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
import bench_forward  # noqa: E402
from fa4_jax.kernels import sm90_forward  # noqa: E402
from fa4_jax.masks import MaskSpec  # noqa: E402


def main() -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--case", required=True, help="a case name of bench_forward.CASES")
  ap.add_argument("--config", default="", help="config overrides key=value,...")
  args = ap.parse_args()
  cases = {c[0]: c for c in bench_forward.CASES}
  if args.case not in cases:
    ap.error(f"--case must be one of {sorted(cases)}")
  _, B, S, Hq, Hkv, D, causal, window_left = cases[args.case]
  keys = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(keys[0], (B, S, Hq, D), jnp.bfloat16)
  k = jax.random.normal(keys[1], (B, S, Hkv, D), jnp.bfloat16)
  v = jax.random.normal(keys[2], (B, S, Hkv, D), jnp.bfloat16)
  mask = MaskSpec.from_arguments(causal, None if window_left is None else (window_left, 0))
  config = bench_forward.config_for(args.config, D, mask, S)
  print(args.case, config, flush=True)
  fn = jax.jit(lambda q, k, v: sm90_forward.forward(
      q, k, v, None, None, scale=1 / math.sqrt(D), mask=mask, config=config)[0])
  for _ in range(2):
    jax.block_until_ready(fn(q, k, v))
  return 0


if __name__ == "__main__":
  sys.exit(main())
