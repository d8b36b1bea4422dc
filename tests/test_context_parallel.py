"""fa4_jax.context_parallel_attention: ring attention over a sharded sequence.

Specification:
* with the sequence sharded over a named mesh axis (4 or 8 host devices),
  the output and the gradients equal unsharded attention, causal or not,
  with GQA, in the load-balanced or the contiguous layout;
* the compiled program passes K/V blocks around the ring (collective-permute)
  and never all-gathers q, k or v;
* each ring step's backend calls cover every visible (query, key) pair of the
  global causal (or dense) mask exactly once, and no call is spent on a fully
  masked pair of chunks;
* `load_balance` gives device i chunks i and 2P-1-i; `unload_balance` undoes it;
* batch and head axes may be sharded over other mesh axes at the same time;
* bad meshes, axis names, lengths and unsupported arguments raise clear errors.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fa4_jax
from fa4_jax import context_parallel


def normal(rng, shape):
  return jnp.asarray(rng.normal(size=shape), jnp.float32)


def qkv_and_cotangent(seed, b=2, t=32, n=4, kv_heads=2, h=8):
  rng = np.random.default_rng(seed)
  return (normal(rng, (b, t, n, h)), normal(rng, (b, t, kv_heads, h)),
          normal(rng, (b, t, kv_heads, h)), normal(rng, (b, t, n, h)))


def out_and_grads(attend):
  """jit(q, k, v, dout) -> (attend(q, k, v), its vjp with dout)."""

  def fn(q, k, v, dout):
    out, vjp = jax.vjp(attend, q, k, v)
    return out, vjp(dout)

  return jax.jit(fn)


def assert_close(got, want):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=3e-5, rtol=3e-5)


@pytest.mark.parametrize("devices, is_causal, load_balanced", [
    (1, True, True),
    (2, True, True),
    (4, True, True),
    (8, True, True),
    (4, True, False),
    (4, False, True),
])
def test_ring_attention_equals_unsharded_attention(host_devices, devices, is_causal,
                                                   load_balanced):
  mesh = jax.make_mesh((devices,), ("seq",))
  q, k, v, dout = qkv_and_cotangent(seed=devices)
  layout = (lambda x: fa4_jax.load_balance(x, devices)) if load_balanced else (lambda x: x)
  restore = (lambda x: fa4_jax.unload_balance(x, devices)) if load_balanced else (lambda x: x)
  ring = out_and_grads(lambda q, k, v: fa4_jax.context_parallel_attention(
      q, k, v, mesh=mesh, axis_name="seq", is_causal=is_causal,
      load_balanced=load_balanced))
  reference = out_and_grads(lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=is_causal))
  sharded = [jax.device_put(layout(x), NamedSharding(mesh, P(None, "seq")))
             for x in (q, k, v, dout)]

  compiled = ring.lower(*sharded).compile()
  out, grads = compiled(*sharded)

  assert_close(jax.tree.map(restore, (out, grads)), reference(q, k, v, dout))
  assert out.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "seq")), 4)
  hlo = compiled.as_text()
  assert "collective-permute" in hlo
  assert "all-gather" not in hlo


@pytest.mark.parametrize("devices", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("is_causal, load_balanced", [(True, True), (True, False),
                                                      (False, True)])
def test_ring_plans_cover_each_visible_pair_once(devices, is_causal, load_balanced):
  chunk = 3  # positions per chunk; 2 chunks per device
  ring = context_parallel._Ring(axis_name="seq", size=devices, causal=is_causal,
                                load_balanced=load_balanced, scale=1.0, backend=None)
  t = 2 * devices * chunk

  def positions(device, which):
    """Global positions of the local rows `which` (all, first or second chunk)."""
    first, second = ring.chunks(device)
    rows = [np.arange(c * chunk, (c + 1) * chunk) for c in (first, second)]
    return np.concatenate(rows) if which == context_parallel._ALL else rows[which]

  covered = np.zeros((t, t), int)
  for me in range(devices):
    later = context_parallel._later_step_plans(ring)
    for step in range(devices):
      source = (me - step) % devices
      plan = (context_parallel._first_step_plan(ring, chunk) if step == 0
              else later[0] if source < me else later[1])
      for call in plan:
        q_pos, k_pos = positions(me, call.rows), positions(source, call.cols)
        visible = np.asarray(call.spec.visible(np.arange(len(q_pos))[:, None],
                                               np.arange(len(k_pos))[None, :]))
        assert visible.any(), f"a call with nothing to do: {call} (device {me}, step {step})"
        covered[np.ix_(q_pos, k_pos)] += visible
  want = np.tril(np.ones((t, t), int)) if is_causal else np.ones((t, t), int)
  np.testing.assert_array_equal(covered, want)


def test_load_balanced_layout_gives_device_i_chunks_i_and_mirror():
  positions = jnp.arange(16)[None, :]  # P = 4 devices, 8 chunks of 2
  balanced = fa4_jax.load_balance(positions, 4)
  per_device = np.asarray(balanced).reshape(4, 4)  # contiguous shards
  assert per_device[0].tolist() == [0, 1, 14, 15]  # chunks 0 and 7
  assert per_device[3].tolist() == [6, 7, 8, 9]  # chunks 3 and 4
  np.testing.assert_array_equal(fa4_jax.unload_balance(balanced, 4), positions)


def test_ring_composes_with_batch_and_head_sharding(host_devices):
  # 8 devices: 2 (batch) x 2 (seq) x 2 (heads, whole GQA groups).
  mesh = jax.make_mesh((2, 2, 2), ("data", "seq", "model"))
  q, k, v, dout = qkv_and_cotangent(seed=7, n=4, kv_heads=2)
  ring = out_and_grads(lambda q, k, v: fa4_jax.context_parallel_attention(
      q, k, v, mesh=mesh, axis_name="seq", batch_axis="data", head_axis="model",
      is_causal=True))
  reference = out_and_grads(lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=True))
  layout = lambda x: fa4_jax.load_balance(x, 2)
  sharded = [jax.device_put(layout(x), NamedSharding(mesh, P("data", "seq", "model")))
             for x in (q, k, v, dout)]

  out, grads = ring(*sharded)

  restore = lambda x: fa4_jax.unload_balance(x, 2)
  assert_close(jax.tree.map(restore, (out, grads)), reference(q, k, v, dout))


@pytest.fixture
def ring_inputs(host_devices):
  mesh = jax.make_mesh((4,), ("seq",))
  q, k, v, _ = qkv_and_cotangent(seed=0)
  return mesh, q, k, v


@pytest.mark.parametrize("kwargs, message", [
    (dict(axis_name="sequence"), r"axis_name='sequence' is not an axis of the mesh; its axes are \('seq',\)"),
    (dict(axis_name=0), "is not an axis of the mesh"),
    (dict(axis_name="seq", batch_axis="data"), "batch_axis='data' names 'data', which is not an axis"),
    (dict(axis_name="seq", head_axis="seq"), "used twice"),
])
def test_bad_axis_names_raise(ring_inputs, kwargs, message):
  mesh, q, k, v = ring_inputs
  with pytest.raises(ValueError, match=message):
    fa4_jax.context_parallel_attention(q, k, v, mesh=mesh, **kwargs)


def test_a_mesh_is_required(ring_inputs):
  _, q, k, v = ring_inputs
  with pytest.raises(ValueError, match="`mesh` must be a jax.sharding.Mesh"):
    fa4_jax.context_parallel_attention(q, k, v, mesh=("seq", 4), axis_name="seq")


def test_sequence_must_divide_into_two_chunks_per_device(ring_inputs):
  mesh, q, k, v = ring_inputs  # 4 devices: the length must be a multiple of 8
  with pytest.raises(ValueError, match="divisible by 2 \\* \\(size of mesh axis 'seq'\\) = 8"):
    fa4_jax.context_parallel_attention(q[:, :12], k[:, :12], v[:, :12], mesh=mesh,
                                       axis_name="seq")
  with pytest.raises(ValueError, match="must be divisible by 2 \\* num_shards = 8"):
    fa4_jax.load_balance(q[:, :12], 4)


def test_query_and_key_lengths_must_match(ring_inputs):
  mesh, q, k, v = ring_inputs
  with pytest.raises(ValueError, match="query length 16 must equal key/value length 32"):
    fa4_jax.context_parallel_attention(q[:, :16], k, v, mesh=mesh, axis_name="seq")


@pytest.mark.parametrize("argument", [
    "bias", "mask", "query_seq_lengths", "key_value_seq_lengths", "local_window_size"])
def test_unsupported_arguments_raise(ring_inputs, argument):
  mesh, q, k, v = ring_inputs
  value = 8 if argument == "local_window_size" else jnp.ones((2,), jnp.int32)
  with pytest.raises(ValueError, match=f"does not support `{argument}` yet"):
    fa4_jax.context_parallel_attention(q, k, v, mesh=mesh, axis_name="seq",
                                       **{argument: value})


def test_head_axis_must_hold_whole_gqa_groups(host_devices):
  mesh = jax.make_mesh((2, 4), ("seq", "model"))
  q, k, v, _ = qkv_and_cotangent(seed=0, n=4, kv_heads=2)
  with pytest.raises(ValueError, match="whole GQA groups"):
    fa4_jax.context_parallel_attention(q, k, v, mesh=mesh, axis_name="seq",
                                       head_axis="model")
