"""Compile the sm_100 kernels (forward, backward) to PTX and SASS without a Blackwell GPU.

Mosaic GPU compiles a kernel inside the CUDA plugin, for the compute
capability the CUDA driver reports (`cuDeviceGetAttribute`); no environment
variable changes that target. On a machine with any NVIDIA GPU (an H100 here)
this probe preloads a tiny shim that makes the driver report 10.0, so the
plugin lowers and assembles the kernel for sm_100a and, with the
`MOSAIC_GPU_DUMP_*` variables, leaves the PTX, the ptxas report and the SASS
in a folder. Running the cubin then fails (it is not H100 code): expected.

    python3 tools/sm100_compile_probe.py OUT_DIR

It ends with one line per kernel: registers, stack frame and spill bytes
from ptxas (`report`).

Not used by the library; a tool for checking the Blackwell kernel where no
Blackwell GPU is available. The dump folder's `*.ptxas` / `*.resources.txt`
are the register, spill, SMEM and TMEM facts for sm_100a.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

# Preloaded into the probe process: wraps the driver's cuDeviceGetAttribute
# (however it is looked up: dlsym or cuGetProcAddress) so that the compute
# capability reads 10.0. Everything else passes through.
_SHIM_SOURCE = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <string.h>
typedef int CUresult;
typedef int CUdevice;
#define CC_MAJOR 75  /* CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR */
#define CC_MINOR 76  /* CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR */
static CUresult (*real_attr)(int*, int, CUdevice);
static CUresult fake_attr(int* v, int attr, CUdevice d) {
  CUresult r = real_attr(v, attr, d);
  if (r == 0 && attr == CC_MAJOR) *v = 10;
  if (r == 0 && attr == CC_MINOR) *v = 0;
  return r;
}
static CUresult (*real_gpa)(const char*, void**, int, unsigned long long);
static CUresult (*real_gpa2)(const char*, void**, int, unsigned long long, void*);
static void* wrap(const char* name, void* p) {
  if (p && strcmp(name, "cuDeviceGetAttribute") == 0) { real_attr = p; return (void*)fake_attr; }
  return p;
}
static CUresult fake_gpa(const char* s, void** f, int v, unsigned long long fl) {
  CUresult r = real_gpa(s, f, v, fl); if (r == 0) *f = wrap(s, *f); return r;
}
static CUresult fake_gpa2(const char* s, void** f, int v, unsigned long long fl, void* st) {
  CUresult r = real_gpa2(s, f, v, fl, st); if (r == 0) *f = wrap(s, *f); return r;
}
void* dlsym(void* h, const char* name) {
  static void* (*real_dlsym)(void*, const char*);
  if (!real_dlsym) real_dlsym = dlvsym(RTLD_NEXT, "dlsym", "GLIBC_2.2.5");
  void* p = real_dlsym(h, name);
  if (!p) return p;
  if (strcmp(name, "cuGetProcAddress") == 0) { real_gpa = p; return (void*)fake_gpa; }
  if (strcmp(name, "cuGetProcAddress_v2") == 0) { real_gpa2 = p; return (void*)fake_gpa2; }
  return wrap(name, p);
}
"""


def build_shim(out_dir: pathlib.Path) -> pathlib.Path:
  src = out_dir / "cc100_shim.c"
  lib = out_dir / "cc100_shim.so"
  src.write_text(_SHIM_SOURCE)
  cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
  if cc is None:
    raise RuntimeError("no C compiler on PATH to build the shim")
  subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(lib), str(src), "-ldl"], check=True)
  return lib


# (head_dim, causal, option): each kernel once, and with each option that
# changes its registers: segment ids (a block's key ids held in registers for
# the element mask), soft-cap (a tanh per score element in the softmax) and
# sinks (the sink in the initial row statistics, a row iota in the epilogue).
VARIANTS = ((64, False, None), (128, True, None), (256, False, None),
            (128, True, "segment_ids"), (256, False, "segment_ids"),
            (128, True, "soft_cap"), (128, True, "sinks"))


# (head_dim, causal, option) of the backward: each call compiles its dK/dV
# and its dQ kernel.
BACKWARD_VARIANTS = ((64, False, None), (128, True, None), (128, True, "segment_ids"),
                     (128, True, "soft_cap"))


def _options(option, shape, numpy):
  from fa4_jax.scores import ScoreFunction

  return {
      None: {},
      "segment_ids": dict(segment_ids=(numpy.zeros(shape[:2], numpy.int32),) * 2),
      "soft_cap": dict(score=ScoreFunction(0.1, 30.0)),
      "sinks": dict(sinks=numpy.zeros((shape[2],), numpy.float32)),
  }[option]


def _compile_in_this_process(dump_dir: str) -> None:
  """Runs in the child (shim preloaded): trace, lower, compile the kernel."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from fa4_jax.kernels import sm100_backward, sm100_forward
  from fa4_jax.scores import MaskSpec, ScoreFunction

  print("device:", jax.devices()[0], "compute_capability:",
        getattr(jax.devices()[0], "compute_capability", None), flush=True)
  for head_dim, causal, option in VARIANTS:
    shape = (1, 512, 2, head_dim)
    q = jnp.zeros(shape, jnp.bfloat16)
    lengths = jnp.full((1,), 512, jnp.int32)
    # numpy, not jnp: an eager jnp op would itself be compiled for sm_100a
    # and fail to load before the kernel is built.
    options = {"score": ScoreFunction(0.1)} | _options(option, shape, np)
    fn = jax.jit(lambda q, k, v, a, b, causal=causal, options=options: sm100_forward.forward(
        q, k, v, a, b, mask=MaskSpec.from_arguments(causal, None), **options))
    name = f"head_dim={head_dim} causal={causal} option={option}"
    try:
      jax.block_until_ready(fn(q, q, q, lengths, lengths))
      print(f"{name}: ran (unexpected on a non-Blackwell GPU)", flush=True)
    except Exception as e:  # the sm_100a cubin cannot load on this GPU
      print(f"{name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
  for head_dim, causal, option in BACKWARD_VARIANTS:
    shape = (1, 512, 2, head_dim)
    x = np.zeros(shape, np.float32).astype(jnp.bfloat16)
    lse = np.zeros((1, 2, 512), np.float32)
    lengths = np.full((1,), 512, np.int32)
    options = {"score": ScoreFunction(0.1)} | _options(option, shape, np)
    fn = jax.jit(lambda q, k, v, o, lse, do, a, b, causal=causal, options=options:
                 sm100_backward.backward(q, k, v, o, lse, do, a, b,
                                         mask=MaskSpec.from_arguments(causal, None), **options))
    name = f"backward head_dim={head_dim} causal={causal} option={option}"
    try:
      jax.block_until_ready(fn(x, x, x, x, lse, x, lengths, lengths))
      print(f"{name}: ran (unexpected on a non-Blackwell GPU)", flush=True)
    except Exception as e:
      print(f"{name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
  print("dumped:", sorted(os.listdir(dump_dir)), flush=True)


def disassemble(dump_dir) -> None:
  """`<kernel>_N.sass` beside each `<kernel>_N.ptx` of `dump_dir`: ptxas for
  sm_100a, then cuobjdump (the plugin's own dump leaves no SASS for a
  target the device is not). Skipped where the CUDA tools are missing."""
  tools = [shutil.which(t, path=os.pathsep.join(["/usr/local/cuda/bin", os.environ.get("PATH", "")]))
           for t in ("ptxas", "cuobjdump")]
  if None in tools:
    print("no ptxas / cuobjdump: SASS not disassembled", flush=True)
    return
  ptxas, cuobjdump = tools
  for ptx in pathlib.Path(dump_dir).glob("*.ptx"):
    cubin = ptx.with_suffix(".cubin")
    subprocess.run([ptxas, "-arch=sm_100a", str(ptx), "-o", str(cubin)], check=True)
    sass = subprocess.run([cuobjdump, "-sass", str(cubin)], check=True, capture_output=True, text=True)
    ptx.with_suffix(".sass").write_text(sass.stdout)


def report(dump_dir) -> list[dict]:
  """Registers, stack frame and spill bytes of every kernel ptxas assembled
  in `dump_dir` (its `*.ptxas` files), in dump order (ptxas reports a
  kernel's figures more than once in a file: the largest is kept), and,
  where `disassemble` left its SASS, how many local-memory accesses (spills)
  sit in a loop larger than an mbarrier spin (`sass_loops`)."""
  import re

  sys.path.insert(0, HERE)
  import sass_loops

  rows = []
  # Files are named <kernel>_<N>.ptxas, N counting the modules lowered.
  for path in sorted(pathlib.Path(dump_dir).glob("*.ptxas"),
                     key=lambda p: int(re.findall(r"(\d+)", p.name)[-1])):
    text = path.read_text()
    numbers = lambda pattern: [int(x) for x in re.findall(pattern, text)]
    rows.append(dict(file=path.name, registers=max(numbers(r"Used (\d+) registers"), default=0),
                     stack=max(numbers(r"(\d+) bytes stack frame"), default=0),
                     spill_stores=max(numbers(r"(\d+) bytes spill stores"), default=0),
                     spill_loads=max(numbers(r"(\d+) bytes spill loads"), default=0)))
    sass = path.with_suffix(".sass")
    if sass.exists():
      rows[-1]["loop_spill_accesses"] = sass_loops.summary(sass.read_text())["in_loops_past_spins"]
  return rows


def main(out: str) -> int:
  out_dir = pathlib.Path(out).resolve()
  dump_dir = out_dir / "mosaic_dump"
  dump_dir.mkdir(parents=True, exist_ok=True)
  shim = build_shim(out_dir)
  env = dict(os.environ)
  cuda_bins = [p for p in ("/usr/local/cuda/bin",) if os.path.isdir(p)]
  env.update(
      LD_PRELOAD=str(shim),
      PATH=os.pathsep.join([*cuda_bins, env.get("PATH", "")]),  # nvdisasm for SASS
      MOSAIC_GPU_DUMP_PTX="1",
      MOSAIC_GPU_DUMP_PTXAS="1",
      MOSAIC_GPU_DUMP_SASS="1",
      MOSAIC_GPU_DUMP_RESOURCES="1",
      MOSAIC_GPU_DUMP_TO=str(dump_dir),
      # XLA's autotuner runs candidate fusions (the backward's delta
      # reduction), which cannot load on the real GPU under the shim.
      XLA_FLAGS=" ".join([env.get("XLA_FLAGS", ""), "--xla_gpu_autotune_level=0"]).strip(),
  )
  code = (f"import sys; sys.path[:0] = [{HERE!r}, {REPO!r}]; import sm100_compile_probe as p; "
          f"p._compile_in_this_process({str(dump_dir)!r})")
  code = subprocess.run([sys.executable, "-c", code], env=env).returncode
  disassemble(dump_dir)
  for row in report(dump_dir):
    print(row, flush=True)
  return code


if __name__ == "__main__":
  sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "sm100_probe_out"))
