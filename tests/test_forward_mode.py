"""Forward-mode and second-order differentiation of fa4_jax.attention (issue #28).

Specification:
* `jax.jvp` (output and tangent) and the Hessian-vector product
  `jax.jvp(jax.grad(loss))` equal those of `jax.nn.dot_product_attention`
  with the equivalent explicit mask or bias (or of an f32 einsum for the
  soft-cap) under causal masks, windows, lengths (a row that sees no key
  gets a zero, finite tangent), GQA, a differentiable bias, sinks, soft-cap
  and segment ids; `jax.jacfwd` and `jax.hessian` (which vmap them) too.
* The tangent is the XLA path's (kernels have no forward-mode rule), the
  primal still the backend's forward; `jax.grad` still runs the fused
  backward and nothing else: one forward, one backward.
* Under sharded jit the derivatives equal the unsharded ones.
* Reverse-over-reverse and reverse-over-forward raise a ValueError that names
  forward-over-reverse (`jax.hessian`, `jax.jvp(jax.grad(f))`) instead.
"""

import collections

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.extend import core as jax_core
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import fa4_jax
import fa4_jax.flax
from reference import einsum_attention, jax_nn_with_sinks, packed_segment_ids, visible_mask

B, T, N, K, H = 2, 24, 4, 2, 8  # with small_xla_blocks: 2 blocks of 16, padded
TOL = 2e-5  # float32, 'highest' matmuls (conftest): rounding-level differences


def normal(rng, shape):
  return jnp.asarray(rng.normal(size=shape), jnp.float32)


def qkv(rng, b=B, t=T, n=N, kv_heads=K, h=H):
  return normal(rng, (b, t, n, h)), normal(rng, (b, t, kv_heads, h)), normal(rng, (b, t, kv_heads, h))


def jax_nn(q, k, v, bias=None, mask=None, **kw):
  return jax.nn.dot_product_attention(q, k, v, bias, mask, implementation="xla", **kw)


def causal_gqa(rng):
  ours = lambda q, k, v: fa4_jax.attention(q, k, v, is_causal=True)
  return ours, lambda q, k, v: jax_nn(q, k, v, is_causal=True), qkv(rng)


def window(rng):
  ours = lambda q, k, v: fa4_jax.attention(q, k, v, local_window_size=(5, 2))
  return ours, lambda q, k, v: jax_nn(q, k, v, local_window_size=(5, 2)), qkv(rng)


def lengths(rng):
  """Batch row 0 sees no key at all: jax.nn gives those rows the mean of the
  values, we give zeros; the reference is masked to zeros there."""
  q_len, kv_len = jnp.array([24, 10]), jnp.array([0, 13])
  visible = visible_mask(T, T, q_lengths=q_len, kv_lengths=kv_len, batch=B)
  sees_a_key = jnp.asarray(visible.any(-1)).transpose(0, 2, 1)[..., None]  # [B, T, 1, 1]
  ours = lambda q, k, v: fa4_jax.attention(q, k, v, query_seq_lengths=q_len,
                                           key_value_seq_lengths=kv_len)
  theirs = lambda q, k, v: jnp.where(sees_a_key, jax_nn(q, k, v, mask=visible), 0.0)
  return ours, theirs, qkv(rng)


def bias(rng):
  args = qkv(rng) + (normal(rng, (1, N, T, T)),)
  ours = lambda q, k, v, b: fa4_jax.attention(q, k, v, b, is_causal=True)
  return ours, lambda q, k, v, b: jax_nn(q, k, v, b, is_causal=True), args


def sinks(rng):
  args = qkv(rng) + (normal(rng, (N,)),)
  visible = visible_mask(T, T, is_causal=True)
  ours = lambda q, k, v, s: fa4_jax.attention(q, k, v, is_causal=True, sinks=s)
  theirs = lambda q, k, v, s: jax_nn_with_sinks(q, k, v, s, visible, 1 / np.sqrt(H))
  return ours, theirs, args


def soft_cap(rng):
  visible = visible_mask(T, T, is_causal=True)
  q, k, v = qkv(rng)
  ours = lambda q, k, v: fa4_jax.attention(q, k, v, is_causal=True, logits_soft_cap=1.5)
  theirs = lambda q, k, v: einsum_attention(q, k, v, visible, soft_cap=1.5)[0]
  return ours, theirs, (3 * q, k, v)  # large logits: the cap matters


def segment_ids(rng):
  ids = jnp.asarray(np.stack([packed_segment_ids([7, 11, 6], T),
                              packed_segment_ids([20, 4], T)]))
  visible = visible_mask(T, T, is_causal=True, batch=B, q_segment_ids=ids, kv_segment_ids=ids)
  ours = lambda q, k, v: fa4_jax.attention(q, k, v, is_causal=True, query_segment_ids=ids,
                                           key_value_segment_ids=ids)
  return ours, lambda q, k, v: jax_nn(q, k, v, mask=visible), qkv(rng)


CASES = [causal_gqa, window, lengths, bias, sinks, soft_cap, segment_ids]


def assert_close(got, want, tol=TOL):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    g, w = np.asarray(g), np.asarray(w)
    assert np.all(np.isfinite(g))
    bound = max(1.0, float(np.abs(w).max()))
    np.testing.assert_allclose(g, w, atol=tol * bound, rtol=tol)


def weighted_loss(fn, weights):
  return lambda *args: jnp.sum(jnp.sin(fn(*args)) * weights)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_jvp_and_hessian_vector_product_equal_jax_nn(small_xla_blocks, case):
  rng = np.random.default_rng(0)
  ours, theirs, primals = case(rng)
  tangents = tuple(normal(rng, x.shape) for x in primals)
  assert_close(jax.jit(lambda p, t: jax.jvp(ours, p, t))(primals, tangents),
               jax.jvp(theirs, primals, tangents))

  weights = normal(rng, (B, T, N, H))
  argnums = tuple(range(len(primals)))
  hvp = lambda fn: jax.jvp(jax.grad(weighted_loss(fn, weights), argnums), primals, tangents)
  assert_close(jax.jit(lambda: hvp(ours))(), hvp(theirs))


def test_jacfwd_and_hessian_equal_jax_nn():
  q, k, v = qkv(np.random.default_rng(1), b=1, t=5, n=2, kv_heads=1, h=4)
  ours = lambda q, k, v: fa4_jax.attention(q, k, v, is_causal=True)
  theirs = lambda q, k, v: jax_nn(q, k, v, is_causal=True)
  assert_close(jax.jacfwd(ours, (0, 1, 2))(q, k, v), jax.jacfwd(theirs, (0, 1, 2))(q, k, v))
  loss = lambda fn: lambda *a: jnp.sum(jnp.tanh(fn(*a)))
  assert_close(jax.jit(jax.hessian(loss(ours), (0, 1, 2)))(q, k, v),
               jax.hessian(loss(theirs), (0, 1, 2))(q, k, v))


def test_jvp_under_vmap_and_checkpoint():
  q, k, v = (jnp.stack([x, 2 * x]) for x in qkv(np.random.default_rng(2)))
  ours = lambda q, k, v: fa4_jax.attention(q, k, v, is_causal=True)
  theirs = lambda q, k, v: jax_nn(q, k, v, is_causal=True)
  jvp = lambda fn: jax.vmap(lambda *p: jax.jvp(jax.checkpoint(fn), p, p))(q, k, v)
  assert_close(jvp(ours), jvp(theirs))


def test_hessian_vector_product_through_a_scan_of_checkpointed_layers_equals_jax_nn():
  """Flax's nn.scan: the scan's linearization inlines the attention's
  custom_jvp in its primal body (loop-invariant hoisting); the rule must
  still hold when the gradient is differentiated again."""
  rng = np.random.default_rng(7)
  x, weights = normal(rng, (B, T, N, H)), normal(rng, (2, H, H)) * 0.3
  directions = normal(rng, x.shape), normal(rng, weights.shape)

  def loss(attend):
    layer = jax.checkpoint(lambda x, w: x + jnp.tanh(attend(x @ w, x, x, is_causal=True)))
    return lambda x, ws: jnp.sum(jnp.sin(jax.lax.scan(lambda x, w: (layer(x, w), None), x, ws)[0]))

  hvp = lambda attend: jax.jvp(jax.grad(loss(attend), (0, 1)), (x, weights), directions)
  assert_close(jax.jit(lambda: hvp(fa4_jax.attention))(), hvp(jax_nn))


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=str)
def test_derivatives_under_sharded_jit_equal_the_unsharded_ones(host_devices, axis_type):
  """Batch and heads sharded; the bias is broadcast over the batch, so its
  gradient's tangent is summed across the batch shards."""
  mesh = jax.make_mesh((2, 2), ("batch", "heads"), axis_types=(axis_type,) * 2)
  rng = np.random.default_rng(3)
  primals = qkv(rng) + (normal(rng, (1, N, T, T)),)
  tangents = qkv(rng) + (normal(rng, (1, N, T, T)),)
  fn = lambda q, k, v, b: fa4_jax.attention(q, k, v, b, is_causal=True, implementation="xla")
  hvp = jax.jit(lambda p, t: jax.jvp(jax.grad(weighted_loss(fn, 1.0), (0, 1, 2, 3)), p, t))
  jvp = jax.jit(lambda p, t: jax.jvp(fn, p, t))
  specs = [P("batch", None, "heads")] * 3 + [P(None, "heads")]
  put = lambda xs: tuple(jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(xs, specs))
  for derivative in (jvp, hvp):
    assert_close(derivative(put(primals), put(tangents)), derivative(primals, tangents))


def test_reverse_over_reverse_and_over_forward_name_forward_over_reverse():
  q, k, v = qkv(np.random.default_rng(4), b=1, t=5, n=2, kv_heads=1, h=4)
  loss = lambda q: jnp.sum(jnp.tanh(fa4_jax.attention(q, k, v)))
  with pytest.raises(ValueError, match=r"reverse-over-reverse.*jax\.hessian"):
    jax.grad(lambda q: jnp.sum(jax.grad(loss)(q) ** 2))(q)
  with pytest.raises(ValueError, match=r"forward-over-reverse.*jax\.hessian"):
    jax.jacrev(jax.jacfwd(loss))(q)


def _backend_calls(jaxpr) -> collections.Counter:
  """(backend name, results) of every partitioned backend call in a jaxpr."""
  calls = collections.Counter()
  for eqn in jaxpr.eqns:
    if eqn.primitive.name == "custom_partitioning":
      call = eqn.params["static_args"][0]
      calls[(call.config.backend.name, call.results)] += 1
    for param in eqn.params.values():
      for sub in param if isinstance(param, (list, tuple)) else [param]:
        if isinstance(sub, (jax_core.ClosedJaxpr, jax_core.Jaxpr)):
          calls.update(_backend_calls(getattr(sub, "jaxpr", sub)))
  return calls


def test_a_kernel_primal_with_an_xla_tangent_and_grad_keeps_the_fused_backward(run_interpreted):
  rng = np.random.default_rng(5)
  q, k, v = (x.astype(jnp.bfloat16) for x in qkv(rng, b=1, t=64, n=2, kv_heads=1, h=64))
  tangents = tuple(x.astype(jnp.bfloat16) for x in qkv(rng, b=1, t=64, n=2, kv_heads=1, h=64))
  attend = lambda implementation: lambda q, k, v: fa4_jax.attention(
      q, k, v, is_causal=True, implementation=implementation)
  got = run_interpreted(lambda: jax.jvp(attend("sm90"), (q, k, v), tangents))
  want = jax.jvp(attend("xla"), (q, k, v), tangents)
  assert_close([np.asarray(x, np.float32) for x in got],
               [np.asarray(x, np.float32) for x in want], tol=2e-2)

  forward, backward = ("sm90", ("out", "lse")), ("sm90", ("dq", "dk", "dv"))
  loss = lambda q, k, v: jnp.sum(attend("sm90")(q, k, v).astype(jnp.float32) ** 2)
  # Traced for an H100 (the call structure; the interpreter runs the backend
  # unpartitioned, so its jaxpr holds no partitioned call to count).
  with fa4_jax.gpu_target("sm90"):
    jvp_calls = _backend_calls(jax.make_jaxpr(
        lambda p, t: jax.jvp(attend("sm90"), p, t))((q, k, v), tangents).jaxpr)
    grad_calls = _backend_calls(jax.make_jaxpr(jax.grad(loss, (0, 1, 2)))(q, k, v).jaxpr)
  assert jvp_calls == {forward: 1}
  assert grad_calls == {forward: 1, backward: 1}


def test_a_flax_module_has_jax_nn_forward_mode_derivatives():
  """A linen attention layer's output tangent along a parameter direction
  (jvp over the parameter tree) with fa4_jax's attention_fn equals the one
  with Flax's default (causal mask array)."""
  rng = np.random.default_rng(6)
  x = normal(rng, (B, T, 16))
  layer = lambda fn: nn.MultiHeadDotProductAttention(num_heads=N, attention_fn=fn)
  params = layer(nn.dot_product_attention).init(jax.random.key(0), x)
  direction = jax.tree.map(lambda p: normal(rng, p.shape), params)
  mask = nn.make_causal_mask(jnp.ones((B, T)))
  jvp = lambda fn, mask: jax.jvp(lambda p: layer(fn).apply(p, x, mask=mask), (params,),
                                 (direction,))
  assert_close(jvp(fa4_jax.flax.make_attention_fn(is_causal=True), None),
               jvp(nn.dot_product_attention, mask))
