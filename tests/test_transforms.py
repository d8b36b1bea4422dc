"""fa4_jax.attention composes with jit, vmap, grad and jax.checkpoint."""

import jax
import jax.numpy as jnp
import numpy as np

import fa4_jax

B, T, N, K, H = 2, 24, 4, 2, 16


def inputs(seed=0, batch=B):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(batch, T, N, H)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(batch, T, K, H)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(batch, T, K, H)), jnp.float32)
  return q, k, v


def reference(q, k, v, **kw):
  return jax.nn.dot_product_attention(q, k, v, implementation="xla", **kw)


def test_jit_gives_the_eager_result():
  q, k, v = inputs()
  eager = fa4_jax.attention(q, k, v, is_causal=True)
  jitted = jax.jit(lambda *a: fa4_jax.attention(*a, is_causal=True))(q, k, v)
  np.testing.assert_allclose(jitted, eager, atol=1e-6)


def test_vmap_over_an_extra_leading_axis():
  q, k, v = (jnp.stack([a, b]) for a, b in zip(inputs(0), inputs(1)))  # [2, B, T, ., H]
  out = jax.vmap(lambda *a: fa4_jax.attention(*a, is_causal=True))(q, k, v)
  for i in range(2):
    np.testing.assert_allclose(out[i], reference(q[i], k[i], v[i], is_causal=True),
                               atol=2e-5, rtol=2e-5)


def test_vmap_with_per_example_lengths():
  q, k, v = inputs()
  lengths = jnp.array([[3, 24], [17, 9]], jnp.int32)  # vmapped axis first
  f = lambda lens: fa4_jax.attention(q, k, v, key_value_seq_lengths=lens)
  out = jax.vmap(f)(lengths)
  for i in range(2):
    np.testing.assert_allclose(out[i], reference(q, k, v, key_value_seq_lengths=lengths[i]),
                               atol=2e-5, rtol=2e-5)


def test_grad_of_a_jitted_loss_matches_jax_nn():
  q, k, v = inputs()
  loss = lambda f: jax.jit(jax.grad(lambda q, k, v: jnp.sum(f(q, k, v) ** 2), (0, 1, 2)))
  ours = loss(lambda *a: fa4_jax.attention(*a, local_window_size=(5, 2)))(q, k, v)
  theirs = loss(lambda *a: reference(*a, local_window_size=(5, 2)))(q, k, v)
  for a, b in zip(ours, theirs):
    np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


def test_checkpointed_attention_has_the_same_gradients():
  q, k, v = inputs()
  plain = lambda q, k, v: jnp.sum(jnp.tanh(fa4_jax.attention(q, k, v, is_causal=True)))
  remat = jax.checkpoint(plain)
  for a, b in zip(jax.grad(remat, (0, 1, 2))(q, k, v), jax.grad(plain, (0, 1, 2))(q, k, v)):
    np.testing.assert_allclose(a, b, atol=1e-6)


def test_vmap_of_grad():
  q, k, v = (jnp.stack([a, b]) for a, b in zip(inputs(0), inputs(1)))
  g = jax.vmap(jax.grad(lambda q, k, v: jnp.sum(fa4_jax.attention(q, k, v) ** 2)))(q, k, v)
  g_ref = jax.vmap(jax.grad(lambda q, k, v: jnp.sum(reference(q, k, v) ** 2)))(q, k, v)
  np.testing.assert_allclose(g, g_ref, atol=1e-4, rtol=1e-4)
