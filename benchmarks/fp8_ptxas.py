"""ptxas's figures for `bench_fp8.py`'s float8 calls, on a machine without a GPU.

Issue #55's candidates wait for GPU time. A config that spills, serializes
its wgmmas or, asking for two CTAs an SM, cannot get them, need not wait: this
lowers each of `bench_fp8`'s calls for sm_90a under `fa4_jax.gpu_target`
(132 SMs, an H100's or H200's), compiles it with `tools/local_ptxas.py` and
prints one row per call and Mosaic GPU kernel. Calls: the row's defaults
(`bf16`, `fp8`, `fp8 default`, `fp8 paged`: `bench_fp8.case_calls`, what
`fa4_jax.attention` / `paged_attention` run today) and the candidates of `--configs`
(`CONFIG_CANDIDATES`), `--decode-configs` (`_decode_candidates`) and
`--paged-configs` (`PAGED_RULES`, paged rows), built on
the rows' shapes only (`jax.eval_shape`).

Columns: `grid x threads` and `SMEM` (the launch's dynamic bytes) from the
lowered module; `regs` (per thread at launch: Mosaic GPU emits `.maxntid`
and `.minnctapersm 1`, and under `setmaxnreg` ptxas then launches at the
largest count a warpgroup asks for, capped by 64 K registers over the
threads), `spills` (bytes stored / loaded) and `serialized` (a C7510-C7515
note) from `ptxas -v`. Decode rows:
`2/SM`, whether two CTAs fit an SM: regs x threads x 2 <= 65536 and
2 x (SMEM + 1 KiB reserved) <= 228 KiB. (`--d64-registers`, the D64
candidates of two CTAs an SM under other register counts, left with those
candidates: 0180d5c is the last commit to have them.)

  python3 benchmarks/fp8_ptxas.py [--only NAME ...] [--overlap]

The default rows (80 calls, one kernel each) take about 3 minutes on two CPU cores.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import subprocess
import sys
import time
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(HERE), HERE, os.path.join(os.path.dirname(HERE), "tools")]

import jax  # noqa: E402

import bench_common  # noqa: E402
import bench_fp8  # noqa: E402
import local_ptxas  # noqa: E402

ROWS = ("prefill B2 S8192 H32/8 D128", "prefill B2 S8192 H32/8 D128 causal",
        "prefill B2 S8192 H32/8 D256", "prefill B2 S8192 H32/8 D256 causal",
        "decode B8 T1 S32768 H32/8 D128", "decode B8 T1 S32768 H32/8 D64",
        "decode B16 T1 S16384 H8/1 D64", "paged B8 T16 S32768 H32/8 D128 page 64")
SKIP = ("xla",)  # the reference: XLA only
REGISTERS_PER_SM = 65536
SMEM_PER_SM = 228 * 1024
SMEM_RESERVED_PER_CTA = 1024
_C = r"%c(\d+)(?:_\d+)?"
_DIMS = r"\(%\w+ = {0}, %\w+ = {0}, %\w+ = {0}\)".format(_C)
_LAUNCH = re.compile(rf"blocks\([^)]*\) in {_DIMS} threads\([^)]*\) in {_DIMS} "
                     rf"dynamic_shared_memory_size %c(\d+)_i32")


@contextlib.contextmanager
def launches(into: list):
  """Appends (CTAs, threads, SMEM bytes) of each Mosaic GPU kernel lowered
  inside, in `local_ptxas.report`'s order."""
  from jax.experimental.mosaic.gpu import core as mgpu_core

  from fa4_jax.kernels import compile_ahead

  compile_ahead.install()  # before the patch, as local_ptxas.capture does
  original = mgpu_core._mosaic_gpu_lowering_rule

  def rule(ctx, *args, module, **kwargs):
    m = _LAUNCH.search(module.operation.get_asm(enable_debug_info=False))
    n = [int(g) for g in m.groups()] if m else [0] * 7
    into.append((n[0] * n[1] * n[2], n[3] * n[4] * n[5], n[6]))
    return original(ctx, *args, module=module, **kwargs)

  with mock.patch.object(mgpu_core, "_mosaic_gpu_lowering_rule", rule):
    yield


def two_per_sm(regs: int, threads: int, smem: int, spills: bool) -> str:
  why = [w for w, over in (("regs", regs * threads * 2 > REGISTERS_PER_SM),
                           ("SMEM", 2 * (smem + SMEM_RESERVED_PER_CTA) > SMEM_PER_SM)) if over]
  return "no: " + ", ".join(why) if why else "yes, with spills" if spills else "yes"


def ptxas_version() -> str:
  ptxas = shutil.which("ptxas") or f"{local_ptxas.CUDA_ROOT}/bin/ptxas"
  out = subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout.strip()
  return f"ptxas {out.splitlines()[-1] if out else '?'}"


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--only", action="append", default=None,
                  help="rows of bench_fp8.CASES whose name contains this (default: ROWS)")
  ap.add_argument("--overlap", action="store_true",
                  help="prefill rows: bench_fp8.py --overlap's columns (SERIAL_BLOCKS) "
                       "instead of CONFIG_CANDIDATES")
  args = ap.parse_args()
  from fa4_jax.target import gpu_target

  started = time.perf_counter()
  cases = bench_common.selected(bench_fp8.CASES, args.only) if args.only else [
      c for c in bench_fp8.CASES if c[0] in ROWS]
  header = ("| case | call | kernel | grid x threads | regs | spills (B) | serialized | SMEM KiB "
            "| 2/SM |\n|---|---|---|---|---|---|---|---|---|")
  lines = []
  print(header, flush=True)
  for case in cases:
    name, kind = case[0], case[1]
    x = jax.eval_shape(lambda case=case: bench_fp8.case_inputs(case))
    with gpu_target("sm90", num_sms=132):
      calls, _ = bench_fp8.case_calls(case, x, configs=kind == "prefill" and not args.overlap,
                                           decode_configs=kind != "prefill",
                                           paged_configs=kind == "paged",
                                           overlap=args.overlap)
    for label, (fn, specs) in calls.items():
      if label in SKIP:
        continue
      found = []
      try:
        with gpu_target("sm90", num_sms=132), launches(found):
          kernels = local_ptxas.report(fn, *specs, arch="sm_90")
      except Exception as e:  # noqa: BLE001 - one call that fails to build is a row, not the end
        kernels, error = [], f"{type(e).__name__}: {str(e)[:160]}"
      else:
        error = "no Mosaic GPU kernel (XLA)"
      rows = [f"| {name} | {label} | - | - | - | - | - | - | {error} |"] if not kernels else []
      for k, (ctas, threads, smem) in zip(kernels, found):
        regs = max(k["registers"], default=0)
        spills = max(k["spill_stores"], default=0), max(k["spill_loads"], default=0)
        fits = two_per_sm(regs, threads, smem, any(spills)) if kind == "decode" else ""
        rows.append(
            f"| {name} | {label} | {k['kernel']} | {ctas} x {threads} | {regs} | "
            f"{spills[0]}/{spills[1]} | "
            f"{'yes' if k['serialized'] else 'no'} | {smem / 1024:.1f} | {fits} |")
      if len(kernels) != len(found):
        rows.append(f"| {name} | {label} | ? | {len(found)} launches lowered for "
                    f"{len(kernels)} kernels | | | | | |")
      print("\n".join(rows), flush=True)
      lines += rows
  print(f"\n{ptxas_version()}, sm_90a; {len(cases)} rows in {time.perf_counter() - started:.0f} s\n")
  print(header)
  print("\n".join(lines))


if __name__ == "__main__":
  main()
