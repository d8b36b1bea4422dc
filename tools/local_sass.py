"""A cross-lowered call's kernels under ptxas and nvdisasm, without a GPU: what
the `*_sass_counts.py` tools share.

`kernels_of` cross-lowers a call and yields its kernels; `compiled` takes
the Mosaic GPU modules `local_ptxas.capture` wrote, has the
jax CUDA plugin make their PTX (`local_ptxas.compile_to_ptx`), compiles each
with the local `ptxas -v` for sm_90a and decodes the cubin with `nvdisasm`
(the `nvidia-cuda-nvdisasm` pip wheel). `loop_table` finds the listing's
loops as `tools/sass_loops.py` does and counts the opcodes a tool asks for;
`report` prints a kernel's ptxas figures and its loops in the one format the
tools share.
"""

from __future__ import annotations

import collections
import dataclasses
import pathlib
import shutil
import subprocess
import tempfile

import local_ptxas
import sass_loops

GEMMS = ("HGMMA", "QGMMA")  # 16-bit and 8-bit wgmma


@dataclasses.dataclass
class Kernel:
  name: str  # the captured module's file stem
  ptx: str
  ptxas_log: str
  figures: dict  # `local_ptxas.parse`: registers, spill bytes, serialized, notes
  listing: str  # nvdisasm's SASS


def add_arguments(ap) -> None:
  """The tools' shared options: --nvdisasm PATH, --keep DIR."""
  ap.add_argument("--nvdisasm", default=shutil.which("nvdisasm"))
  ap.add_argument("--keep", default=None, help="write each kernel's PTX, SASS and ptxas log here")


def toolchain(ap, args):
  """(plugin, stub dir, ptxas path) for `compiled`; an argparse error without nvdisasm."""
  if not args.nvdisasm:
    ap.error("needs nvdisasm (--nvdisasm PATH; pip download nvidia-cuda-nvdisasm)")
  import jax

  plugin, stub_dir = local_ptxas.setup(local_ptxas._cache_dir(None), jax.__version__)
  return plugin, stub_dir, shutil.which("ptxas") or f"{local_ptxas.CUDA_ROOT}/bin/ptxas"


def compiled(files, tools, tmp: pathlib.Path, nvdisasm: str):
  """Each captured module of `files` as a `Kernel` (PTX, ptxas, SASS)."""
  plugin, stub_dir, ptxas = tools
  ptx = local_ptxas.compile_to_ptx(files, plugin, stub_dir, "sm_90")
  for f in files:
    src, cubin = tmp / "k.ptx", tmp / "k.cubin"
    src.write_text(ptx[f])
    log = subprocess.run([ptxas, "-arch=sm_90a", "-v", "-o", str(cubin), str(src)],
                         capture_output=True, text=True)
    listing = subprocess.run([nvdisasm, str(cubin)], capture_output=True, text=True,
                             check=True).stdout
    yield Kernel(f.stem, ptx[f], log.stdout + log.stderr,
                 local_ptxas.parse(log.stdout + log.stderr), listing)


def kernels_of(fn, specs, tools, args, stem: str):
  """Each kernel of the call `fn(*specs)` as a `Kernel`, cross-lowered for
  sm_90 into a temporary directory; with `args.keep`, also written there as
  `stem`-<kernel>.* (`keep`)."""
  with tempfile.TemporaryDirectory() as tmp:
    tmp = pathlib.Path(tmp)
    files = local_ptxas.capture(fn, specs, "sm_90", tmp)
    for kernel in compiled(files, tools, tmp, args.nvdisasm):
      if args.keep:
        keep(kernel, args.keep, f"{stem}-{kernel.name}")
      yield kernel


def keep(kernel: Kernel, directory, stem: str) -> None:
  """The kernel's PTX, SASS and ptxas log as `directory`/`stem`.*."""
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  (directory / f"{stem}.ptx").write_text(kernel.ptx)
  (directory / f"{stem}.sass").write_text(kernel.listing)
  (directory / f"{stem}.ptxas").write_text(kernel.ptxas_log)


def opcode_counts(instructions, body, ops) -> collections.Counter:
  """How many of the loop `body`'s instructions are each of `ops` (an
  opcode or its dotted variants), and "all"."""
  counts = collections.Counter()
  for i in body:
    op = instructions[i][1].split()[0] if instructions[i][1] else ""
    for name in ops:
      if op == name or op.startswith(name + "."):
        counts[name] += 1
  counts["all"] = len(body)
  return counts


def loop_table(listing: str, ops, marks=("MUFU.EX2",) + GEMMS):
  """(function, loop head address, counts of `ops`) of each loop past an
  mbarrier spin that holds one of `marks`, by function and size."""
  rows = []
  for function, lines in sass_loops._functions(listing):
    instructions, labels = sass_loops._parse(lines)
    for head, body in sass_loops._loops(sass_loops._successors(instructions, labels)):
      if len(body) <= sass_loops.SPIN_LOOP_SIZE:
        continue
      counts = opcode_counts(instructions, body, dict.fromkeys((*ops, *marks)))
      if any(counts[m] for m in marks):
        rows.append((function, instructions[head][0], counts))
  return sorted(rows, key=lambda r: (r[0], r[2]["all"]))


def report(label: str, kernel: Kernel, ops, marks=("MUFU.EX2",) + GEMMS, notes=False) -> None:
  """ptxas's figures, the spills in loops and each marked loop's counts."""
  figures = kernel.figures
  print(f"{label}: registers {figures['registers']}, spill stores/loads "
        f"{figures['spill_stores']}/{figures['spill_loads']}, serialized "
        f"{figures['serialized']}; loop spills {sass_loops.summary(kernel.listing)}", flush=True)
  if notes:
    for note in figures["notes"]:
      print(f"  {note.strip()[:160]}")
  for _, head, counts in loop_table(kernel.listing, ops, marks):
    shown = " ".join(f"{k} {counts[k]}" for k in ops if counts[k])
    print(f"  loop at {head:#07x}: {counts['all']} instructions; {shown}", flush=True)
