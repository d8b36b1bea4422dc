"""benchmarks/sweep.py: the CPU check end to end, and the GPU sweep's skipping."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
SWEEP = REPO / "benchmarks" / "sweep.py"


def test_cpu_check_quick_writes_results(tmp_path):
  env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
  run = subprocess.run([sys.executable, str(SWEEP), "--quick", "--out", str(tmp_path)],
                       env=env, capture_output=True, text=True, timeout=180)
  assert run.returncode == 0, run.stderr[-3000:]
  assert "No GPU here" in run.stdout  # it says it is not the GPU sweep

  (json_path,) = tmp_path.glob("sweep-cpu-check-*.json")
  assert list(tmp_path.glob("sweep-cpu-check-*.md"))
  assert list(tmp_path.glob("sweep-cpu-check-*.png"))
  result = json.loads(json_path.read_text())
  assert result["mode"] == "cpu-check"
  assert result["device"].startswith("cpu") and result["jax"] and result["date"]
  assert len(result["rows"]) >= 4
  for row in result["rows"]:
    assert row["fa4_jax_served_by"] == "xla"
    for impl in ("fa4_jax", "jax.nn xla"):
      for pass_name in ("forward", "fwd+bwd"):
        entry = row[impl][pass_name]
        assert entry["max_err"] < 1e-4, (row["case"], impl, pass_name, entry)
        assert entry["ms"] > 0


def test_gpu_sweep_skips_instead_of_crashing():
  """The GPU code path on the CPU, with a wall-clock timer: cuDNN is refused
  here and a tiny memory limit stops everything else; both become skips."""
  sys.path.insert(0, str(SWEEP.parent))
  import sweep

  case = sweep.Case(B=1, S=128, Hq=2, Hkv=1, D=64, causal=True)
  (row,) = sweep.gpu_sweep([case], timer=lambda f, *a: sweep.bench_common.wall_ms(f, a, 1),
                           memory_limit=1024)
  for pass_name in sweep.PASSES:
    assert row["cudnn"][pass_name]["skipped"].startswith("refused")
    assert row["fa4_jax"][pass_name]["skipped"].startswith("out of memory")
  assert "skipped (refused)" in sweep.gpu_markdown([row])


def test_a_sweep_run_in_parts_is_written_whole_from_its_logs(tmp_path):
  """Rows printed by two partial runs become one table, in the sweep's case
  order, whatever order the logs come in; missing cases mark it partial."""
  sys.path.insert(0, str(SWEEP.parent))
  import sweep

  cases = sweep.gpu_cases(quick=False)
  header = "GPU sweep on Test GPU, jax 0.0.0, 2026-01-02\n"

  def log(name, some_cases):
    rows = [dict(case=c.name, group=c.group, S=c.S, causal=c.causal,
                 fa4_jax_served_by="sm90",
                 **{i: {p: {"ms": 1.0, "tflops": float(c.S)} for p in sweep.PASSES}
                    for i in sweep.GPU_IMPLS}) for c in some_cases]
    path = tmp_path / name
    path.write_text(header + "".join(json.dumps(r) + "\n" for r in rows))
    return str(path)

  half = len(cases) // 2
  logs = [log("second.log", cases[half:]), log("first.log", cases[:half])]
  sweep.main(["--from-logs", *logs, "--out", str(tmp_path / "whole")])
  (written,) = (tmp_path / "whole").glob("sweep-Test_GPU-2026-01-02.json")
  meta = json.loads(written.read_text())
  assert [r["case"] for r in meta["rows"]] == [c.name for c in cases]
  assert meta["device"] == "Test GPU" and meta["jax"] == "0.0.0"

  sweep.main(["--from-logs", logs[1], "--out", str(tmp_path / "part")])
  assert list((tmp_path / "part").glob("sweep-Test_GPU-2026-01-02-partial.md"))


def test_a_part_rerun_on_a_later_day_replaces_its_rows(tmp_path):
  sys.path.insert(0, str(SWEEP.parent))
  import sweep

  cases = sweep.gpu_cases(quick=False)

  def log(name, header, some_cases, tflops):
    rows = [dict(case=c.name, group=c.group, S=c.S, causal=c.causal,
                 fa4_jax_served_by="sm90",
                 **{i: {p: {"ms": 1.0, "tflops": tflops} for p in sweep.PASSES}
                    for i in sweep.GPU_IMPLS}) for c in some_cases]
    path = tmp_path / name
    path.write_text(header + "".join(json.dumps(r) + "\n" for r in rows))
    return str(path)

  old = log("all.log", "GPU sweep on Test GPU, jax 0.0.0, 2026-01-02, commit aaa\n", cases, 1.0)
  new = log("redo.log", "GPU sweep on Test GPU, jax 0.0.0, 2026-01-05, commit bbb\n",
            cases[:2], 2.0)
  sweep.main(["--from-logs", old, new, "--out", str(tmp_path / "out")])
  (written,) = (tmp_path / "out").glob("sweep-Test_GPU-2026-01-05.json")
  meta = json.loads(written.read_text())
  got = [r["fa4_jax"]["forward"]["tflops"] for r in meta["rows"]]
  assert got == [2.0, 2.0] + [1.0] * (len(cases) - 2)
  assert "all.log (2026-01-02): aaa" in meta["commit"]
  assert "redo.log (2026-01-05): bbb" in meta["commit"]

  other = log("other.log", "GPU sweep on Other GPU, jax 0.0.0, 2026-01-05\n", cases[:1], 3.0)
  with pytest.raises(SystemExit, match="one device"):
    sweep.main(["--from-logs", old, other, "--out", str(tmp_path / "bad")])
