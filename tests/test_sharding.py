"""fa4_jax.attention under jax.jit with sharded inputs (forced host CPU devices).

Specification:
* batch- and head-sharded inputs give the unsharded result, forward and
  gradients, and the compiled program runs the backend on each device's shard
  with no all-gather of q, k or v;
* key/value heads follow query heads, so GQA groups stay whole; a head
  sharding that would split groups raises a ValueError that says why;
* a sharded sequence axis is gathered (documented), never a wrong result;
* lengths follow the batch; broadcast bias/mask dims stay replicated and
  their gradient is summed across the devices that share them;
* all of it for both kinds of mesh axes: Explicit (`jax.make_mesh`'s default,
  shardings known while tracing) and Auto (XLA decides at compile time).
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import fa4_jax

AXIS_TYPES = [AxisType.Explicit, AxisType.Auto]


def make_mesh(shape, names, axis_type):
  return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names))


def put(x, mesh, *spec):
  return jax.device_put(x, NamedSharding(mesh, P(*spec)))


def normal(rng, shape):
  return jnp.asarray(rng.normal(size=shape), jnp.float32)


def all_gathered_shapes(hlo_text: str) -> list[str]:
  """Shapes of the arrays the compiled program all-gathers, e.g. 'f32[4,16,4,8]'."""
  shapes = []
  for result in re.findall(r"=\s*(.*?)\s+all-gather(?:-start)?\(", hlo_text):
    shapes += re.findall(r"\w+\[[\d,]*\]", result)
  return shapes


def shape_str(x) -> str:
  return "f32[" + ",".join(map(str, x.shape)) + "]"


def out_and_grads(argnums, **kwargs):
  """jit(q, k, v, ...) -> (attention output, gradients of a weighted sum)."""

  def fn(q, k, v, bias=None, mask=None, q_len=None, kv_len=None):
    def loss(q, k, v, bias):
      out = fa4_jax.attention(q, k, v, bias, mask, query_seq_lengths=q_len,
                              key_value_seq_lengths=kv_len, implementation="xla",
                              **kwargs)
      return jnp.sum(out * jnp.cos(out)), out
    (_, out), grads = jax.value_and_grad(loss, argnums=argnums, has_aux=True)(
        q, k, v, bias)
    return out, grads

  return jax.jit(fn)


def assert_close(got, want):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=["explicit", "auto"])
@pytest.mark.parametrize("mesh_shape, q_spec, kv_heads", [
    ((4,), ("d",), 2),                       # batch over 4 devices
    ((2, 4), ("d", None, "m"), 4),           # batch x heads, 8 devices
    ((2, 2), (("d", "m"),), 4),              # batch over two mesh axes
])
def test_batch_and_head_sharding_match_unsharded_without_gathering_qkv(
    host_devices, axis_type, mesh_shape, q_spec, kv_heads):
  mesh = make_mesh(mesh_shape, ("d", "m")[:len(mesh_shape)], axis_type)
  rng = np.random.default_rng(0)
  b, t, n, h = 4, 16, 8, 8
  q, k, v = normal(rng, (b, t, n, h)), normal(rng, (b, t, kv_heads, h)), normal(rng, (b, t, kv_heads, h))
  f = out_and_grads((0, 1, 2), is_causal=True)
  sharded = [put(x, mesh, *q_spec) for x in (q, k, v)]

  compiled = f.lower(*sharded).compile()
  out, grads = compiled(*sharded)

  assert_close((out, grads), f(q, k, v))
  assert out.sharding.is_equivalent_to(NamedSharding(mesh, P(*q_spec)), 4)
  assert all_gathered_shapes(compiled.as_text()) == []


@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=["explicit", "auto"])
def test_gqa_heads_are_sharded_in_whole_groups(host_devices, axis_type):
  # 8 query heads in 2 groups of 4: 2 head shards, each holds one group and its KV head.
  mesh = make_mesh((2,), ("m",), axis_type)
  rng = np.random.default_rng(1)
  q, k, v = normal(rng, (2, 16, 8, 8)), normal(rng, (2, 16, 2, 8)), normal(rng, (2, 16, 2, 8))
  f = out_and_grads((0, 1, 2))
  sharded = [put(x, mesh, None, None, "m") for x in (q, k, v)]

  compiled = f.lower(*sharded).compile()

  assert_close(compiled(*sharded), f(q, k, v))
  assert all_gathered_shapes(compiled.as_text()) == []


@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=["explicit", "auto"])
def test_head_sharding_that_splits_gqa_groups_raises(host_devices, axis_type):
  # 4 head shards but only 2 KV heads: a device would hold half a group.
  mesh = make_mesh((4,), ("m",), axis_type)
  q, k = jnp.ones((1, 16, 8, 8)), jnp.ones((1, 16, 2, 8))
  f = jax.jit(lambda q, k: fa4_jax.attention(q, k, k))
  # Explicit axes: a ValueError while tracing. Auto axes: raised from XLA's
  # partitioner at compile time, wrapped in a JaxRuntimeError, message intact.
  with pytest.raises(Exception, match="must hold whole groups"):
    f(put(q, mesh, None, None, "m"), k)


@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=["explicit", "auto"])
def test_lengths_follow_batch_and_broadcast_bias_gradient_is_summed(host_devices, axis_type):
  mesh = make_mesh((2, 2), ("d", "m"), axis_type)
  rng = np.random.default_rng(2)
  b, t, n, kh, h = 4, 16, 4, 2, 8
  q, k, v = normal(rng, (b, t, n, h)), normal(rng, (b, t, kh, h)), normal(rng, (b, t, kh, h))
  bias = normal(rng, (1, n, t, t))  # broadcast over the (sharded) batch
  mask = jnp.asarray(rng.random((b, 1, t, t)) > 0.2)  # broadcast over heads
  q_len, kv_len = jnp.array([16, 5, 0, 11]), jnp.array([3, 16, 9, 1])
  f = out_and_grads((0, 1, 2, 3), is_causal=True)
  sharded = ([put(x, mesh, "d", None, "m") for x in (q, k, v)]
             + [put(bias, mesh, None, "m"), put(mask, mesh, "d"),
                put(q_len, mesh, "d"), put(kv_len, mesh, "d")])

  compiled = f.lower(*sharded).compile()

  assert_close(compiled(*sharded), f(q, k, v, bias, mask, q_len, kv_len))
  # Only the bias gradient may be gathered (back to the bias' own sharding).
  qkv_shapes = {shape_str(q), shape_str(k)}
  assert not qkv_shapes & set(all_gathered_shapes(compiled.as_text()))


@pytest.mark.parametrize("axis_type", AXIS_TYPES, ids=["explicit", "auto"])
def test_sharded_sequence_is_gathered_and_correct(host_devices, axis_type):
  # Without context parallelism every device needs whole sequences: the
  # sequence axis is all-gathered (see fa4_jax/sharding.py), never wrong.
  mesh = make_mesh((4,), ("s",), axis_type)
  rng = np.random.default_rng(3)
  q, k, v = normal(rng, (2, 32, 2, 8)), normal(rng, (2, 32, 2, 8)), normal(rng, (2, 32, 2, 8))
  f = out_and_grads((0, 1, 2), is_causal=True)
  sharded = [put(x, mesh, None, "s") for x in (q, k, v)]

  compiled = f.lower(*sharded).compile()

  assert_close(compiled(*sharded), f(q, k, v))
  assert shape_str(q) in all_gathered_shapes(compiled.as_text())


def test_vmap_still_works(host_devices):
  rng = np.random.default_rng(4)
  q = normal(rng, (3, 2, 16, 2, 8))
  attend = lambda q: fa4_jax.attention(q, q, q, is_causal=True)
  reference = lambda q: jax.nn.dot_product_attention(q, q, q, is_causal=True)
  assert_close(jax.vmap(attend)(q), jax.vmap(reference)(q))
  assert_close(jax.vmap(jax.grad(lambda x: attend(x).sum()))(q),
               jax.vmap(jax.grad(lambda x: reference(x).sum()))(q))
