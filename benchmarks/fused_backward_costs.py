"""Where the fused backward's time goes (an experiment, not a benchmark of record).

The fused kernel (`BackwardConfig.dq == "fused"`) adds every CTA's dQ
partials with int32 TMA reduce-adds: 32 KiB per (128-key tile, 64-row query
block), 8.6 GB at B2 S8192 H16 D128. This script times, in one process, the
kernel as built and two stripped copies of it:

    full          as shipped
    no_reduce     dQ computed and staged in SMEM, the reduce-add TMA dropped
    no_dq         also the dQ wgmmas and their staging dropped (the dK/dV work
                  and the dS^T hand-off to the dQ warpgroup remain)

The stripped copies give wrong dQ; only their time is of interest. Kernel
time by CUPTI, median of 10, bf16, as `bench_backward.py --timing cupti`
(one kernel: nothing overlaps).

    python3 benchmarks/fused_backward_costs.py [--only SUBSTRING]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import sys
from unittest import mock

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from fa4_jax import xla_attention  # noqa: E402
from fa4_jax.kernels import sm90_backward  # noqa: E402
from fa4_jax.scores import MaskSpec  # noqa: E402

import bench_backward  # noqa: E402
import bench_common  # noqa: E402

CASES = [("B2 S8192 H16 D128", 2, 8192, 16, False), ("B2 S8192 H16 D128 causal", 2, 8192, 16, True),
         ("B1 S16384 H16 D128", 1, 16384, 16, False)]


@contextlib.contextmanager
def stripped(variant: str):
  """Patches the Mosaic GPU calls of the fused kernel's dQ step."""
  if variant == "full":
    yield
    return
  plgpu = sm90_backward.plgpu
  real_copy, real_wgmma = plgpu.copy_smem_to_gmem, plgpu.wgmma

  def copy(src, dst, *args, reduction_op=None, **kw):
    if reduction_op is None:
      return real_copy(src, dst, *args, **kw)
    return None  # the dQ reduce-add

  def wgmma(acc, a, b, *args, **kw):
    # The dQ GEMM is the only one whose A operand is a transposed SMEM ref.
    if variant == "no_dq" and getattr(a, "transforms", None) and "Transpose" in repr(a.transforms):
      return None
    return real_wgmma(acc, a, b, *args, **kw)

  with mock.patch.object(plgpu, "copy_smem_to_gmem", copy), \
       mock.patch.object(plgpu, "wgmma", wgmma):
    yield


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--only", default="")
  ap.add_argument("--config", default="", help="key=value,... over with_fused_dq()")
  args = ap.parse_args()
  device = jax.devices()[0]
  rows = []
  for name, B, S, H, causal in CASES:
    if args.only not in name:
      continue
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(kk, (B, S, H, 128), jnp.bfloat16) for kk in keys)
    mask = MaskSpec.from_arguments(causal, None)
    scale = 1 / math.sqrt(128)
    out, lse = jax.jit(lambda q, k, v: xla_attention.forward(
        q, k, v, None, None, None, None, scale=scale, spec=mask))(q, k, v)
    fl = bench_backward.flops(B, S, H, 128, causal, None)
    row = dict(case=name)
    for variant in ("full", "no_reduce", "no_dq"):
      config = bench_backward.config_for(args.config, 128, mask,
                                         base=sm90_backward.BackwardConfig.with_fused_dq)
      with stripped(variant):
        f = jax.jit(lambda q, k, v, o, l, do: sm90_backward.backward(
            q, k, v, o, l, do, None, None, scale=scale, mask=mask, config=config))
        jax.block_until_ready(f(q, k, v, out, lse, do))
        ms, per_kernel = bench_backward.kernel_times(f, q, k, v, out, lse, do)
      row[variant] = dict(ms=ms, tflops=fl / ms / 1e9,
                          kernel_ms=max(per_kernel.values()))
    print(json.dumps(row), flush=True)
    rows.append(row)
  path = bench_common.result_path("backward-fused-costs", device.device_kind)
  with open(path, "w") as fh:
    json.dump(dict(device=device.device_kind, jax=jax.__version__, config=args.config,
                   method="CUPTI kernel time, median of 10", rows=rows), fh, indent=1)
  for r in rows:
    print(r["case"], " | ".join(f"{v}: {r[v]['kernel_ms']:.2f} ms" for v in ("full", "no_reduce", "no_dq")))
  print("wrote", path)


if __name__ == "__main__":
  main()
