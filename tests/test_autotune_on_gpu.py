"""The autotuner timing real kernels on a Hopper GPU (skipped without one).

`fa4_jax.autotune(everywhere=True)` (an H100 or H200 is a measured kind,
which the tuner otherwise leaves to its tables) around a small decode call
and a small forward call: the candidates are timed with CUPTI, the winners
land in the cache file, and the outputs equal XLA's attention.
"""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from fa4_jax.kernels import autotune

ON_HOPPER = (jax.devices()[0].platform == "gpu"
             and str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9"))
pytestmark = [pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU"),
              # a tuner that timed nothing fails here with its reason
              pytest.mark.filterwarnings("error:fa4_jax.autotune")]


@pytest.fixture(autouse=True)
def fresh_cache(tmp_path, monkeypatch):
  monkeypatch.setenv("FA4_JAX_AUTOTUNE_CACHE_DIR", str(tmp_path))
  autotune.clear_memory()
  yield
  autotune.clear_memory()


def _inputs(b, t, s, n, kv_heads, d):
  keys = jax.random.split(jax.random.key(0), 3)
  return (jax.random.normal(keys[0], (b, t, n, d)).astype(jnp.bfloat16),
          jax.random.normal(keys[1], (b, s, kv_heads, d)).astype(jnp.bfloat16),
          jax.random.normal(keys[2], (b, s, kv_heads, d)).astype(jnp.bfloat16))


def _tuned_kernels(tmp_path) -> set:
  entries = json.loads((tmp_path / autotune.CACHE_FILE).read_text())["entries"]
  assert all(entry["candidates_timed"] >= 1 and entry["ms"] > 0 for entry in entries.values())
  return {json.loads(key)["kernel"] for key in entries}


def _check(out, q, k, v, **options):
  want = jax.nn.dot_product_attention(q, k, v, implementation="xla", **options)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                             atol=2e-2, rtol=2e-2)


def test_a_tuned_decode_call_equals_xla(tmp_path):
  q, k, v = _inputs(4, 1, 8192, 32, 8, 128)
  with fa4_jax.autotune(everywhere=True):
    assert fa4_jax.which_implementation(q, k, v) == "sm90_decode"
    out = jax.jit(fa4_jax.attention)(q, k, v)
  assert "decode" in _tuned_kernels(tmp_path)
  _check(out, q, k, v)


def test_a_tuned_causal_forward_call_equals_xla_and_a_new_process_reuses_it(tmp_path):
  q, k, v = _inputs(2, 2048, 2048, 8, 8, 128)
  attend = jax.jit(lambda q, k, v: fa4_jax.attention(q, k, v, is_causal=True))
  with fa4_jax.autotune(everywhere=True):
    out = attend(q, k, v)
  assert "sm90_forward" in _tuned_kernels(tmp_path)
  _check(out, q, k, v, is_causal=True)

  timed = []
  autotune.clear_memory()  # a new process: the winner comes from the file
  with fa4_jax.autotune(everywhere=True, timer=lambda fn, args, c: timed.append(c) or 1.0):
    again = jax.jit(lambda q, k, v: fa4_jax.attention(q, k, v, is_causal=True))(q, k, v)
  assert not timed
  np.testing.assert_array_equal(np.asarray(again, np.float32), np.asarray(out, np.float32))
