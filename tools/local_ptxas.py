"""ptxas's registers, spills and wgmma serialization notes, on a machine without a GPU.

`ptxas_report.py` needs a GPU because Mosaic GPU turns a kernel into PTX inside
the jax CUDA plugin (the PJRT plugin, `xla_cuda_plugin.so`), for the compute
capability the CUDA driver reports. This tool does the same on a CPU-only
machine:

1. cross-lowers the call for CUDA under `fa4_jax.gpu_target` (as
   `fa4_jax.testing.cross_lower` does) and keeps, per Mosaic GPU kernel, the
   serialized module that would go into the `mosaic_gpu_v2` custom call;
2. in a child process, loads the plugin `jax-cuda13-pjrt==0.11.2` (downloaded
   once with `pip download`, never installed) with `ctypes` and calls its
   exported `MosaicGpuCompile(module, size)`: Mosaic GPU's own C++ pass
   pipeline, LLVM's NVPTX backend included, with `MOSAIC_GPU_DUMP_PTX` set so
   that the PTX lands on the child's stdout. The driver is a stub
   `libcuda.so.1` built here with `cc` (on `LD_LIBRARY_PATH`) that reports
   compute capability 9.0 (10.0 for `--arch sm_100`); the compile stops after
   the PTX and the cubin, when the plugin tries to JIT-link the host code and
   load the module (expected: "JIT session error ..." on stderr);
3. runs `ptxas -arch=sm_90a -v` (the CUDA toolkit's, `--ptxas`) on each PTX and
   prints registers, stack frame, spill bytes and any "Potential Performance
   Loss: wgmma.mma_async instructions are serialized ..." line (C7510-C7515).

The plugin also needs a ptxas at `$MOSAIC_GPU_CUDA_ROOT/bin` (default
/usr/local/cuda) to pick the PTX ISA version. The numbers are the GPU
machine's when its ptxas is the same release: the PTX is the plugin's own.

    python3 tools/local_ptxas.py                      # fa4_jax.attention, B2 S4096 H16 D128 bf16
    python3 tools/local_ptxas.py --causal --grad      # forward and backward kernels
    python3 tools/local_ptxas.py --kernel forward --config num_kv_stages=3 --config ""
    python3 tools/local_ptxas.py --kernel backward --head-dim 128 --causal \
        --config dkv.consumer_registers=208,dkv.stats_first=False,dkv.fold_stats=False
    python3 tools/local_ptxas.py --keep /tmp/ptx      # also keep NAME.ptx / NAME.ptxas

From a script: `local_ptxas.report(fn, *specs, arch="sm_90")` gives each
kernel's registers, spills and serialization as a dict.

`--kernel forward|backward` builds `sm90_forward.forward` / `sm90_backward.backward`
with `benchmarks/bench_*.config_for` (the heuristic's config with `key=value`
overrides, as `ptxas_report.py --config` takes them). The plugin wheel, its
extracted `.so` and the driver stub are cached in `--cache`
(default `$XDG_CACHE_HOME/fa4_jax_local_ptxas`, else ~/.cache/...).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
BENCHMARKS = os.path.join(REPO, "benchmarks")

PLUGIN_PACKAGE = "jax-cuda13-pjrt"  # the plugin of `jax[cuda13]`, pyproject's extra
CUDA_ROOT = os.environ.get("MOSAIC_GPU_CUDA_ROOT", "/usr/local/cuda")

# The driver stub: the plugin asks the current context's device for its
# compute capability (cuCtxGetDevice, cuDeviceGetAttribute 75 / 76) before it
# compiles. Every driver entry point it does not find makes it fail later,
# after the PTX and the cubin: that is all we need.
_STUB_SOURCE = r"""
#include <stdlib.h>
typedef int CUresult; typedef int CUdevice; typedef void* CUcontext;
static int env(const char* n, int d) { const char* s = getenv(n); return s ? atoi(s) : d; }
CUresult cuInit(unsigned f) { return 0; }
CUresult cuDriverGetVersion(int* v) { *v = 13000; return 0; }
CUresult cuCtxGetDevice(CUdevice* d) { *d = 0; return 0; }
CUresult cuCtxGetCurrent(CUcontext* c) { *c = (void*)0x1; return 0; }
CUresult cuDeviceGet(CUdevice* d, int o) { *d = 0; return 0; }
CUresult cuDeviceGetCount(int* c) { *c = 1; return 0; }
CUresult cuDeviceGetAttribute(int* v, int attr, CUdevice d) {
  *v = attr == 75 ? env("STUB_CC_MAJOR", 9) : attr == 76 ? env("STUB_CC_MINOR", 0) : 0;
  return 0;
}
CUresult cuGetErrorString(CUresult r, const char** s) { *s = "stub driver, no GPU"; return 0; }
CUresult cuGetErrorName(CUresult r, const char** s) { *s = "CUDA_ERROR_STUB"; return 0; }
"""

# Runs in the child: compiles each module file named on the command line with
# the plugin, the C++ side's stdout (the PTX dump) going to MODULE.stdout.
_CHILD = r"""
import ctypes, os, sys
lib = ctypes.CDLL(sys.argv[1], mode=os.RTLD_LOCAL)
compile_ = lib.MosaicGpuCompile
compile_.restype = ctypes.c_void_p
compile_.argtypes = [ctypes.c_char_p, ctypes.c_int]
saved = os.dup(1)
for path in sys.argv[2:]:
  data = open(path, "rb").read()
  sys.stdout.flush()
  fd = os.open(path + ".stdout", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
  os.dup2(fd, 1)
  os.close(fd)
  try:
    compile_(data, len(data))  # fails after the PTX: no driver to load it
  finally:
    os.dup2(saved, 1)
"""


def _cache_dir(arg: str | None) -> pathlib.Path:
  if arg:
    return pathlib.Path(arg)
  base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
  return pathlib.Path(base) / "fa4_jax_local_ptxas"


def setup(cache: pathlib.Path, jax_version: str) -> tuple[pathlib.Path, pathlib.Path]:
  """The plugin's .so and the driver stub's folder, fetched / built once."""
  cache.mkdir(parents=True, exist_ok=True)
  plugin = cache / f"xla_cuda_plugin-{jax_version}.so"
  if not plugin.exists():
    wheels = cache / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--platform", "manylinux_2_27_x86_64",
                    "-d", str(wheels), f"{PLUGIN_PACKAGE}=={jax_version}"], check=True)
    wheel = next(wheels.glob(f"{PLUGIN_PACKAGE.replace('-', '_')}-{jax_version}-*.whl"))
    with zipfile.ZipFile(wheel) as z:
      member = next(n for n in z.namelist() if n.endswith("/xla_cuda_plugin.so"))
      with z.open(member) as src, open(str(plugin) + ".part", "wb") as dst:
        shutil.copyfileobj(src, dst)
    os.replace(str(plugin) + ".part", plugin)
    shutil.rmtree(wheels, ignore_errors=True)  # ~190 MB; the .so is what we keep
  stub_dir = cache / "stub_driver"
  stub = stub_dir / "libcuda.so.1"
  if not stub.exists():
    stub_dir.mkdir(exist_ok=True)
    (stub_dir / "stub.c").write_text(_STUB_SOURCE)
    subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", str(stub), str(stub_dir / "stub.c")],
                   check=True)
  return plugin, stub_dir


def _call(args):
  """The function to lower and its argument specs."""
  sys.path.insert(0, REPO)
  import jax
  import jax.numpy as jnp

  import fa4_jax

  dtype = jnp.dtype(args.dtype)
  q = jax.ShapeDtypeStruct((args.batch, args.seq, args.heads, args.head_dim), dtype)
  kv = jax.ShapeDtypeStruct((args.batch, args.seq, args.kv_heads or args.heads, args.head_dim),
                            dtype)
  dv = args.value_head_dim or args.head_dim
  vs = jax.ShapeDtypeStruct((args.batch, args.seq, args.kv_heads or args.heads, dv), dtype)
  os_ = jax.ShapeDtypeStruct((args.batch, args.seq, args.heads, dv), dtype)
  if args.kernel == "attention":
    def fwd(q, k, v):
      return fa4_jax.attention(q, k, v, is_causal=args.causal, logits_soft_cap=args.soft_cap)
    if args.grad:
      return jax.grad(lambda q, k, v: fwd(q, k, v).astype(jnp.float32).sum(),
                      argnums=(0, 1, 2)), (q, kv, vs)
    return fwd, (q, kv, vs)

  sys.path.insert(0, BENCHMARKS)
  from fa4_jax.kernels import sm90_backward, sm90_forward
  from fa4_jax.scores import MaskSpec, ScoreFunction
  mask = MaskSpec.from_arguments(args.causal, None)
  score = ScoreFunction(args.head_dim ** -0.5, args.soft_cap)
  if args.kernel == "forward":
    import bench_forward
    config = bench_forward.config_for(args.config_text, args.head_dim, mask, args.seq)
    return (lambda q, k, v: sm90_forward.forward(
        q, k, v, None, None, score=score, mask=mask, config=config)[0]), (q, kv, vs)
  import bench_backward
  group = args.heads // (args.kv_heads or args.heads)
  config = bench_backward.config_for(args.config_text, args.head_dim, mask, group,
                                     value_head_dim=args.value_head_dim)
  lse = jax.ShapeDtypeStruct((args.batch, args.heads, args.seq), jnp.float32)
  return (lambda q, k, v, o, lse: sm90_backward.backward(
      q, k, v, o, lse, o, None, None, score=score, mask=mask, config=config)), (q, kv, vs, os_,
                                                                              lse)


def capture(fn, specs, arch: str, into: pathlib.Path) -> list[pathlib.Path]:
  """Cross-lowers `fn(*specs)` for `arch`; writes each kernel's custom-call
  module, returns the files."""
  import jax
  from unittest import mock

  from jax.experimental.mosaic.gpu import core as mgpu_core

  from fa4_jax.kernels import compile_ahead
  from fa4_jax.target import gpu_target

  modules: list[tuple[str, bytes]] = []
  compile_ahead.install()  # before the patch, as fa4_jax.testing does
  original = mgpu_core._mosaic_gpu_lowering_rule

  def capturing_rule(ctx, *a, module, **kw):
    attrs = module.operation.attributes
    name = attrs["sym_name"].value if "sym_name" in attrs else "kernel"
    # What the rule puts in the custom call (core._mosaic_gpu_lowering_rule).
    serialized = mgpu_core._run_serde_pass(module, serialize=True)
    buf = io.BytesIO()
    serialized.operation.write_bytecode(buf, desired_version=0)
    modules.append((name, buf.getvalue()))
    return original(ctx, *a, module=module, **kw)

  jax.clear_caches()
  with gpu_target(arch.replace("_", "")), \
       mock.patch.object(mgpu_core, "_mosaic_gpu_lowering_rule", capturing_rule):
    jax.jit(fn).trace(*specs).lower(lowering_platforms=("cuda",))
  files = []
  for i, (name, data) in enumerate(modules):
    path = into / f"{i}_{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.mlirbc"
    path.write_bytes(data)
    files.append(path)
  return files


_PTX_START = re.compile(r"^//\n// Generated by LLVM NVPTX Back-End", re.M)


def compile_to_ptx(files, plugin, stub_dir, arch) -> dict[pathlib.Path, str | None]:
  """Each module's PTX (None where the plugin printed none), via the plugin."""
  major, minor = {"sm_90": (9, 0), "sm_100": (10, 0)}[arch]
  env = dict(os.environ, MOSAIC_GPU_DUMP_PTX="1", MOSAIC_GPU_CUDA_ROOT=CUDA_ROOT,
             STUB_CC_MAJOR=str(major), STUB_CC_MINOR=str(minor),
             LD_LIBRARY_PATH=os.pathsep.join(
                 filter(None, [str(stub_dir), os.environ.get("LD_LIBRARY_PATH")])))
  for var in ("MOSAIC_GPU_DUMP_TO", "MOSAIC_GPU_DUMP_PTXAS", "MOSAIC_GPU_DUMP_SASS",
              "MOSAIC_GPU_DUMP_SASS_CTRL", "MOSAIC_GPU_DUMP_MLIR_PASSES",
              "MOSAIC_GPU_RUNTIME_LIB_PATH"):
    env.pop(var, None)  # DUMP_TO would switch every dump on (SASS needs nvdisasm)
  child = subprocess.run([sys.executable, "-c", _CHILD, str(plugin), *map(str, files)],
                         env=env, capture_output=True, text=True)
  out = {}
  for f in files:
    dump = pathlib.Path(str(f) + ".stdout")
    text = dump.read_text() if dump.exists() else ""
    m = _PTX_START.search(text)
    out[f] = text[m.start():] if m else None
    if out[f] is None:
      sys.stderr.write(f"{f.name}: no PTX from the plugin (child rc {child.returncode}); "
                       f"its stderr:\n{child.stderr[-3000:]}\n")
  return out


def ptxas_report(ptx: str, arch: str, ptxas: str, extra: list[str]) -> str:
  with tempfile.TemporaryDirectory() as tmp:
    src = pathlib.Path(tmp) / "k.ptx"
    src.write_text(ptx)
    r = subprocess.run([ptxas, f"-arch={arch}a", "-v", *extra, "-o", os.devnull, str(src)],
                       capture_output=True, text=True)
  return r.stdout + r.stderr


def parse(log: str) -> dict:
  """What ptxas's -v log says of a kernel."""
  return dict(
      registers=[int(r) for r in re.findall(r"Used (\d+) registers", log)],
      spill_stores=[int(s) for s in re.findall(r"(\d+) bytes spill stores", log)],
      spill_loads=[int(s) for s in re.findall(r"(\d+) bytes spill loads", log)],
      serialized=bool(re.search(r"wgmma.mma_async instructions are serialized", log)),
      notes=sorted(set(re.findall(r"[^\n]*(?:warning|Performance Loss)[^\n]*", log))))


def report(fn, *specs, arch: str = "sm_90", ptxas: str | None = None, extra=(),
           cache: str | None = None) -> list[dict]:
  """ptxas's figures for each Mosaic GPU kernel of `fn(*specs)` (arrays or
  `jax.ShapeDtypeStruct`s), from a script: [{kernel, registers,
  spill_stores, spill_loads, serialized, notes, log}], in launch order."""
  import jax
  plugin, stub_dir = setup(_cache_dir(cache), jax.__version__)
  ptxas = ptxas or shutil.which("ptxas") or f"{CUDA_ROOT}/bin/ptxas"
  out = []
  with tempfile.TemporaryDirectory() as tmp:
    files = capture(fn, specs, arch, pathlib.Path(tmp))
    ptx = compile_to_ptx(files, plugin, stub_dir, arch)
    for f in files:
      if ptx[f] is None:
        raise RuntimeError(f"{f.stem}: the plugin gave no PTX")
      log = ptxas_report(ptx[f], arch, ptxas, list(extra))
      out.append(dict(kernel=f.stem, **parse(log), log=log))
  return out


def summarize(log: str) -> list[str]:
  lines = []
  for fn in re.findall(r"Compiling entry function '([^']+)'", log) or ["?"]:
    lines.append(f"  entry {fn}")
  regs = re.findall(r"Used (\d+) registers", log)
  stack = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads",
                     log)
  lines.append(f"  registers {', '.join(regs) or '?'}; stack/spill-stores/spill-loads "
               f"{', '.join('/'.join(s) for s in stack) or '?'}")
  notes = sorted(set(re.findall(r"[^\n]*(?:warning|error|Performance Loss)[^\n]*", log)))
  lines += [f"  {n.strip()}" for n in notes]
  return lines


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--kernel", choices=("attention", "forward", "backward"), default="attention",
                  help="fa4_jax.attention (heuristic kernels), or the sm90 forward / backward "
                       "with --config overrides")
  ap.add_argument("--grad", action="store_true", help="with --kernel attention: its gradient too")
  ap.add_argument("--batch", type=int, default=2)
  ap.add_argument("--seq", type=int, default=4096)
  ap.add_argument("--heads", type=int, default=16)
  ap.add_argument("--kv-heads", type=int, default=None)
  ap.add_argument("--head-dim", type=int, default=128)
  ap.add_argument("--value-head-dim", type=int, default=None,
                  help="V's (and O's, dO's) head dim where it has its own (192 / 128)")
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--causal", action="store_true")
  ap.add_argument("--soft-cap", type=float, default=None)
  ap.add_argument("--config", action="append", default=None,
                  help="with --kernel forward/backward: key=value,... overrides; repeatable")
  ap.add_argument("--arch", choices=("sm_90", "sm_100"), default="sm_90")
  ap.add_argument("--ptxas", default=shutil.which("ptxas") or f"{CUDA_ROOT}/bin/ptxas")
  ap.add_argument("--ptxas-arg", action="append", default=[], help="extra ptxas argument")
  ap.add_argument("--cache", default=None, help="where the plugin and the driver stub are kept")
  ap.add_argument("--keep", default=None, help="write NAME.ptx and NAME.ptxas here")
  ap.add_argument("--json", action="store_true", help="one JSON object per kernel instead")
  args = ap.parse_args()
  if args.kernel == "attention" and args.config:
    ap.error("--config needs --kernel forward or backward")

  sys.path.insert(0, REPO)
  import jax
  plugin, stub_dir = setup(_cache_dir(args.cache), jax.__version__)
  version = subprocess.run([args.ptxas, "--version"], capture_output=True, text=True).stdout
  print(f"ptxas {args.ptxas}: {version.strip().splitlines()[-1] if version else '?'}", flush=True)
  status = 0
  for text in args.config or [""]:
    args.config_text = text
    with tempfile.TemporaryDirectory() as tmp:
      files = capture(*_call(args), args.arch, pathlib.Path(tmp))
      ptx = compile_to_ptx(files, plugin, stub_dir, args.arch)
      print(f"== {args.kernel}{' grad' if args.grad else ''} B{args.batch} S{args.seq} "
            f"H{args.heads} D{args.head_dim}"
            f"{'/' + str(args.value_head_dim) if args.value_head_dim else ''} {args.dtype}{' causal' if args.causal else ''} "
            f"{args.arch} config [{text}]: {len(files)} kernel(s)", flush=True)
      for f in files:
        name = f.stem
        if ptx[f] is None:
          print(f"{name}: no PTX")
          status = 1
          continue
        log = ptxas_report(ptx[f], args.arch, args.ptxas, args.ptxas_arg)
        if args.keep:
          keep = pathlib.Path(args.keep)
          keep.mkdir(parents=True, exist_ok=True)
          tag = re.sub(r"[^A-Za-z0-9_.=-]", "_", text)
          base = f"{name}{'.' + tag if tag else ''}"
          (keep / f"{base}.ptx").write_text(ptx[f])
          (keep / f"{base}.ptxas").write_text(log)
        if args.json:
          print(json.dumps(dict(kernel=name, config=text, **parse(log))))
        else:
          print(f"{name}:")
          print("\n".join(summarize(log)), flush=True)
  return status


if __name__ == "__main__":
  sys.exit(main())
