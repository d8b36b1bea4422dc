"""Per key-block SASS counts of the float8 forward's consumer loop, without a GPU.

Issue #55: the float8 D128 forward's consumers are bound by instruction
issue in the softmax (docs/performance-notes.md, "The float8 forward's exp2
on the FMA pipe"), so a change to the softmax is judged first by how many
instructions a key block costs. Each call is cross-lowered for sm_90a,
compiled to PTX by the jax CUDA plugin and to a cubin by ptxas
(`tools/local_ptxas.py`: `capture`, `compile_to_ptx`), decoded by `nvdisasm`
(the `nvidia-cuda-nvdisasm` pip wheel: `--nvdisasm PATH`), and the loops of
the listing are found as `tools/sass_loops.py` finds them. Printed per
kernel: ptxas's registers and spill bytes, whether it serialized a wgmma,
then every loop (past an mbarrier spin) that holds a `MUFU.EX2` or a wgmma
(`HGMMA`, `QGMMA`): its size and its counts of the ops the softmax is made
of. The key-block loops are the ones with wgmmas (both arms of the
conditional rescale are counted: most blocks skip O's multiply).

    python3 tools/fp8_sass_counts.py --nvdisasm PATH [--head-dim 128] [--causal] \\
        [--candidates off on] [--set block_kv=192 ...] [--keep DIR]

Shapes: B2 S8192 H32/8 (`bench_fp8.py`'s prefill row), e4m3, the heuristic's
float8 config (`sm90_forward.fp8_config`); candidates: `off` (as it is) and
`on` (`ForwardConfig.fp8_row_sums_on_tensor_core`: the row sums by the P V
wgmma against a tile of ones).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import local_sass  # noqa: E402

OPS = ("MUFU.EX2", "FFMA", "FADD", "FMUL", "FMNMX", "FSETP", "FSEL", "SHFL", "F2FP", "PRMT",
       "MOV", "HGMMA", "QGMMA", "WARPGROUP", "BAR", "SYNCS", "STL", "LDL")


def fp8_call(d: int, causal: bool, row_sums_on_tensor_core: bool, changes=None):
  import jax
  import jax.numpy as jnp

  from fa4_jax.kernels import sm90_forward
  from fa4_jax.scores import MaskSpec, ScoreFunction

  mask = MaskSpec(right=0) if causal else MaskSpec()
  seq = 8192
  config = sm90_forward.fp8_config(sm90_forward.choose_config(d, mask, seq, seq), mask, d, d,
                                   False)
  if row_sums_on_tensor_core:
    config = dataclasses.replace(config, fp8_row_sums_on_tensor_core=True)
  if changes:
    config = dataclasses.replace(config, **changes)
  q = jax.ShapeDtypeStruct((2, seq, 32, d), jnp.float8_e4m3fn)
  kv = jax.ShapeDtypeStruct((2, seq, 8, d), jnp.float8_e4m3fn)
  fn = lambda q, k, v: sm90_forward.forward(q, k, v, None, None, score=ScoreFunction(d ** -0.5),
                                            mask=mask, config=config)[0]
  return fn, (q, kv, kv), config


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  local_sass.add_arguments(ap)
  ap.add_argument("--head-dim", type=int, default=128)
  ap.add_argument("--causal", action="store_true")
  ap.add_argument("--candidates", nargs="+", default=["off", "on"], choices=("off", "on"),
                  help="the row sums by FADDs (off) or on the tensor core (on)")
  ap.add_argument("--set", action="append", default=[], metavar="KEY=INT",
                  help="a ForwardConfig field (int or bool as 0/1) instead of the heuristic's, "
                       "e.g. block_kv=192; repeatable")
  args = ap.parse_args()
  tools = local_sass.toolchain(ap, args)
  print("ops per loop:", ", ".join(OPS), flush=True)
  for candidate in args.candidates:
    changes = {k: int(v) for k, v in (x.split("=") for x in args.set)}
    fn, specs, config = fp8_call(args.head_dim, args.causal, candidate == "on", changes)
    print(f"\n## D{args.head_dim} {'causal' if args.causal else 'dense'} row sums on the "
          f"tensor core: {candidate} ({config})", flush=True)
    stem = f"d{args.head_dim}{'c' if args.causal else ''}-{candidate}"
    for kernel in local_sass.kernels_of(fn, specs, tools, args, stem):
      local_sass.report(kernel.name, kernel, OPS)
  return 0


if __name__ == "__main__":
  sys.exit(main())
