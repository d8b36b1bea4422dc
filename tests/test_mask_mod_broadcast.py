"""A `mask_mod` is classified over the indices it reads, once per call (#52).

* `mod_functions.index_dependence` tells whether a mask_mod's result may
  depend on its `batch` and `head` arguments (data flow through its jaxpr,
  captured arrays indexed by them included).
* A call with a `mask_mod` and no block mask classifies its tiles at one
  batch row where the mod ignores `batch` and at one head where it ignores
  `head`: classes [1, 1, nq, nk] for prefix-LM, and they equal the classes
  of the explicit boolean mask (built here with numpy) at every row and
  head. A mod that reads `batch` (a per-row prefix from a captured array)
  or `head` (a per-head window) keeps that axis whole.
* `create_block_mask` with numbers for batch and heads returns that shape
  either way.
* Under `jax.grad` the forward and the backward share one evaluation
  (`scores.with_shared_mod_classes`): the cross-lowered sm90 gradient holds
  the mask_mod's XLA evaluation once.
* Outputs and gradients against `jax.nn.dot_product_attention(implementation=
  "xla")` with the explicit mask: on the XLA path (sharded too), and for
  the sm90 kernels in the GPU interpreter at tiny shapes.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fa4_jax
from fa4_jax import mod_functions, scores
from reference import relative_error

B, T, S, N, D = 2, 200, 328, 4, 16
PREFIXES = np.array([40, 190], np.int32)  # per batch row
WINDOWS = np.array([8, 30, 64, 1000], np.int32)  # per head


def prefix_lm(b, h, q_idx, kv_idx):
  return (kv_idx < 72) | (kv_idx <= q_idx)


def chunked_local(b, h, q_idx, kv_idx):
  return (q_idx // 96 == kv_idx // 96) & (kv_idx <= q_idx)


def per_row_prefix(b, h, q_idx, kv_idx):
  return (kv_idx < jnp.asarray(PREFIXES)[b]) | (kv_idx <= q_idx)


def per_head_window(b, h, q_idx, kv_idx):
  return (kv_idx <= q_idx) & (q_idx - kv_idx < jnp.asarray(WINDOWS)[h])


@jax.jit
def _ignores_its_first(b, q_idx):
  return q_idx + 0 * 7


def through_a_call(b, h, q_idx, kv_idx):
  return _ignores_its_first(b, q_idx) >= kv_idx


def explicit(name, batch=B, heads=N, t=T, s=S):
  """[batch, heads, t, s] bool: the mask written out with numpy."""
  i, j = np.arange(t)[:, None], np.arange(s)[None, :]
  if name == "prefix_lm":
    m = (j < 72) | (j <= i)
  elif name == "chunked_local":
    m = (i // 96 == j // 96) & (j <= i)
  if name in ("prefix_lm", "chunked_local"):
    return np.broadcast_to(m, (batch, heads, t, s))
  if name == "per_row_prefix":
    m = (j[None] < PREFIXES[:batch, None, None]) | (j <= i)[None]
    return np.broadcast_to(m[:, None], (batch, heads, t, s))
  m = (j <= i)[None] & ((i - j)[None] < WINDOWS[:heads, None, None])
  return np.broadcast_to(m[None], (batch, heads, t, s))


MODS = dict(prefix_lm=prefix_lm, chunked_local=chunked_local, per_row_prefix=per_row_prefix,
            per_head_window=per_head_window)


def classes_of(mask, q_block, kv_block):
  """The tile classes of an explicit mask, one tile at a time: a tile cut by
  the end of the sequences holds only the pairs inside them."""
  bm, hm, t, s = mask.shape
  nq, nk = -(-t // q_block), -(-s // kv_block)
  out = np.zeros((bm, hm, nq, nk), np.int8)
  for a in range(nq):
    for c in range(nk):
      tile = mask[:, :, a * q_block:(a + 1) * q_block, c * kv_block:(c + 1) * kv_block]
      seen, all_seen = tile.any(axis=(2, 3)), tile.all(axis=(2, 3))
      out[:, :, a, c] = np.where(seen & all_seen, scores.FULL,
                                 np.where(seen, scores.PARTIAL, scores.EMPTY))
  return out


def scores_of(mask_mod):
  mod, captured = mod_functions.trace(mask_mod, "mask_mod")
  return scores.Scores(mask_mod=mod, mask_captured=captured)


@pytest.mark.parametrize("mask_mod, reads", [
    (prefix_lm, (False, False)), (chunked_local, (False, False)),
    (per_row_prefix, (True, False)), (per_head_window, (False, True)),
    (lambda b, h, i, j: j <= i + b + h, (True, True)),
    (through_a_call, (False, False)),  # a call's unused argument is no dependence
    (lambda b, h, i, j: jax.lax.cond(b > 0, lambda: i >= j, lambda: i >= j), (True, False)),
])
def test_index_dependence_follows_the_data(mask_mod, reads):
  mod, _ = mod_functions.trace(mask_mod, "mask_mod")
  assert mod_functions.index_dependence(mod) == reads


@pytest.mark.parametrize("name, shape", [
    ("prefix_lm", (1, 1)), ("chunked_local", (1, 1)), ("per_row_prefix", (B, 1)),
    ("per_head_window", (1, N))])
def test_the_implicit_classes_keep_only_the_axes_the_mod_reads(name, shape):
  q_block, kv_block = 64, 128
  got = np.asarray(scores_of(MODS[name]).mod_classes(B, N, T, S, q_block, kv_block))
  want = classes_of(explicit(name), q_block, kv_block)
  assert got.shape == shape + want.shape[2:]
  np.testing.assert_array_equal(np.broadcast_to(got, want.shape), want)


@pytest.mark.parametrize("name", ["prefix_lm", "per_head_window"])
def test_create_block_mask_returns_the_shape_asked_for(name):
  want = classes_of(explicit(name), 128, 128)
  asked = fa4_jax.create_block_mask(MODS[name], B, N, T, S)
  np.testing.assert_array_equal(np.asarray(asked.classes), want)
  broadcast = fa4_jax.create_block_mask(MODS[name], None, None, T, S)
  assert broadcast.shape[:2] == (1, 1)


def test_the_shared_classes_regroup_exactly_and_only_into_unions():
  shared = scores.with_shared_mod_classes(scores_of(chunked_local), B, N, T, S)
  bm = shared.block_mask
  assert bm.unions_only and bm.shape[:2] == (1, 1)
  for q_block, kv_block in ((64, 32), (200, 328)):
    got = np.asarray(shared.mod_classes(B, N, T, S, q_block, kv_block))
    np.testing.assert_array_equal(got[0, 0], classes_of(explicit("chunked_local"), q_block,
                                                        kv_block)[0, 0])
  # Finer tiles (the decode arrangement's rows) are evaluated anew, not repeated.
  assert not scores.block_mask_nests(bm, 1, 64)
  got = np.asarray(shared.mod_classes(B, N, T, S, 1, 64))
  np.testing.assert_array_equal(got[0, 0], classes_of(explicit("chunked_local"), 1, 64)[0, 0])
  # A mod that reads batch or head keeps classifying per call, per shard.
  assert scores.with_shared_mod_classes(scores_of(per_row_prefix), B, N, T, S).block_mask is None


def _inputs(b, t, s, n, d, dtype, seed=0):
  keys = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(keys[0], (b, t, n, d), dtype)
  k = jax.random.normal(keys[1], (b, s, n, d), dtype)
  v = jax.random.normal(keys[2], (b, s, n, d), dtype)
  return q, k, v, jax.random.normal(keys[3], (b, t, n, d), jnp.float32)


def _output_and_grads(attend, dout):
  """(attend(q, k, v), the gradients of sum(out * dout)): one forward."""
  def both(q, k, v):
    out, pull = jax.vjp(attend, q, k, v)
    return out, pull(dout.astype(out.dtype))
  return both


def _reference(name, q, k, v, dout):
  b, t, n, _ = q.shape
  mask = jnp.asarray(explicit(name, b, n, t, k.shape[1]))
  f32 = lambda x: x.astype(jnp.float32)
  attend = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")
  return jax.jit(_output_and_grads(attend, dout))(f32(q), f32(k), f32(v))


def test_a_sharded_gradient_reads_the_shared_classes(host_devices):
  """Batch and heads sharded 2 x 2: every device reads the one [1, 1]
  evaluation made before the partitioned forward and backward."""
  del host_devices
  mesh = jax.make_mesh((2, 2), ("d", "m"))
  q, k, v, dout = _inputs(B, 72, 100, N, D, jnp.float32)
  put = lambda x: jax.device_put(x, NamedSharding(mesh, P("d", None, "m")))
  attend = lambda q, k, v: fa4_jax.attention(q, k, v, mask_mod=prefix_lm)
  out, grads = jax.jit(_output_and_grads(attend, dout))(put(q), put(k), put(v))
  want_out, want_grads = _reference("prefix_lm", q, k, v, dout)
  np.testing.assert_allclose(out, want_out, atol=2e-5, rtol=2e-5)
  for g, w in zip(grads, want_grads):
    np.testing.assert_allclose(g, w, atol=1e-4 * float(jnp.abs(w).max()), rtol=1e-4)


@pytest.mark.parametrize("name", ["prefix_lm", "per_row_prefix", "per_head_window"])
def test_the_xla_path_matches_the_explicit_mask(name, small_xla_blocks):
  """Small blocks: the classes decide which of them are skipped."""
  q, k, v, dout = _inputs(B, 72, 100, N, D, jnp.float32)
  attend = lambda q, k, v: fa4_jax.attention(q, k, v, mask_mod=MODS[name], implementation="xla")
  out, grads = jax.jit(_output_and_grads(attend, dout))(q, k, v)
  want_out, want_grads = _reference(name, q, k, v, dout)
  np.testing.assert_allclose(out, want_out, atol=2e-5, rtol=2e-5)
  for g, w in zip(grads, want_grads):
    np.testing.assert_allclose(g, w, atol=1e-4 * float(jnp.abs(w).max()), rtol=1e-4)


def test_the_sm90_kernels_match_the_explicit_mask(run_interpreted):
  """A mod that reads batch through a captured array: per-row lists, one
  for every head. (Mods that ignore both, the shared [1, 1] classes, run
  in tests/test_sm90_backward_mods.py: prefix-LM.)"""
  name = "per_row_prefix"
  q, k, v, dout = _inputs(2, 72, 200, 2, 64, jnp.bfloat16)
  attend = lambda q, k, v: fa4_jax.attention(q, k, v, mask_mod=MODS[name],
                                             implementation="sm90")
  out, grads = run_interpreted(_output_and_grads(attend, dout), q, k, v)
  want_out, want_grads = _reference(name, q, k, v, dout)
  assert relative_error(out, want_out) < 1e-2
  for g, w in zip(grads, want_grads):
    assert relative_error(g, w) < 2e-2


MARK = 1237  # a constant of the mask_mod alone


def test_jax_grad_evaluates_a_broadcast_mask_mod_once():
  """The forward and the backward kernels' classes come from one evaluation:
  the cross-lowered gradient holds the mod's constant once."""
  spec = jax.ShapeDtypeStruct((1, 512, 2, 64), jnp.bfloat16)
  mask_mod = lambda b, h, i, j: (j < MARK) | (j <= i)
  loss = lambda q, k, v: fa4_jax.attention(q, k, v, mask_mod=mask_mod,
                                           implementation="sm90").astype(jnp.float32).sum()
  jax.clear_caches()
  try:
    with fa4_jax.gpu_target("sm90"):
      text = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).trace(spec, spec, spec).lower(
          lowering_platforms=("cuda",)).as_text()
  finally:
    jax.clear_caches()
  assert len(re.findall(rf"dense<{MARK}>", text)) == 1
