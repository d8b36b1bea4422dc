"""Compiling kernels under ptxas's reports, for the GPU tests (test support).

A test writes a script that fills `items` (name -> a function of no
arguments that runs one call's kernels); `compile_items` runs it in a child
process with Mosaic GPU's ptxas dumps switched on (after `COMPILE_EACH`,
which calls every item, or every `step`-th from `first`, and names the
reports each call left) and returns each call's reports. `serialized_wgmmas`
and `spill_bytes` read them.
"""

import os
import pathlib
import re
import subprocess
import sys

# Appended to a test's script: runs its `items` and names each call's reports
# (renamed, since the next call may reuse their names). argv: first, step.
COMPILE_EACH = r"""
import os as _os, sys as _sys
import jax as _jax
_dump = _os.environ["MOSAIC_GPU_DUMP_TO"]
_first, _step = (int(a) for a in _sys.argv[1:3]) if len(_sys.argv) > 2 else (0, 1)
print("ITEMS", len(items), flush=True)
for _index, (_name, _call) in enumerate(list(items.items())[_first::_step]):
  _jax.block_until_ready(_jax.jit(_call)())
  _new = []
  for _f in sorted(_os.listdir(_dump)):
    if _f.endswith(".ptxas") and not _f.startswith("call"):
      _new.append(f"call{_first}-{_index}-{_f}")
      _os.rename(_os.path.join(_dump, _f), _os.path.join(_dump, _new[-1]))
  print("CALL", "|".join([_name, *_new]), flush=True)
"""

# ptxas serializes a kernel's wgmmas (C7510-C7519) or ignores a setmaxnreg
# below what a warpgroup needs (C7507-C7509), as `ptxas info` lines.
SERIALIZED = re.compile(r"\(C75(0[7-9]|1\d)\)")


def start(script: str, dump_dir: pathlib.Path, *argv: str) -> subprocess.Popen:
  """The child process that compiles `script`'s items into `dump_dir`."""
  repo = pathlib.Path(__file__).resolve().parents[1]
  env = dict(os.environ, MOSAIC_GPU_DUMP_PTXAS="1", MOSAIC_GPU_DUMP_TO=str(dump_dir),
             PYTHONPATH=str(repo), XLA_PYTHON_CLIENT_PREALLOCATE="false")
  return subprocess.Popen([sys.executable, "-c", script + COMPILE_EACH, *argv], env=env,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def reports(proc: subprocess.Popen, dump_dir: pathlib.Path, timeout: float):
  """(number of items, [(call name, its report paths)]) of a `start`ed child;
  asserts that it succeeded."""
  out, err = proc.communicate(timeout=timeout)
  assert proc.returncode == 0, err[-3000:]
  calls, num_items = [], None
  for line in out.splitlines():
    if line.startswith("ITEMS "):
      num_items = int(line.split()[1])
    elif line.startswith("CALL "):
      name, *dumps = line[len("CALL "):].split("|")
      calls.append((name, [dump_dir / d for d in dumps]))
  return num_items, calls


def compile_items(script: str, dump_dir: pathlib.Path, timeout: float):
  """[(call name, its report paths)] of every item of `script`, compiled in
  one child; asserts that every item ran and left a report."""
  num_items, calls = reports(start(script, dump_dir), dump_dir, timeout)
  assert len(calls) == num_items, [name for name, _ in calls]
  assert all(dumps for _, dumps in calls), "a call left no ptxas report"
  return calls


def serialized_wgmmas(dumps) -> list[str]:
  """The lines of a call's reports that say ptxas serialized its wgmmas."""
  return [line.strip() for dump in dumps for line in dump.read_text().splitlines()
          if SERIALIZED.search(line)]


def spill_bytes(dumps) -> int:
  """Spill stores plus loads over every function of a call's reports."""
  return sum(int(a) + int(b) for dump in dumps
             for a, b in re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads",
                                    dump.read_text()))


def check_no_serialized_wgmmas(calls) -> None:
  """Prints every call's spill bytes; fails naming each serialized call."""
  for name, dumps in calls:
    print(f"spill bytes {spill_bytes(dumps):5d}  {name}")
  bad = [f"{name}: {line}" for name, dumps in calls for line in serialized_wgmmas(dumps)]
  assert not bad, "\n".join(bad)
