"""tools/fuzz_attention.py draws random calls and flags those that differ
from the einsum reference: it passes a correct implementation and catches a
wrong one."""

import pathlib
import sys

import numpy as np
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tools"))
import fuzz_attention  # noqa: E402


def test_draws_cover_the_options_each_call_can_combine():
  rng = np.random.default_rng(0)
  calls = [fuzz_attention.draw_call(rng, "sm90", 200) for _ in range(60)]
  assert any(c["segment_ids"] is not None for c in calls)
  assert any(c["sinks"] is not None for c in calls)
  assert any(c["soft_cap"] is not None for c in calls)
  assert any(c["q_lengths"] is not None for c in calls)
  assert any(c["window"] is not None for c in calls)
  assert any(c["q_heads"] > c["kv_heads"] for c in calls)
  assert {c["dtype"] for c in calls} == {"bfloat16", "float16", "float8_e4m3fn"}
  assert {c["score_mod"] for c in calls} == {None, "alibi", "table"}
  assert {c["mask_mod"] for c in calls} == {None, "prefix", "chunked", "window_global"}
  assert any(c["value_head_dim"] != c["head_dim"] for c in calls)


def test_the_xla_path_passes_and_a_wrong_mask_fails(monkeypatch, capsys):
  argv = ["fuzz_attention.py", "--implementation", "xla", "--trials", "3", "--max-seq", "60"]
  monkeypatch.setattr(sys, "argv", argv)
  assert fuzz_attention.main() == 0
  right = fuzz_attention.einsum_attention
  # A reference that lets every row see every key: every masked call differs.
  monkeypatch.setattr(fuzz_attention, "einsum_attention",
                      lambda q, k, v, visible, **kw: right(q, k, v, visible | True, **kw))
  monkeypatch.setattr(sys, "argv", argv + ["--seed", "3"])
  assert fuzz_attention.main() == 1
  assert "reproduce: --implementation xla --seed 3" in capsys.readouterr().out


def test_the_sinks_gradient_is_measured_against_its_terms_and_a_wrong_one_fails():
  """d sinks sums one term per row, of both signs; a 16-bit kernel's rounding
  errs each term a little, which can be large beside a sum that cancels, but
  not beside the terms' L2 norm (here 1.5 against a sum of 0.3)."""
  qkv = [np.ones((2, 3)), np.ones((2, 3)), np.ones((2, 3))]
  want = qkv + [np.array([0.3])]
  terms = np.array([1.5])
  error = lambda sinks: fuzz_attention.gradient_error(qkv + [np.array([sinks])], want, terms)
  assert error(0.3 + 0.015) == pytest.approx(0.01)  # 5 % of the sum, 1 % of the terms
  # Wrong by the sum's size: flagged (bf16 tolerance 2e-2).
  assert error(0.6) == pytest.approx(0.2)
  assert error(-0.3) == pytest.approx(0.4)
  # Without the terms, the error is relative to the sum.
  assert fuzz_attention.gradient_error(qkv + [np.array([0.315])], want) == pytest.approx(0.05)


def test_a_captured_arrays_gradient_is_measured_against_its_row_terms():
  """As the sinks': a score_mod's array's gradient (fourth) against the L2
  norm of the delta-weighted row terms it sums, where that is larger; a
  gradient wrong by its own size still fails."""
  qkv = [np.ones((2, 3))] * 3
  want = qkv + [np.array([0.3, -0.1])]
  terms = np.float64(2.0)
  error = lambda got: fuzz_attention.gradient_error(qkv + [np.array(got)], want,
                                                    captured_terms=terms)
  assert error([0.32, -0.1]) == pytest.approx(0.01)  # 0.02 off: 1 % of the terms
  assert error([0.0, 0.0]) > 2e-2 * 7  # a lost gradient: far past bf16's 2e-2
  assert error([-0.3, 0.1]) > 2e-2 * 15
