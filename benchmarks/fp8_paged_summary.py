"""Ratios of a `bench_fp8.py --only paged --paged-configs` run (issue #55).

For each paged row and each float8 column: TB/s (of the bf16 cache's
bytes), the ratio to the row's contiguous float8 cache (`fp8`, the default
contiguous plan) and, where the row has it, to the contiguous cache under
the same rule (`fp8 dec <rule>`), and the largest difference from the XLA
path. The target: pages >= 0.95 of the contiguous cache.

  python3 benchmarks/fp8_paged_summary.py RESULTS.json
"""

import json
import sys


def main(path: str) -> None:
  rows = json.load(open(path))["rows"]
  print("| row | column | TB/s | / fp8 contiguous | / same rule contiguous | max abs diff vs xla |")
  print("|---|---|---|---|---|---|")
  for row in rows:
    if row.get("kind") != "paged":
      continue
    base = row.get("fp8", {}).get("tb_per_s")
    for column, result in row.items():
      if not isinstance(result, dict) or not column.startswith("fp8"):
        continue
      if "error" in result:
        print(f"| {row['case']} | {column} | error: {result['error'][:80]} | | | |")
        continue
      tb = result["tb_per_s"]
      twin = None
      if column.startswith("fp8 paged "):
        twin = row.get("fp8 dec " + column[len("fp8 paged "):], {}).get("tb_per_s")
      diff = next((v for k, v in result.items() if k.startswith("max_abs_diff")), None)
      cells = [f"{tb:.2f}", f"{tb / base:.3f}" if base else "-",
               f"{tb / twin:.3f}" if twin else "-", "-" if diff is None else f"{diff:.3g}"]
      print(f"| {row['case']} | {column} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
  main(sys.argv[1])
