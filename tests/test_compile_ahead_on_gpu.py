"""Kernels compiled ahead on worker threads, on a Hopper GPU (skipped elsewhere).

`fa4_jax.kernels.compile_ahead` compiles each kernel while the rest of the
program is lowered; XLA's compile then finds it in Mosaic GPU's cache. Here:
every kernel of a gradient compiles on a worker without error, and the
program compiled after them gives the gradients of the XLA path.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from fa4_jax import backends
from fa4_jax.kernels import compile_ahead
from reference import relative_error

pytestmark = pytest.mark.skipif(backends.device_arch_major() != 9, reason="needs a Hopper GPU")

SHAPE = (1, 1152, 4, 128)  # [B, T, N, H], a shape no other GPU test compiles


def test_the_kernels_of_a_gradient_compile_on_workers_and_the_program_uses_them(monkeypatch):
  monkeypatch.delenv(compile_ahead.ENV_SWITCH, raising=False)
  rng = np.random.default_rng(0)
  q, k, v, cotangent = (jnp.asarray(rng.normal(size=SHAPE), jnp.bfloat16) for _ in range(4))

  def grads(attention, q, k, v):
    loss = lambda q, k, v: jnp.sum(attention(q, k, v).astype(jnp.float32) * cotangent)  # noqa: E731
    return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

  before = compile_ahead.outcomes()
  ours = jax.jit(lambda q, k, v: grads(
      lambda q, k, v: fa4_jax.attention(q, k, v, is_causal=True, implementation="sm90"),
      q, k, v))(q, k, v)
  after = compile_ahead.outcomes()
  assert after["compiled"] - before["compiled"] == 3  # forward, dQ, dK/dV
  assert after["failed"] == before["failed"] and after["running"] == 0

  reference = grads(lambda q, k, v: jax.nn.dot_product_attention(
      q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), is_causal=True),
      q, k, v)
  for got, exact in zip(ours, reference):
    # as tests/test_on_gpu.py: bf16 inputs and probabilities, ~3e-3 expected
    assert relative_error(got, exact) < 2e-2
