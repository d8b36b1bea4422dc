"""How far the GPU's fast tanh is from tanh, as soft-cap uses it (GPU).

Soft-cap turns a raw logit s into cap * tanh(s * scale / cap); the kernels
compute the tanh with Mosaic GPU's approximate math (`approx_math=True`
lowers `jnp.tanh` of f32 to `tanh.approx.f32`, of f16 to the packed
`tanh.approx.f16x2`). This runs both on a dense sweep of arguments in a tiny
Pallas Mosaic GPU kernel and compares them with float64 `numpy.tanh`:

* max |error| of t = tanh(x), overall and for |x| <= 1 (where most scaled
  logits / cap lie);
* what that error does to a softmax: the capped logit moves by up to
  cap * max|error|, so a probability moves by a factor exp(+-cap * err).

Usage: python3 tools/tanh_error.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

ROWS, COLS, BLOCK_ROWS = 8192, 128, 64
CAPS = (20.0, 30.0, 50.0)


def fast_tanh(x):
  """tanh of every element of x [ROWS, COLS] on the GPU, approximate math:
  one CTA per BLOCK_ROWS rows, GMEM -> SMEM -> registers -> SMEM -> GMEM."""

  def body(x_gmem, o_gmem, x_smem, o_smem, barrier):
    rows = pl.ds(lax.axis_index("blocks") * BLOCK_ROWS, BLOCK_ROWS)
    plgpu.copy_gmem_to_smem(x_gmem.at[rows], x_smem, barrier)
    plgpu.barrier_wait(barrier)
    o_smem[...] = jnp.tanh(x_smem[...])
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[rows])
    plgpu.wait_smem_to_gmem(0)

  tile = plgpu.SMEM((BLOCK_ROWS, COLS), x.dtype)
  return plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(ROWS // BLOCK_ROWS,),
      grid_names=("blocks",), scratch_types=[tile, tile, plgpu.Barrier()],
      compiler_params=plgpu.CompilerParams(approx_math=True))(x)


def report(name, x64, t):
  err = np.abs(t.astype(np.float64) - np.tanh(x64))
  small = np.abs(x64) <= 1.0
  row = dict(variant=name, max_abs_error=float(err.max()),
             max_abs_error_small_x=float(err[small].max()),
             max_relative_error=float((err / np.maximum(np.abs(np.tanh(x64)), 1e-30))[
                 np.abs(x64) > 1e-3].max()))
  for cap in CAPS:
    row[f"prob_factor_cap{cap:g}"] = float(np.exp(cap * err.max()) - 1.0)
  return row


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--json", default=None)
  args = ap.parse_args()
  print(jax.devices()[0].device_kind, jax.__version__)
  x64 = np.linspace(-8.0, 8.0, ROWS * COLS).reshape(ROWS, COLS)
  rows = []
  x32 = x64.astype(np.float32)
  rows.append(report("tanh.approx.f32", x32.astype(np.float64),
                     np.asarray(fast_tanh(jnp.asarray(x32)))))
  x16 = x64.astype(np.float16)  # the argument rounded to f16 first, as a kernel would
  rows.append(report("tanh.approx.f16x2", x16.astype(np.float64),
                     np.asarray(fast_tanh(jnp.asarray(x16)))))
  rows.append(report("f16 argument, exact tanh, vs the f32 argument", x32.astype(np.float64),
                     np.tanh(x16.astype(np.float64))))
  for r in rows:
    print(json.dumps(r))
  if args.json:
    with open(args.json, "w") as fh:
      json.dump(dict(device=jax.devices()[0].device_kind, rows=rows), fh, indent=1)


if __name__ == "__main__":
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
  main()
