"""Where the warps of a profiled kernel wait: a summary of `ncu_profile.sh`'s SASS CSV.

    python3 tools/ncu_stalls.py NAME-sass.csv [--kernel 0] [--top 25]

Prints the stall reasons over all sampled instructions of one kernel of the
report (0: the first profiled launch; a backward call has two, dK/dV then dQ)
and the instructions with the most samples, each with its two main reasons.
Then the MUFU (special function unit) operations the kernel executed, by
opcode, and the cycles an SM's MUFU needs for them at Hopper's 16 per cycle
(`--sms`, default 132): set beside the kernel's elapsed cycles, how busy
that unit must have been.
"""

from __future__ import annotations

import argparse
import collections
import csv


def kernels_of(path: str) -> list[list[dict]]:
  """The CSV's rows, one list of {column: value} per kernel."""
  kernels, header = [], None
  with open(path, newline="") as fh:
    for row in csv.reader(fh):
      if row and row[0] == "Kernel Name":
        kernels.append([])
        header = None
      elif row and row[0] == "Address":
        header = row
      elif kernels and header and row and row[0].startswith("0x"):
        kernels[-1].append(dict(zip(header, row)))
  return kernels


def _count(value: str) -> int:
  return int(value) if value and value.isdigit() else 0


def _reasons(row: dict) -> dict[str, int]:
  return {k: _count(v) for k, v in row.items()
          if k.startswith("stall_") and "Not Issued" not in k}


MUFU_PER_CYCLE_PER_SM = 16  # CUDA C++ Programming Guide, throughput table, cc 9.0


def _opcode(source: str) -> str:
  words = source.split()
  if words and words[0].startswith("@"):  # a predicate
    words = words[1:]
  return words[0] if words else ""


def mufu_ops(rows) -> collections.Counter:
  """Thread-level MUFU operations executed, by opcode (MUFU.EX2, MUFU.TANH...)."""
  ops = collections.Counter()
  for r in rows:
    opcode = _opcode(r["Source"])
    if opcode.startswith("MUFU"):
      ops[opcode] += _count(r["Thread Instructions Executed"])
  return ops


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("csv")
  ap.add_argument("--kernel", type=int, default=0)
  ap.add_argument("--top", type=int, default=25)
  ap.add_argument("--sms", type=int, default=132)
  args = ap.parse_args()
  rows = kernels_of(args.csv)[args.kernel]
  samples = lambda r: _count(r["Warp Stall Sampling (All Samples)"])
  total = sum(samples(r) for r in rows) or 1
  by_reason = collections.Counter()
  for r in rows:
    by_reason.update(_reasons(r))
  print(f"kernel {args.kernel}: {len(rows)} instructions, {total} stall samples")
  for reason, n in by_reason.most_common(10):
    print(f"  {reason:22s} {n:8d} {n / total:6.1%}")
  print("instructions with the most samples (address, share, SASS, main reasons):")
  for r in sorted(rows, key=samples, reverse=True)[:args.top]:
    main_reasons = sorted(_reasons(r).items(), key=lambda kv: -kv[1])[:2]
    print(f"  {r['Address'][-5:]} {samples(r) / total:6.1%} {r['Source'].strip()[:58]:58s} "
          + ", ".join(f"{k[6:]} {v}" for k, v in main_reasons))
  ops = mufu_ops(rows)
  total_ops = sum(ops.values())
  print(f"MUFU operations: {total_ops:,} ("
        + ", ".join(f"{k} {v:,}" for k, v in ops.most_common()) + "); at "
        f"{MUFU_PER_CYCLE_PER_SM} per cycle per SM: "
        f"{total_ops / (MUFU_PER_CYCLE_PER_SM * args.sms):,.0f} cycles per SM")


if __name__ == "__main__":
  main()
