"""The sm90 dQ (or dK/dV) kernel under ptxas and nvdisasm, per backward `--config`, without a GPU.

Issue #56: screens dQ-kernel candidates at a head-dim pair (default 192 /
128, B2 S8192 H16, dense and causal) before they are timed. Each `--config`
text (as `benchmarks/bench_backward.py --config` takes it: `dq.KEY=VALUE,...`
on `sm90_backward.choose_config`'s config) is cross-lowered for sm_90a
(`tools/local_ptxas.py`: `capture`, `compile_to_ptx`), only the dQ kernel's
module (`--kernel dkv`: the dK/dV kernel's, each pass) is compiled by ptxas
to a cubin and decoded by `nvdisasm` (the `nvidia-cuda-nvdisasm` pip
wheel, `--nvdisasm PATH`), and printed: ptxas's registers and spill bytes, whether it serialized a wgmma (C7510-C7515), the
local-memory accesses in loops (`tools/sass_loops.py`), and every loop past
an mbarrier spin that holds a wgmma (the key-block loops: masked and
unmasked) with its instruction counts.

    python3 tools/dq_sass_counts.py --nvdisasm PATH [--causal] [--head-dim 192] \\
        [--value-head-dim 128] [--kernel dkv] --config "" --config "dq.block_kv=96" [--keep DIR]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import types

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE]

import local_ptxas  # noqa: E402
import local_sass  # noqa: E402

# The capture's file stems by kernel (`launch`'s role names).
KERNEL_STEMS = {"dq": "_dq", "dkv": "_dkdv"}
OPS = ("HGMMA", "MUFU.EX2", "FFMA", "FADD", "FMUL", "F2FP", "SYNCS", "BAR", "STL", "LDL")


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  local_sass.add_arguments(ap)
  ap.add_argument("--head-dim", type=int, default=192)
  ap.add_argument("--value-head-dim", type=int, default=128)
  ap.add_argument("--seq", type=int, default=8192)
  ap.add_argument("--heads", type=int, default=16)
  ap.add_argument("--causal", action="store_true")
  ap.add_argument("--config", action="append", default=None)
  ap.add_argument("--kernel", choices=("dq", "dkv"), default="dq",
                  help="which backward kernel's module to compile: dQ (default) or dK/dV "
                       "(every dK/dV pass)")
  args = ap.parse_args()
  tools = local_sass.toolchain(ap, args)
  for text in args.config or [""]:
    call = types.SimpleNamespace(
        kernel="backward", batch=2, seq=args.seq, heads=args.heads, kv_heads=None,
        head_dim=args.head_dim, value_head_dim=args.value_head_dim, dtype="bfloat16",
        causal=args.causal, soft_cap=None, config_text=text, grad=False)
    mask_name = "causal" if args.causal else "dense"
    with tempfile.TemporaryDirectory() as tmp:
      tmp = pathlib.Path(tmp)
      try:
        files = local_ptxas.capture(*local_ptxas._call(call), "sm_90", tmp)
      except Exception as e:  # a config that does not lower: say why, go on
        print(f"[{text}] {mask_name}: does not lower: {str(e).splitlines()[-1][:200]}",
              flush=True)
        continue
      files = [f for f in files if KERNEL_STEMS[args.kernel] in f.stem]
      for kernel in local_sass.compiled(files, tools, tmp, args.nvdisasm):
        if args.keep:
          tag = "".join(c if c.isalnum() or c in "=._-" else "_" for c in text) or "default"
          local_sass.keep(kernel, args.keep,
                          f"{args.kernel}-{kernel.name}-d{args.head_dim}-{args.value_head_dim}"
                          f"{'c' if args.causal else ''}-{tag}")
        local_sass.report(f"[{text}] {mask_name} {kernel.name}", kernel, OPS, notes=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
