"""fa4_jax.context_parallel_attention with `score_mod`, `mask_mod` and `block_mask`.

Specification (the ring against one f32 einsum over the whole sequence,
with the mods written out as an explicit bias or mask):
* the mods see global indices: positions in the natural order of the
  sequence (not the load-balanced layout the ring holds), and the global
  batch row and head when the batch or the heads are sharded too;
* ALiBi (a score_mod closing over per-head slopes) on a causal ring: the
  output and the gradients of q, k, v and the slopes (partial on every
  device, summed over the ring) equal the reference's; forward mode and
  forward-over-reverse (a Hessian-vector product) too;
* a per-row prefix-LM mask_mod: equal without a block mask, with a global
  block mask whose tiles fit the ring's chunks (sliced per block pair) and
  with one whose tiles straddle them (each pair classifies its own tiles);
* a block pair whose tiles the block mask marks all empty costs no backend
  call (as the pairs a causal mask hides);
* the position-shifted mods stay runnable by the kernels, and the sm90
  forward (in the interpreter) runs them and the sliced block mask;
* bad mods raise `fa4_jax.attention`'s ValueError, which names the argument.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fa4_jax
from fa4_jax import backends, context_parallel, mod_functions, vjp
from reference import einsum_attention, relative_error, visible_mask

B, T, N, KV_HEADS, H = 2, 32, 4, 2, 8  # GQA; T = 32: chunks of 4 on 4 devices


def normal(rng, shape):
  return jnp.asarray(rng.normal(size=shape), jnp.float32)


def inputs(seed):
  rng = np.random.default_rng(seed)
  return (normal(rng, (B, T, N, H)), normal(rng, (B, T, KV_HEADS, H)),
          normal(rng, (B, T, KV_HEADS, H)))


def on_ring(mesh, devices, spec):
  """(put, restore): a natural-order [B, T, ...] array to the load-balanced
  layout sharded by `spec`, and back; other arrays unchanged."""
  put = lambda x: (jax.device_put(fa4_jax.load_balance(x, devices), NamedSharding(mesh, spec))
                   if x.ndim == 4 else x)
  restore = lambda x: fa4_jax.unload_balance(x, devices) if x.ndim == 4 else x
  return put, restore


def weighted_loss(attend):
  """A loss whose gradient is no multiple of the output."""
  return lambda *args: jnp.sum(jnp.sin(attend(*args)) * jnp.cos(jnp.arange(H, dtype=jnp.float32)))


def assert_close(got, want):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=3e-5, rtol=3e-5)


def alibi_of(slopes):
  return lambda score, b, h, q_idx, kv_idx: score - slopes[h] * jnp.abs(q_idx - kv_idx)


def alibi_bias(slopes):
  """[1, N, T, T]: ALiBi written out, at natural positions."""
  distance = jnp.abs(jnp.arange(T)[:, None] - jnp.arange(T)[None, :]).astype(jnp.float32)
  return -slopes[None, :, None, None] * distance


SLOPES = jnp.asarray([0.5, 0.25, 0.125, 0.0625], jnp.float32)


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 2)], ids=["ring4", "ring2-heads2"])
def test_alibi_on_a_causal_ring_equals_the_explicit_bias_with_gradients(
    host_devices, mesh_shape):
  mesh = jax.make_mesh(mesh_shape, ("seq", "model")[:len(mesh_shape)])
  head_axis = "model" if len(mesh_shape) == 2 else None  # heads 2, 3 on other devices
  put, restore = on_ring(mesh, mesh_shape[0], P(None, "seq", head_axis))

  def ring(q, k, v, slopes):
    return fa4_jax.context_parallel_attention(
        q, k, v, mesh=mesh, axis_name="seq", head_axis=head_axis, is_causal=True,
        score_mod=alibi_of(slopes))

  def reference(q, k, v, slopes):
    return einsum_attention(q, k, v, visible_mask(T, T, is_causal=True),
                            bias=alibi_bias(slopes))[0]

  both = lambda f: lambda *a: (f(*a), jax.grad(weighted_loss(f), (0, 1, 2, 3))(*a))
  args = (*inputs(seed=1), SLOPES)

  got = jax.jit(both(ring))(*map(put, args))

  assert_close(jax.tree.map(restore, got), both(reference)(*args))


def test_alibi_forward_mode_and_hessian_vector_product_equal_the_reference(host_devices):
  mesh = jax.make_mesh((2,), ("seq",))
  put, restore = on_ring(mesh, 2, P(None, "seq"))
  q, k, v = inputs(seed=2)
  dq, _, _ = inputs(seed=3)
  dslopes = jnp.asarray([1.0, -2.0, 0.5, 3.0], jnp.float32)
  ring = lambda q, slopes: fa4_jax.context_parallel_attention(
      q, put(k), put(v), mesh=mesh, axis_name="seq", is_causal=True,
      score_mod=alibi_of(slopes))
  reference = lambda q, slopes: einsum_attention(
      q, k, v, visible_mask(T, T, is_causal=True), bias=alibi_bias(slopes))[0]
  jvp_and_hvp = lambda f: lambda p, t: (
      jax.jvp(f, p, t), jax.jvp(jax.grad(weighted_loss(f), (0, 1)), p, t))

  got = jax.jit(jvp_and_hvp(ring))((put(q), SLOPES), (put(dq), dslopes))

  assert_close(jax.tree.map(restore, got), jvp_and_hvp(reference)((q, SLOPES), (dq, dslopes)))


PREFIXES = jnp.asarray([5, 13], jnp.int32)  # per batch row: inside chunks, not on their edges


def prefix_lm(b, h, q_idx, kv_idx):
  """Each row's first PREFIXES[b] tokens see each other; the rest is causal."""
  return (kv_idx < PREFIXES[b]) | (kv_idx <= q_idx)


def prefix_lm_visible():
  i, j = np.arange(T)[:, None], np.arange(T)[None, :]
  return np.stack([(j < p) | (j <= i) for p in np.asarray(PREFIXES)])[:, None]  # [B, 1, T, T]


@pytest.mark.parametrize("mesh_shape, tile", [
    ((4,), None),  # each block pair classifies its tiles from mask_mod
    ((4,), 4),  # tiles of one chunk: each pair slices the global block mask
    ((4,), 8),  # tiles across two chunks: not sliced, mask_mod classifies
    ((2, 2), 4),  # batch rows sharded too: the block mask with them
], ids=["mask_mod", "block_mask-sliced", "block_mask-straddling", "block_mask-batch_sharded"])
def test_prefix_lm_mask_mod_equals_the_explicit_mask(host_devices, mesh_shape, tile):
  mesh = jax.make_mesh(mesh_shape, ("seq", "data")[:len(mesh_shape)])
  batch_axis = "data" if len(mesh_shape) == 2 else None
  put, restore = on_ring(mesh, mesh_shape[0], P(batch_axis, "seq"))
  block_mask = (None if tile is None else
                fa4_jax.create_block_mask(prefix_lm, B, None, T, T, q_block=tile, kv_block=tile))
  given = dict(mask_mod=prefix_lm) if block_mask is None else dict(block_mask=block_mask)
  ring = lambda q, k, v: fa4_jax.context_parallel_attention(
      q, k, v, mesh=mesh, axis_name="seq", batch_axis=batch_axis, **given)
  reference = lambda q, k, v: einsum_attention(q, k, v, prefix_lm_visible())[0]
  both = lambda f: lambda *a: (f(*a), jax.grad(weighted_loss(f), (0, 1, 2))(*a))
  args = inputs(seed=4)

  got = jax.jit(both(ring))(*map(put, args))

  assert_close(jax.tree.map(restore, got), both(reference)(*args))


def test_block_pairs_the_block_mask_leaves_empty_cost_no_backend_call(host_devices,
                                                                      monkeypatch):
  """Chunked local attention with the ring's own chunk length: a query
  chunk sees only its own chunk, so on every device only the first ring
  step (its own block) has visible tiles. Causal load-balanced plans make 2
  calls at step 0 and 1 at each later step: 4 devices x (2 + 3) = 20 calls
  without skipping, 4 x 2 = 8 with."""
  devices, chunk = 4, T // 8
  calls, xla = [], backends.XLA

  def counting_forward(q, *rest):
    jax.debug.callback(lambda: calls.append(1))
    return xla.forward(q, *rest)

  monkeypatch.setattr(backends, "XLA", vjp.Backend("xla", counting_forward, xla.backward))
  mesh = jax.make_mesh((devices,), ("seq",))
  put, restore = on_ring(mesh, devices, P(None, "seq"))

  def chunked_local(b, h, q_idx, kv_idx):
    return q_idx // chunk == kv_idx // chunk

  block_mask = fa4_jax.create_block_mask(chunked_local, None, None, T, T, q_block=chunk,
                                         kv_block=chunk)
  q, k, v = inputs(seed=5)

  out = jax.jit(lambda q, k, v: fa4_jax.context_parallel_attention(
      q, k, v, mesh=mesh, axis_name="seq", is_causal=True, block_mask=block_mask,
      implementation="xla"))(put(q), put(k), put(v))
  jax.effects_barrier()

  i, j = np.arange(T)[:, None], np.arange(T)[None, :]
  visible = (i // chunk == j // chunk) & (j <= i)
  assert_close(restore(out), einsum_attention(q, k, v, visible)[0])
  assert len(calls) == devices * 2


def test_mods_at_global_positions_stay_runnable_by_the_kernels():
  slopes = SLOPES
  for kind, fn in (("score_mod", alibi_of(slopes)), ("mask_mod", prefix_lm)):
    mod, _ = mod_functions.trace(fn, kind)
    shifted = context_parallel._at_global_positions(mod, chunk=4)
    assert mod_functions.kernel_problem(mod) is None
    assert mod_functions.kernel_problem(shifted) is None, kind
    # Local position 5 of a pair whose second chunk starts at 40: global 41.
    captured = (*(jnp.asarray(c) for c in ((slopes,) if kind == "score_mod" else (PREFIXES,))),
                *map(jnp.int32, (8, 40, 0, 4)))
    args = ((jnp.float32(0.0),) if kind == "score_mod" else ()) + (0, 1, 5, 2)
    want = (fn(0.0, 0, 1, 41, 2) if kind == "score_mod" else fn(0, 1, 41, 2))
    np.testing.assert_allclose(mod_functions.evaluate(shifted, captured, *args), want)


@pytest.mark.parametrize("kwargs", [
    dict(score_mod=lambda score, b, h, q_idx: score),
    dict(mask_mod=lambda b, h, q_idx, kv_idx: q_idx * 1.0),
    dict(block_mask=fa4_jax.create_block_mask(prefix_lm, None, None, T // 2, T // 2)),
], ids=["score_mod-arity", "mask_mod-not-bool", "block_mask-length"])
def test_bad_mods_raise_what_attention_raises(host_devices, kwargs):
  mesh = jax.make_mesh((4,), ("seq",))
  q, k, v = inputs(seed=0)
  with pytest.raises(ValueError) as from_attention:
    fa4_jax.attention(q, k, v, **kwargs)
  argument = next(iter(kwargs))
  assert f"`{argument}`" in str(from_attention.value)
  with pytest.raises(ValueError) as from_ring:
    fa4_jax.context_parallel_attention(q, k, v, mesh=mesh, axis_name="seq", **kwargs)
  assert str(from_ring.value) == str(from_attention.value)


# ALiBi as a * score + R(q_idx) + C(kv_idx) (`mod_functions.affine_form`): on
# a causal ring the same as `alibi_of`'s |q - k| wherever a key is visible.
affine_alibi_of = lambda slopes: lambda score, b, h, q_idx, kv_idx: (
    score - slopes[h] * (q_idx - kv_idx).astype(jnp.float32))


@pytest.mark.parametrize("alibi", [alibi_of, affine_alibi_of], ids=["abs", "affine"])
@pytest.mark.parametrize("t", [256, 192], ids=["tiles-in-chunks", "tiles-across-chunks"])
def test_ring_runs_the_sm90_kernels_with_mods_in_the_interpreter(host_devices, t, alibi):
  """The ring's mods through a kernel (the tests above take the XLA path):
  the sm90 forward in Pallas' interpreter, on one device (the interpreter
  keeps one GPU's state). Its second query chunk sits at positions t/2 to
  t - 1 and, with t = 256, its block mask is the global one's slice: ALiBi
  and a sliding window at those positions equal the reference's. ALiBi
  either per score or in the affine form (the ring's remap of positions a
  scalar shift per tile where chunks of 128 hold whole tiles, else per
  position, t = 192: chunks of 96)."""
  mesh = jax.make_mesh((1,), ("seq",))
  n, window = 2, 96
  rng = np.random.default_rng(6)
  q, k, v = (normal(rng, (1, t, heads, 64)).astype(jnp.bfloat16) for heads in (n, 1, 1))
  slopes = jnp.asarray([0.25, 0.0625], jnp.float32)
  sliding = lambda b, h, q_idx, kv_idx: q_idx - kv_idx <= window
  block_mask = fa4_jax.create_block_mask(sliding, None, None, t, t)  # 128-tiles: one a chunk
  ring = lambda q, k, v: fa4_jax.context_parallel_attention(
      q, k, v, mesh=mesh, axis_name="seq", is_causal=True, implementation="sm90",
      score_mod=alibi(slopes), block_mask=block_mask)
  i, j = np.arange(t)[:, None], np.arange(t)[None, :]
  distance = jnp.asarray(np.abs(i - j), jnp.float32)
  want = einsum_attention(q, k, v, (j <= i) & (i - j <= window),
                          bias=-slopes[None, :, None, None] * distance)[0]
  put, _ = on_ring(mesh, 1, P(None, "seq"))
  with fa4_jax.interpret_mode():
    got = jax.jit(ring)(put(q), put(k), put(v))
  # bf16: one rounding of P and of the output, against an f32 einsum of
  # the same bf16 inputs.
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=2e-2,
                             rtol=2e-2)


@pytest.mark.parametrize("t", [256, 192], ids=["tiles-in-chunks", "tiles-across-chunks"])
def test_ring_affine_alibi_gradients_through_the_sm90_kernels_in_the_interpreter(
    host_devices, t):
  """The ring's affine ALiBi through the sm90 backward kernels too (in the
  interpreter, one device): the gradients of q, k, v and the slopes equal
  the f32 reference's, with chunks that hold whole tiles and with chunks
  that do not."""
  mesh = jax.make_mesh((1,), ("seq",))
  n = 2
  rng = np.random.default_rng(7)
  q, k, v = (normal(rng, (1, t, heads, 64)).astype(jnp.bfloat16) for heads in (n, 1, 1))
  slopes = jnp.asarray([0.25, 0.0625], jnp.float32)
  ring = lambda q, k, v, slopes: fa4_jax.context_parallel_attention(
      q, k, v, mesh=mesh, axis_name="seq", is_causal=True, implementation="sm90",
      score_mod=affine_alibi_of(slopes))
  i, j = np.arange(t)[:, None], np.arange(t)[None, :]
  distance = jnp.asarray(i - j, jnp.float32)
  reference = lambda q, k, v, slopes: einsum_attention(
      q, k, v, j <= i, bias=-slopes[None, :, None, None] * distance)[0]
  loss = lambda attend: lambda *a: jnp.sum(
      attend(*a).astype(jnp.float32) * jnp.cos(jnp.arange(64, dtype=jnp.float32)))
  put, restore = on_ring(mesh, 1, P(None, "seq"))
  with fa4_jax.interpret_mode():
    got = jax.jit(jax.grad(loss(ring), (0, 1, 2, 3)))(put(q), put(k), put(v), slopes)
  got = [restore(g) for g in got]
  want = jax.grad(loss(reference), (0, 1, 2, 3))(q, k, v, slopes)
  for label, g, w in zip(("q", "k", "v", "slopes"), got, want):
    assert relative_error(np.asarray(g, np.float32), np.asarray(w, np.float32)) < 2e-2, label
