"""Precision scopes on a GPU (skipped without one).

With float32 inputs, a forward inside `jax.default_matmul_precision("highest")`
differentiated outside it gives float32-exact gradients (the XLA path on the
GPU, whose default matmul precision is TF32-like), against a float64
reference; without the scope in the backward they would carry TF32 errors
(~1e-3 relative; issue #28).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from reference import relative_error

ON_GPU = jax.devices()[0].platform == "gpu"
pytestmark = pytest.mark.skipif(not ON_GPU, reason="needs a GPU")


@pytest.mark.parametrize("is_causal", [False, True])
def test_float32_gradients_under_highest_are_float32_exact(is_causal):
  rng = np.random.default_rng(0)
  q, k, v, dout = (rng.normal(size=(2, 512, 4, 64)) for _ in range(4))
  previous = jax.config.jax_default_matmul_precision
  jax.config.update("jax_default_matmul_precision", None)  # the GPU's default outside
  try:
    def loss(q, k, v):
      with jax.default_matmul_precision("highest"):
        out = fa4_jax.attention(q, k, v, is_causal=is_causal)
      return jnp.sum(out * jnp.asarray(dout, jnp.float32))

    f32 = [jnp.asarray(x, jnp.float32) for x in (q, k, v)]
    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*f32)
  finally:
    jax.config.update("jax_default_matmul_precision", previous)
  with jax.enable_x64():
    f64 = [jnp.asarray(x, jnp.float64) for x in (q, k, v)]
    ref = jax.grad(lambda q, k, v: jnp.sum(jax.nn.dot_product_attention(
        q, k, v, is_causal=is_causal, implementation="xla") * dout), argnums=(0, 1, 2))(*f64)
    ref = [np.asarray(r) for r in ref]
  for g, r in zip(got, ref):
    rel = relative_error(g, r)
    assert rel < 1e-5, rel
