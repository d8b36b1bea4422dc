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
* `sinks=` and `logits_soft_cap=` mean what they mean in `fa4_jax.attention`
  (each and together, causal or not, GQA, heads sharded too): output and
  gradients, the sinks' included, equal an f32 einsum reference;
* forward mode (`jax.jvp`, `jax.jacfwd`) and forward-over-reverse
  (`jax.jvp(jax.grad(f))`, `jax.hessian`) equal the reference's;
  reverse-over-reverse names forward-over-reverse, as `fa4_jax.attention` does;
* bad meshes, axis names, lengths and unsupported arguments raise clear
  errors; bad sinks and soft-caps raise `fa4_jax.attention`'s own.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fa4_jax
from fa4_jax import context_parallel, interpret
from fa4_jax.scores import ScoreFunction
from reference import einsum_attention, visible_mask


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


@pytest.mark.parametrize("devices", [1, 2])
def test_arrays_not_yet_on_the_ring_are_laid_out_by_the_call(host_devices, devices):
  """On a `jax.make_mesh` mesh (Explicit axes, where shard_map takes only
  inputs already sharded as its specs say) the caller's unsharded arrays
  are moved onto the ring by the call: output and gradients equal
  unsharded attention's. (On a GPU this failed inside shard_map.)"""
  mesh = jax.make_mesh((devices,), ("seq",))
  q, k, v, dout = qkv_and_cotangent(seed=11)
  ring = out_and_grads(lambda q, k, v: fa4_jax.context_parallel_attention(
      q, k, v, mesh=mesh, axis_name="seq", is_causal=True, load_balanced=False))
  reference = out_and_grads(lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=True))
  assert_close(ring(q, k, v, dout), reference(q, k, v, dout))


@pytest.mark.parametrize("devices", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("is_causal, load_balanced", [(True, True), (True, False),
                                                      (False, True)])
def test_ring_plans_cover_each_visible_pair_once(devices, is_causal, load_balanced):
  chunk = 3  # positions per chunk; 2 chunks per device
  ring = context_parallel._Ring(axis_name="seq", size=devices, causal=is_causal,
                                load_balanced=load_balanced, score=ScoreFunction(1.0),
                                backend=None)
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


# --- Sinks, soft-cap and forward mode ------------------------------------------


def sharded_along_the_ring(mesh, spec, devices):
  """(put, restore): a natural-order [B, T, ...] array to the load-balanced
  layout sharded by `spec`, and back; other arrays (sinks) unchanged."""
  def put(x):
    if x.ndim != 4:
      return x
    return jax.device_put(fa4_jax.load_balance(x, devices), NamedSharding(mesh, spec))

  def restore(x):
    return fa4_jax.unload_balance(x, devices) if x.ndim == 4 else x

  return put, restore


def weighted_loss(attend):
  """A loss whose gradient is no multiple of the output (cf. test_forward_mode)."""
  return lambda *args: jnp.sum(jnp.sin(attend(*args)) * jnp.cos(jnp.arange(8.0)))


def ring_and_reference(mesh, is_causal, sinks, soft_cap, t, **axes):
  """(ring(q, k, v, s), reference(q, k, v, s)): context-parallel attention
  and the f32 einsum with the same sinks (s, or None) and soft-cap."""
  use = lambda s: s if sinks else None
  ring = lambda q, k, v, s: fa4_jax.context_parallel_attention(
      q, k, v, mesh=mesh, axis_name="seq", is_causal=is_causal, sinks=use(s),
      logits_soft_cap=soft_cap, **axes)
  visible = visible_mask(t, t, is_causal=is_causal)
  reference = lambda q, k, v, s: einsum_attention(q, k, v, visible, sinks=use(s),
                                                  soft_cap=soft_cap)[0]
  return ring, reference


@pytest.mark.parametrize("mesh_shape, is_causal, sinks, soft_cap", [
    ((4,), True, True, None),
    ((4,), False, False, 1.5),
    ((4,), True, True, 1.5),
    ((2, 2), True, True, 1.5),  # heads sharded too: the sinks with them
], ids=["sinks-causal", "soft_cap-dense", "both-causal", "both-heads_sharded"])
def test_sinks_and_soft_cap_equal_the_reference_forward_and_backward(
    host_devices, mesh_shape, is_causal, sinks, soft_cap):
  mesh = jax.make_mesh(mesh_shape, ("seq", "model")[:len(mesh_shape)])
  head_axis = "model" if len(mesh_shape) == 2 else None
  q, k, v, _ = qkv_and_cotangent(seed=11, n=4, kv_heads=2)  # GQA
  s = jnp.asarray([0.5, -1.0, 2.0, 3.0], jnp.float32)  # one sink dominates its rows
  ring, reference = ring_and_reference(mesh, is_causal, sinks, soft_cap, q.shape[1],
                                       head_axis=head_axis)
  put, restore = sharded_along_the_ring(mesh, P(None, "seq", head_axis), mesh_shape[0])
  value_and_grads = lambda f: jax.value_and_grad(weighted_loss(f), (0, 1, 2, 3))

  got = jax.jit(lambda *a: (ring(*a), value_and_grads(ring)(*a)))(*map(put, (q, k, v, s)))
  want = (reference(q, k, v, s), value_and_grads(reference)(q, k, v, s))

  assert_close(jax.tree.map(restore, got), want)


def test_forward_mode_and_hessian_vector_product_equal_the_reference(host_devices):
  mesh = jax.make_mesh((2,), ("seq",))
  rng = np.random.default_rng(5)
  q, k, v, _ = qkv_and_cotangent(seed=5, b=1, t=16)
  primals = (q, k, v, normal(rng, (4,)))
  tangents = qkv_and_cotangent(seed=6, b=1, t=16)[:3] + (normal(rng, (4,)),)
  ring, reference = ring_and_reference(mesh, True, True, 1.5, q.shape[1])
  put, restore = sharded_along_the_ring(mesh, P(None, "seq"), 2)
  jvp_and_hvp = lambda f: lambda p, t: (
      jax.jvp(f, p, t), jax.jvp(jax.grad(weighted_loss(f), (0, 1, 2, 3)), p, t))
  sharded = lambda xs: tuple(map(put, xs))

  got = jax.jit(jvp_and_hvp(ring))(sharded(primals), sharded(tangents))

  assert_close(jax.tree.map(restore, got), jvp_and_hvp(reference)(primals, tangents))


def test_jacfwd_and_hessian_equal_the_reference(host_devices):
  mesh = jax.make_mesh((2,), ("seq",))  # no layout: a 2-device contiguous ring
  q, k, v, _ = qkv_and_cotangent(seed=9, b=1, t=8, n=2, kv_heads=1, h=8)
  s = jnp.asarray([0.3, -0.7], jnp.float32)
  ring, reference = ring_and_reference(mesh, True, True, 1.5, 8, load_balanced=False)
  put = lambda x: jax.device_put(x, NamedSharding(mesh, P(None, "seq")))
  on_ring = lambda f: jax.jit(f)(put(q), put(k), put(v), s)

  on_reference = lambda f: jax.jit(f)(q, k, v, s)

  assert_close(on_ring(jax.jacfwd(ring, (0, 3))), on_reference(jax.jacfwd(reference, (0, 3))))
  assert_close(on_ring(jax.hessian(weighted_loss(ring), (1, 3))),
               on_reference(jax.hessian(weighted_loss(reference), (1, 3))))


def test_reverse_over_reverse_names_forward_over_reverse(ring_inputs):
  mesh, q, k, v = ring_inputs
  put = lambda x: jax.device_put(x, NamedSharding(mesh, P(None, "seq")))
  q, k, v = map(put, (q, k, v))
  loss = lambda q: jnp.sum(fa4_jax.context_parallel_attention(
      q, k, v, mesh=mesh, axis_name="seq", is_causal=True) ** 2)
  with pytest.raises(ValueError, match=r"reverse-over-reverse.*jax\.hessian"):
    jax.jit(jax.grad(lambda q: jnp.sum(jax.grad(loss)(q))))(q)


@pytest.mark.parametrize("kwargs", [
    dict(sinks=jnp.zeros((2,))),  # one per key/value head: must be one per query head
    dict(sinks=jnp.zeros((4,), jnp.int32)),
    dict(logits_soft_cap=0.0),
    dict(logits_soft_cap=-1.0),
    dict(logits_soft_cap="50"),
], ids=["sinks-shape", "sinks-dtype", "cap-zero", "cap-negative", "cap-string"])
def test_bad_sinks_and_soft_caps_raise_what_attention_raises(ring_inputs, kwargs):
  mesh, q, k, v = ring_inputs
  with pytest.raises(ValueError) as from_attention:
    fa4_jax.attention(q, k, v, **kwargs)
  argument = next(iter(kwargs))
  assert f"`{argument}`" in str(from_attention.value)
  with pytest.raises(ValueError) as from_ring:
    fa4_jax.context_parallel_attention(q, k, v, mesh=mesh, axis_name="seq", **kwargs)
  assert str(from_ring.value) == str(from_attention.value)


def test_ring_runs_the_sm90_kernel_with_sinks_and_soft_cap(host_devices):
  """The ring calls a kernel backend with its whole contract (the CPU tests
  above take the XLA path, whose optional arguments hid a missing one): the
  sm90 forward in Pallas' interpreter on every ring step. One device: the
  interpreter keeps one GPU's state, and two host devices running kernels
  at once trip its barrier bookkeeping."""
  mesh = jax.make_mesh((1,), ("seq",))
  q, k, v, _ = qkv_and_cotangent(seed=3, b=1, t=256, n=2, kv_heads=1, h=64)
  q, k, v = (x.astype(jnp.bfloat16) for x in (q, k, v))  # what the kernel takes
  s = jnp.asarray([0.5, -1.0], jnp.float32)
  ring, reference = ring_and_reference(mesh, True, True, 1.5, q.shape[1],
                                       implementation="sm90")
  put, restore = sharded_along_the_ring(mesh, P(None, "seq"), 1)
  with interpret.interpret_mode():
    got = jax.jit(ring)(*map(put, (q, k, v)), s)
  # bf16: one rounding of P and of the output, against an f32 einsum of
  # the same bf16 inputs.
  np.testing.assert_allclose(np.asarray(restore(got), np.float32),
                             np.asarray(reference(q, k, v, s)), atol=2e-2, rtol=2e-2)
