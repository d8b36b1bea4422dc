"""fa4_jax.flax: fa4_jax as the attention_fn of Flax NNX and linen modules.

Each test builds the same model twice, once with Flax's default attention_fn
and once with fa4_jax's, with identical parameters, and compares outputs and
parameter gradients of a jitted loss (float32, CPU, so fa4_jax runs its XLA
path).

Tolerances: in float32 the two differ only in summation order (fa4_jax's
blockwise online softmax against one softmax over the whole row), a few ulps
of the ~1-sized values here: we measured <= 1e-6 absolute on outputs and
gradients; we allow 1e-5 absolute and relative, ten times that, which still
catches any masking or scaling mistake (those change results by > 1e-2).
"""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import fa4_jax
import fa4_jax.flax

B, T, D, HEADS = 2, 24, 32, 4
TOL = dict(atol=1e-5, rtol=1e-5)


# Test data from NumPy: jax.random would compile a kernel per shape (slow on CPU).
RNG = np.random.default_rng(0)


def _normal(*shape):
  return jnp.asarray(RNG.standard_normal(shape), jnp.float32)


X, TARGET = _normal(B, T, D), _normal(B, T, D)


def _inputs():
  return X, TARGET


def _assert_trees_close(got, want):
  jax.tree.map(lambda g, w: np.testing.assert_allclose(g, w, **TOL), got, want)


# --- Flax NNX -----------------------------------------------------------------


class NnxBlock(nnx.Module):
  """Pre-norm attention block plus a readout: enough to have every kind of
  parameter (projections, norm) downstream and upstream of attention."""

  def __init__(self, attention_fn, num_kv_heads=None, *, rngs):
    self.norm = nnx.LayerNorm(D, rngs=rngs)
    self.attn = nnx.MultiHeadAttention(
        num_heads=HEADS, in_features=D, num_kv_heads=num_kv_heads,
        attention_fn=attention_fn, decode=False, rngs=rngs)
    self.readout = nnx.Linear(D, D, rngs=rngs)

  def __call__(self, x, mask=None, is_causal=False):
    x = x + self.attn(self.norm(x), mask=mask, is_causal=is_causal)
    return self.readout(x)


def _nnx_outputs_and_grads(attention_fn, mask, is_causal, num_kv_heads=None):
  model = NnxBlock(attention_fn, num_kv_heads, rngs=nnx.Rngs(0))
  x, target = _inputs()

  @nnx.jit
  def step(model, x, mask):
    def loss_fn(model):
      y = model(x, mask=mask, is_causal=is_causal)
      return jnp.mean((y - target) ** 2), y
    (_, y), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    return y, nnx.to_pure_dict(nnx.state(grads, nnx.Param))

  return step(model, x, mask)


CAUSAL_MASK = nn.make_causal_mask(jnp.ones((B, T)))  # float32 [B, 1, T, T], as Flax users build it
# Key padding only: the last 5 keys of the second sequence are padding. (A
# query-padding mask would leave rows that see no key, where fa4_jax returns
# zeros and Flax the mean of all values: a documented difference.)
PADDING_MASK = nn.make_attention_mask(jnp.ones((B, T)),
                                      jnp.arange(T) < jnp.array([[T], [T - 5]]))


@pytest.mark.parametrize("mask, is_causal, num_kv_heads", [
    pytest.param(None, False, None, id="no_mask"),
    pytest.param(None, True, None, id="is_causal"),
    pytest.param(CAUSAL_MASK, False, 2, id="causal_mask_array_gqa"),
])
def test_nnx_matches_default_attention(mask, is_causal, num_kv_heads):
  want = _nnx_outputs_and_grads(nnx.dot_product_attention, mask, is_causal, num_kv_heads)
  got = _nnx_outputs_and_grads(fa4_jax.flax.attention_fn, mask, is_causal, num_kv_heads)
  _assert_trees_close(got, want)


# --- Flax linen ---------------------------------------------------------------


class LinenBlock(nn.Module):
  attention_fn: object

  @nn.compact
  def __call__(self, x, mask=None):
    h = nn.LayerNorm()(x)
    x = x + nn.MultiHeadDotProductAttention(
        num_heads=HEADS, attention_fn=self.attention_fn)(h, mask=mask)
    return nn.Dense(D)(x)


@functools.cache
def _linen_params():
  return jax.jit(LinenBlock(nn.dot_product_attention).init)(jax.random.key(2), X)


def _linen_outputs_and_grads(attention_fn, mask):
  model = LinenBlock(attention_fn)
  x, target = _inputs()
  params = _linen_params()

  @jax.jit
  def step(params, x, mask):
    def loss_fn(params):
      y = model.apply(params, x, mask=mask)
      return jnp.mean((y - target) ** 2), y
    (_, y), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    return y, grads

  return step(params, x, mask)


@pytest.mark.parametrize("name", ["no_mask", "causal_and_padding"])
def test_linen_matches_default_attention(name):
  # linen has no is_causal call argument: Flax's default gets a causal mask
  # array, fa4_jax gets make_attention_fn(is_causal=True) (kernel-friendly).
  if name == "no_mask":
    want = _linen_outputs_and_grads(nn.dot_product_attention, None)
    got = _linen_outputs_and_grads(fa4_jax.flax.attention_fn, None)
  else:
    want = _linen_outputs_and_grads(nn.dot_product_attention, CAUSAL_MASK * PADDING_MASK)
    got = _linen_outputs_and_grads(fa4_jax.flax.make_attention_fn(is_causal=True),
                                   PADDING_MASK)
  _assert_trees_close(got, want)


# --- The adapter as a function --------------------------------------------------


def test_function_with_bias_mask_and_several_batch_dims():
  """Flax's [batch..., heads, q, kv] mask and bias with two batch dims."""
  q, k, v = (_normal(2, 3, 10, HEADS, 8) for _ in range(3))
  bias = _normal(3, HEADS, 10, 10)  # broadcast over batch dim 0
  mask = RNG.random((2, 3, 1, 10, 10)) < 0.7
  mask[..., 0] = True  # every query sees at least one key
  # Flax itself needs full batch dims on bias beyond one batch dim.
  full_bias = jnp.broadcast_to(bias, (2, 3, HEADS, 10, 10))
  want = jax.jit(nnx.dot_product_attention)(q, k, v, bias=full_bias, mask=mask)
  got = jax.jit(fa4_jax.flax.attention_fn)(q, k, v, bias=bias, mask=mask)
  np.testing.assert_allclose(got, want, **TOL)
  # No batch dims at all.
  q, k, v, bias = q[0, 0], k[0, 0], v[0, 0], bias[0]
  want = jax.jit(nnx.dot_product_attention)(q, k, v, bias=bias)
  got = jax.jit(fa4_jax.flax.attention_fn)(q, k, v, bias=bias)
  np.testing.assert_allclose(got, want, **TOL)


def test_dtype_is_the_computation_dtype():
  q = jnp.ones((1, 8, 2, 16), jnp.float32)
  out = fa4_jax.flax.attention_fn(q, q, q, dtype=jnp.bfloat16)
  assert out.dtype == jnp.bfloat16


def test_which_implementation_on_cpu():
  q = jnp.zeros((1, 8, 2, 16))
  causal_fn = fa4_jax.flax.make_attention_fn(is_causal=True)
  assert fa4_jax.flax.which_implementation(q, q, q, attention_fn=causal_fn) == "xla"


# --- Clear errors for what flash attention cannot do -----------------------------


def _layer(**kwargs):
  return nnx.MultiHeadAttention(num_heads=HEADS, in_features=D, decode=False,
                                rngs=nnx.Rngs(0), **kwargs)


def test_attention_dropout_is_rejected_but_deterministic_runs():
  x, _ = _inputs()
  layer = _layer(dropout_rate=0.1, attention_fn=fa4_jax.flax.attention_fn)
  with pytest.raises(ValueError, match="attention dropout is not supported"):
    layer(x, deterministic=False)
  reference = _layer(dropout_rate=0.1)
  np.testing.assert_allclose(layer(x, deterministic=True),
                             reference(x, deterministic=True), **TOL)


def test_sow_weights_is_rejected():
  x, _ = _inputs()
  with pytest.raises(ValueError, match="cannot sow attention weights"):
    _layer(attention_fn=fa4_jax.flax.attention_fn)(x, sow_weights=True)


def test_non_default_precision_is_rejected_unless_ignored():
  x, _ = _inputs()
  layer = _layer(precision=jax.lax.Precision.HIGHEST,
                 attention_fn=fa4_jax.flax.attention_fn)
  with pytest.raises(ValueError, match="precision=.*is not supported"):
    layer(x)
  layer = _layer(precision="highest",
                 attention_fn=fa4_jax.flax.make_attention_fn(ignore_precision=True))
  assert layer(x).shape == x.shape


def test_rope_input_positions_is_rejected():
  x, _ = _inputs()
  layer = _layer(attention_fn=fa4_jax.flax.attention_fn)
  with pytest.raises(TypeError, match="input_positions"):
    layer(x, input_positions=jnp.arange(T))


def test_custom_einsum_is_rejected():
  q = jnp.ones((1, 8, 2, 16))
  with pytest.raises(ValueError, match="qk_attn_weights_einsum"):
    fa4_jax.flax.attention_fn(q, q, q, qk_attn_weights_einsum=jnp.einsum,
                              attn_weights_value_einsum=jnp.einsum)


def test_fixed_causal_refuses_cached_decoding():
  """decode=True feeds one query against the whole cache: a top-left causal
  mask there would hide every cached key but the first."""
  layer = _layer(attention_fn=fa4_jax.flax.make_attention_fn(is_causal=True))
  layer.init_cache((B, T, D))
  with pytest.raises(ValueError, match="needs equal query and key lengths"):
    layer(jnp.ones((B, 1, D)), decode=True)


def test_cached_decoding_matches_flax():
  """With the default attention_fn, decoding uses Flax's cache mask."""
  x, _ = _inputs()
  outputs = []
  for attention_fn in (nnx.dot_product_attention, fa4_jax.flax.attention_fn):
    layer = _layer(attention_fn=attention_fn)
    layer.init_cache((B, T, D))
    decode_step = nnx.jit(lambda layer, x: layer(x, decode=True))
    outputs.append(jnp.concatenate(
        [decode_step(layer, x[:, i:i + 1]) for i in range(4)], axis=1))
  np.testing.assert_allclose(outputs[1], outputs[0], **TOL)


# --- Key masks as key lengths (cached decoding) --------------------------------


def _cache_mask(lengths, kv_length):
  """Flax's cached-decoding mask for keys 0..length-1 of each row: [B, 1, 1, kv]."""
  return (jnp.arange(kv_length) < jnp.asarray(lengths)[:, None])[:, None, None, :]


def test_a_prefix_key_mask_is_served_as_key_lengths_by_the_decode_kernel():
  q = jnp.zeros((2, 1, 8, 64), jnp.bfloat16)
  kv = jnp.zeros((2, 256, 2, 64), jnp.bfloat16)
  sm90 = fa4_jax.flax.make_attention_fn(implementation="sm90")
  holes = _cache_mask([5, 9], 256).at[0, 0, 0, 2].set(False)
  with fa4_jax.interpret_mode():
    assert fa4_jax.flax.which_implementation(
        q, kv, kv, mask=_cache_mask([5, 9], 256), attention_fn=sm90) == "sm90_decode"
    assert fa4_jax.flax.which_implementation(q, kv, kv, mask=holes, attention_fn=sm90) == "xla"
    # A traced mask: a lax.cond on its values picks the lengths or the mask.
    jaxpr = jax.make_jaxpr(lambda q, k, v, m: sm90(q, k, v, mask=m))(q, kv, kv, holes)
  assert any(e.primitive.name == "cond" for e in jaxpr.eqns)


@pytest.mark.parametrize("name, mask", [
    ("prefixes", _cache_mask([3, T], T)),
    ("a hole in one row", _cache_mask([3, T], T).at[1, 0, 0, 4].set(False)),
    ("keys from the end", (jnp.arange(T) >= jnp.array([[2], [7]]))[:, None, None, :]),
])
def test_key_masks_traced_or_not_equal_the_explicit_mask(name, mask):
  """Prefix rows run as key lengths, others as the mask: both equal jax.nn's
  masked attention, whether the mask is known when traced or not."""
  q, k, v = _normal(B, 1, HEADS, 8), _normal(B, T, HEADS, 8), _normal(B, T, HEADS, 8)
  want = jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")
  np.testing.assert_allclose(fa4_jax.flax.attention_fn(q, k, v, mask=mask), want, **TOL)
  traced = jax.jit(lambda q, k, v, m: fa4_jax.flax.attention_fn(q, k, v, mask=m))
  np.testing.assert_allclose(traced(q, k, v, mask), want, **TOL)


def test_key_mask_gradients_under_vmap_and_batch_sharded_jit(host_devices):
  """The lax.cond of a traced key mask differentiates like jax.nn's masked
  attention, under vmap, and under a batch-sharded jit without gathering."""
  from jax.sharding import NamedSharding, PartitionSpec as P

  b, t = 4, 12
  q, k, v, dout = (_normal(b, t, HEADS, 8) for _ in range(4))
  mask = _cache_mask([12, 5, 9, 1], t)
  ours = lambda q, k, v, m: fa4_jax.flax.attention_fn(q, k, v, mask=m)
  ref = lambda q, k, v, m: jax.nn.dot_product_attention(q, k, v, mask=m, implementation="xla")

  def loss(attend):
    return lambda q, k, v, m: jnp.sum(attend(q, k, v, m) * dout)

  want = jax.grad(loss(ref), argnums=(0, 1, 2))(q, k, v, mask)
  _assert_trees_close(jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2)))(q, k, v, mask), want)
  per_row = jax.vmap(lambda q, k, v, m: ours(q[None], k[None], v[None], m[None])[0])
  np.testing.assert_allclose(per_row(q, k, v, mask), ref(q, k, v, mask), **TOL)

  mesh = jax.make_mesh((4,), ("data",))
  put = lambda x: jax.device_put(x, NamedSharding(mesh, P("data")))
  compiled = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2))).lower(
      put(q), put(k), put(v), put(mask)).compile()
  _assert_trees_close(compiled(put(q), put(k), put(v), put(mask)), want)
  assert "all-gather" not in compiled.as_text()
