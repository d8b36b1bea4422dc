"""The examples run: each in a fresh Python process, in its quick mode."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent


def _run_example(script: str, *args: str, cwd) -> str:
  env = dict(os.environ)
  env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
  env["JAX_PLATFORMS"] = "cpu"
  result = subprocess.run([sys.executable, str(REPO / "examples" / script), *args],
                          cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, f"{script} failed:\n{result.stdout}\n{result.stderr}"
  return result.stdout


def test_train_tiny_lm_smoke(tmp_path):
  pytest.importorskip("flax")
  pytest.importorskip("optax")
  out = _run_example("train_tiny_lm.py", "--smoke", cwd=tmp_path)
  assert "attention served by fa4_jax implementation: 'xla'" in out, out
  match = re.search(r"loss (\d+\.\d+) -> (\d+\.\d+)", out)
  assert match, out
  first, last = map(float, match.groups())
  # 20 steps take the loss from ~ln(52) = 4 to ~2.6 on this corpus.
  assert last < first - 0.5, out


def test_generate_smoke(tmp_path):
  pytest.importorskip("flax")
  pytest.importorskip("optax")
  out = _run_example("generate.py", "--smoke", cwd=tmp_path)
  for path in ("fa4_jax", "jax.nn"):
    assert re.search(rf"^{re.escape(path)}: \d+ tokens in [\d.]+ s, [\d,]+ tokens/s", out,
                     re.MULTILINE), out
  # float32 greedy decoding: the two attention paths pick the same tokens.
  assert "greedy tokens agree (fa4_jax vs jax.nn): yes" in out, out
  # One token at a time through the KV cache = the uncached causal forward.
  gap = float(re.search(r"KV cache check: max \|logit difference\| from the uncached "
                        r"model (\S+)", out).group(1))
  assert gap < 1e-4, out
