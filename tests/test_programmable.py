"""Programmable attention: `score_mod`, `mask_mod`, `block_mask`.

FlexAttention's contract: `score_mod(score, batch, head, q_idx, kv_idx)` on
the scaled score, `mask_mod(batch, head, q_idx, kv_idx)` and-ed with every
other mask. Each variant here is checked on the XLA path against
`jax.nn.dot_product_attention(implementation="xla")` given the same variant
as an explicit bias or boolean mask, forward and gradients, including the
gradients of the arrays a score_mod closes over (the kernels' own checks are
in tests/test_sm90_forward_mods.py and tests/test_sm90_backward_mods.py).

Tolerances: float32 inputs at "highest" matmul precision (conftest) against
the same math in another order: 2e-5 relative for outputs, 1e-4 for
gradients summed over many keys.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import fa4_jax
from fa4_jax import scores

B, T, S, N, K, D = 2, 384, 448, 4, 2, 32


def inputs(b=B, t=T, s=S, n=N, k=K, d=D, dtype=jnp.float32, seed=0):
  rng = np.random.default_rng(seed)
  make = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)
  return make(b, t, n, d), make(b, s, k, d), make(b, s, k, d)


def positions(t=T, s=S):
  return jnp.arange(t)[:, None], jnp.arange(s)[None, :]


def reference(q, k, v, bias=None, mask=None, **kw):
  return jax.nn.dot_product_attention(q, k, v, bias, mask, implementation="xla", **kw)


def assert_close(got, want, tol=2e-5):
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    np.testing.assert_allclose(g, w, atol=tol * max(1.0, np.abs(w).max()), rtol=tol)


def loss_of(attend):
  """A loss whose gradient weighs every output element differently."""
  def loss(*args):
    out = attend(*args)
    return jnp.sum(out * jnp.cos(out))
  return loss


# --- The variants users write, each as a mod and as the explicit array --------

SLOPES = jnp.asarray([2.0 ** -(i + 1) for i in range(N)], jnp.float32)


def alibi(slopes):
  return lambda score, b, h, q_idx, kv_idx: score - slopes[h] * jnp.abs(q_idx - kv_idx)


def alibi_bias(slopes, t=T, s=S):
  qi, ki = positions(t, s)
  return -slopes[None, :, None, None] * jnp.abs(qi - ki)[None, None]


NUM_BUCKETS = 32


def relative_bucket(q_idx, kv_idx):
  """T5's bidirectional buckets: exact distances up to 8, log-spaced to 128."""
  rel = kv_idx - q_idx
  half = NUM_BUCKETS // 2
  sign_part = jnp.where(rel > 0, half, 0)
  dist = jnp.abs(rel)
  exact = half // 2
  big = exact + (jnp.log(jnp.maximum(dist, 1).astype(jnp.float32) / exact)
                 / np.log(128 / exact) * (half - exact)).astype(jnp.int32)
  return sign_part + jnp.where(dist < exact, dist, jnp.minimum(big, half - 1))


def relative_table(table):
  return lambda score, b, h, q_idx, kv_idx: score + table[h, relative_bucket(q_idx, kv_idx)]


def relative_bias(table, t=T, s=S):
  qi, ki = positions(t, s)
  return table[:, relative_bucket(qi, ki)][None]


PREFIX = 100


def prefix_lm(b, h, q_idx, kv_idx):
  return (kv_idx < PREFIX) | (kv_idx <= q_idx)


CHUNK = 128


def chunked_local(b, h, q_idx, kv_idx):
  return (q_idx // CHUNK == kv_idx // CHUNK) & (kv_idx <= q_idx)


WINDOW, GLOBAL = 64, 16


def window_and_global(b, h, q_idx, kv_idx):
  return (jnp.abs(q_idx - kv_idx) <= WINDOW) | (kv_idx < GLOBAL) | (q_idx < GLOBAL)


def explicit(mask_mod, t=T, s=S):
  qi, ki = positions(t, s)
  return mask_mod(0, 0, qi, ki)[None, None]


# --- Forward and gradients against the explicit arrays ------------------------


@pytest.mark.parametrize("is_causal", [False, True], ids=["dense", "causal"])
def test_alibi_matches_its_bias_and_its_slopes_get_gradients(is_causal):
  q, k, v = inputs()
  ours = lambda q, k, v, slopes: fa4_jax.attention(q, k, v, score_mod=alibi(slopes),
                                                   is_causal=is_causal)
  theirs = lambda q, k, v, slopes: reference(q, k, v, alibi_bias(slopes), is_causal=is_causal)
  assert_close(ours(q, k, v, SLOPES), theirs(q, k, v, SLOPES))
  grads = jax.jit(jax.grad(loss_of(ours), argnums=(0, 1, 2, 3)))(q, k, v, SLOPES)
  assert_close(grads, jax.grad(loss_of(theirs), argnums=(0, 1, 2, 3))(q, k, v, SLOPES), 1e-4)


def test_a_per_head_captured_array_gets_its_gradient_by_one_update_per_head():
  """The XLA path reads `slopes[head]` once per head, not once per score: the
  gradient's scatter-adds carry at most batch x heads updates. One update per
  score serializes on a GPU's atomics (2.4 s for the ALiBi backward at B2
  S8192 H16 on an H100 before `mod_functions.evaluate` batched per axis)."""
  q, k, v = inputs()
  ours = lambda q, k, v, slopes: fa4_jax.attention(q, k, v, score_mod=alibi(slopes),
                                                   implementation="xla")
  hlo = jax.jit(jax.grad(loss_of(ours), argnums=3)).lower(q, k, v, SLOPES).as_text()
  updates = [int(np.prod([int(d) for d in m.split("x")[:-1]] or [1]))
             for m in re.findall(r"stablehlo\.scatter.*?\}\) : \(tensor<[^>]*>, tensor<[^>]*>, "
                                 r"tensor<([^>]*)>\)", hlo, re.S)]
  assert updates, "no scatter-add: the test no longer sees the gradient it checks"
  assert max(updates) <= q.shape[0] * N, updates


def test_relative_position_table_matches_its_bias_and_the_table_gets_gradients():
  q, k, v = inputs()
  table = jnp.asarray(np.random.default_rng(1).normal(size=(N, NUM_BUCKETS)), jnp.float32)
  ours = lambda q, table: fa4_jax.attention(q, k, v, score_mod=relative_table(table))
  theirs = lambda q, table: reference(q, k, v, relative_bias(table))
  assert_close(ours(q, table), theirs(q, table))
  grads = jax.grad(loss_of(ours), argnums=(0, 1))(q, table)
  assert_close(grads, jax.grad(loss_of(theirs), argnums=(0, 1))(q, table), 1e-4)


@pytest.mark.parametrize("mask_mod", [prefix_lm, chunked_local, window_and_global],
                         ids=["prefix_lm", "chunked_local", "window_and_global"])
def test_mask_mods_match_their_boolean_masks(mask_mod):
  q, k, v = inputs(seed=2)
  mask = explicit(mask_mod)
  ours = lambda q, k, v: fa4_jax.attention(q, k, v, mask_mod=mask_mod)
  theirs = lambda q, k, v: reference(q, k, v, mask=mask)
  assert_close(ours(q, k, v), theirs(q, k, v))
  assert_close(jax.grad(loss_of(ours), argnums=(0, 1, 2))(q, k, v),
               jax.grad(loss_of(theirs), argnums=(0, 1, 2))(q, k, v), 1e-4)


def test_a_tree_mask_for_speculative_decoding():
  # A cache of 200 keys, then 24 draft tokens laid out depth-first: token j
  # is an ancestor of token i when j <= i < j + subtree_size[j]; a draft
  # token sees the whole cache and its ancestors (itself included).
  cache, draft = 200, 24
  rng = np.random.default_rng(3)
  parents = [-1] + [int(rng.integers(0, i)) for i in range(1, draft)]
  children = {i: [j for j in range(draft) if parents[j] == i] for i in range(draft)}
  order = []

  def visit(i):
    order.append(i)
    for c in children[i]:
      visit(c)

  visit(0)
  depth_first = {node: pos for pos, node in enumerate(order)}
  size = np.zeros(draft, np.int32)
  for node in reversed(order):
    size[depth_first[node]] = 1 + sum(size[depth_first[c]] for c in children[node])
  subtree_size = jnp.asarray(size)

  def tree_mask(b, h, q_idx, kv_idx):
    j = kv_idx - cache
    return (kv_idx < cache) | ((j <= q_idx) & (q_idx < j + subtree_size[jnp.clip(j, 0, draft - 1)]))

  q, k, v = inputs(t=draft, s=cache + draft, seed=4)
  qi, ki = positions(draft, cache + draft)
  ancestor = np.zeros((draft, draft), bool)
  for node in range(draft):  # walk up from each token
    a = node
    while a != -1:
      ancestor[depth_first[node], depth_first[a]] = True
      a = parents[a]
  mask = jnp.concatenate([jnp.ones((draft, cache), bool), jnp.asarray(ancestor)], axis=1)
  assert_close(fa4_jax.attention(q, k, v, mask_mod=tree_mask),
               reference(q, k, v, mask=mask[None, None]))


def test_mods_combine_with_causal_lengths_gqa_segment_ids_sinks_and_soft_cap():
  q, k, v = inputs(t=S, seed=5)
  q_len, kv_len = jnp.asarray([S, 300]), jnp.asarray([S - 7, 250])
  ids = jnp.asarray(np.repeat(np.arange(4), S // 4)[None].repeat(B, 0))
  sinks = jnp.asarray([0.5, -1.0, 0.0, 2.0], jnp.float32)
  cap = 5.0
  kw = dict(is_causal=True, query_seq_lengths=q_len, key_value_seq_lengths=kv_len)

  def ours(q, k, v, slopes, sinks):
    return fa4_jax.attention(q, k, v, score_mod=alibi(slopes), mask_mod=prefix_lm, sinks=sinks,
                             logits_soft_cap=cap, query_segment_ids=ids,
                             key_value_segment_ids=ids, **kw)

  def theirs(q, k, v, slopes, sinks):
    # The same in einsum form: score_mod, soft-cap, every mask, a sink column.
    qi, ki = positions(S, S)
    s = jnp.einsum("btkgd,bskd->bkgts", q.reshape(B, S, K, N // K, D), k) * D ** -0.5
    s = s.reshape(B, N, S, S) + alibi_bias(slopes, S, S)
    s = cap * jnp.tanh(s / cap)
    seen = ((ki <= qi) & prefix_lm(0, 0, qi, ki))[None, None]
    seen = seen & (ki < kv_len[:, None, None, None]) & (ids[:, None, :, None] == ids[:, None, None, :])
    s = jnp.where(seen, s, -jnp.inf)
    sink = jnp.broadcast_to(sinks[None, :, None, None], (B, N, S, 1))
    p = jax.nn.softmax(jnp.concatenate([s, sink], -1), -1)[..., :-1]
    out = jnp.einsum("bkgts,bskd->btkgd", p.reshape(B, K, N // K, S, S), v).reshape(B, S, N, D)
    return jnp.where((jnp.arange(S)[None, :] < q_len[:, None])[..., None, None], out, 0.0)

  args = (q, k, v, SLOPES, sinks)
  assert_close(ours(*args), theirs(*args))
  assert_close(jax.grad(loss_of(ours), argnums=(0, 1, 2, 3, 4))(*args),
               jax.grad(loss_of(theirs), argnums=(0, 1, 2, 3, 4))(*args), 2e-4)


def test_a_score_mod_may_read_per_batch_data():
  q, k, v = inputs(seed=6)
  temperature = jnp.asarray([1.0, 0.5])  # one per batch row
  ours = fa4_jax.attention(q, k, v, score_mod=lambda s, b, h, qi, ki: s / temperature[b])
  theirs = jnp.stack([reference(q[i:i + 1], k[i:i + 1], v[i:i + 1],
                                scale=D ** -0.5 / float(temperature[i])) for i in range(B)])
  assert_close(ours, theirs[:, 0])


# --- Built-ins written as mods give the built-ins' results ---------------------


def test_built_ins_written_as_mods_give_the_built_ins_results():
  q, k, v = inputs(t=S, seed=7)
  cases = [
      (dict(mask_mod=lambda b, h, qi, ki: ki <= qi), dict(is_causal=True)),
      (dict(mask_mod=lambda b, h, qi, ki: (ki <= qi) & (ki >= qi - 50)),
       dict(is_causal=True, local_window_size=(50, 0))),
      (dict(score_mod=lambda s, b, h, qi, ki: 7.0 * jnp.tanh(s / 7.0)), dict(logits_soft_cap=7.0)),
  ]
  for as_mod, built_in in cases:
    assert_close(fa4_jax.attention(q, k, v, **as_mod), fa4_jax.attention(q, k, v, **built_in))
  ids = jnp.asarray(np.random.default_rng(8).integers(0, 3, size=(B, S)))
  by_mod = fa4_jax.attention(q, k, v, mask_mod=lambda b, h, qi, ki: ids[b, qi] == ids[b, ki])
  by_ids = fa4_jax.attention(q, k, v, query_segment_ids=ids, key_value_segment_ids=ids)
  assert_close(by_mod, by_ids)


# --- Block masks ----------------------------------------------------------------


def test_tile_classes_of_a_causal_mask_are_counted():
  bm = fa4_jax.create_block_mask(lambda b, h, qi, ki: ki <= qi, None, None, 512, 512)
  assert bm.shape == (1, 1, 4, 4)
  classes = np.asarray(bm.classes[0, 0])
  assert (np.diag(classes) == scores.PARTIAL).all()
  assert (classes[np.tril_indices(4, -1)] == scores.FULL).all()
  assert (classes[np.triu_indices(4, 1)] == scores.EMPTY).all()
  counts, order = scores.block_lists(bm.classes)
  np.testing.assert_array_equal(counts[0, 0], [[1, 0], [1, 1], [1, 2], [1, 3]])
  np.testing.assert_array_equal(order[0, 0, 3], [3, 0, 1, 2])  # partial first, then full


@pytest.mark.parametrize("tiles_per_step", [None, 2])  # all five query tiles at once; 2 + 2 + 1
def test_tile_classes_of_prefix_lm_and_of_odd_lengths(tiles_per_step, monkeypatch):
  if tiles_per_step:
    monkeypatch.setattr(scores, "MASK_MOD_STEP_ELEMENTS", tiles_per_step * 2 * 3 * 64 * 320)
  bm = fa4_jax.create_block_mask(prefix_lm, 2, 3, 300, 260, q_block=64, kv_block=64)
  assert bm.shape == (2, 3, 5, 5)
  want = np.where(explicit(prefix_lm, 300, 260)[0, 0], 1, 0)
  padded = np.zeros((320, 320), np.int32)
  padded[:300, :260] = want
  real = np.zeros((320, 320), bool)
  real[:300, :260] = True
  for i in range(5):
    for j in range(5):
      tile, ok = padded[64 * i:64 * i + 64, 64 * j:64 * j + 64], real[64 * i:64 * i + 64, 64 * j:64 * j + 64]
      expected = (scores.EMPTY if not tile.any() else
                  scores.FULL if tile[ok].all() else scores.PARTIAL)
      assert int(bm.classes[1, 2, i, j]) == expected, (i, j)


def test_a_block_mask_reused_gives_its_mask_mods_result_under_jit():
  q, k, v = inputs(seed=9)
  bm = fa4_jax.create_block_mask(chunked_local, None, None, T, S)

  @jax.jit
  def two_layers(q, k, v, bm):
    x = fa4_jax.attention(q, k, v, block_mask=bm)
    return fa4_jax.attention(x, k, v, block_mask=bm)

  x = reference(q, k, v, mask=explicit(chunked_local))
  assert_close(two_layers(q, k, v, bm), reference(x, k, v, mask=explicit(chunked_local)))


def test_a_block_mask_at_other_tiles_is_regrouped():
  q, k, v = inputs(seed=10)
  for q_block, kv_block in ((64, 256), (256, 64), (96, 96)):
    bm = fa4_jax.create_block_mask(window_and_global, None, None, T, S, q_block=q_block,
                                   kv_block=kv_block)
    assert_close(fa4_jax.attention(q, k, v, block_mask=bm),
                 reference(q, k, v, mask=explicit(window_and_global)))


def test_the_xla_path_skips_the_key_blocks_a_mask_mod_hides(small_xla_blocks):
  # A mask_mod that would poison every pair it is evaluated on outside its
  # chunk cannot show: hidden blocks are never computed, and inside visited
  # blocks it is masked. (NaN scores in skipped blocks would leak otherwise.)
  q, k, v = inputs(b=1, t=64, s=64, seed=11)
  poisoned = lambda s, b, h, qi, ki: jnp.where(qi // 16 == ki // 16, s, jnp.nan)
  same_chunk = lambda b, h, qi, ki: qi // 16 == ki // 16
  out = fa4_jax.attention(q, k, v, score_mod=poisoned, mask_mod=same_chunk)
  assert np.isfinite(np.asarray(out)).all()
  assert_close(out, reference(q, k, v, mask=explicit(same_chunk, 64, 64)))


# --- Transformations --------------------------------------------------------------


def test_vmap_over_layers_with_their_own_slopes():
  q, k, v = inputs(b=1, seed=12)
  slopes = jnp.stack([SLOPES, 2 * SLOPES])
  batched = jax.vmap(lambda s: fa4_jax.attention(q, k, v, score_mod=alibi(s)))(slopes)
  for i in range(2):
    assert_close(batched[i], reference(q, k, v, alibi_bias(slopes[i])))


def test_jvp_along_the_captured_slopes():
  q, k, v = inputs(seed=13)
  ours = jax.jvp(lambda s: fa4_jax.attention(q, k, v, score_mod=alibi(s)), (SLOPES,), (SLOPES,))
  theirs = jax.jvp(lambda s: reference(q, k, v, alibi_bias(s)), (SLOPES,), (SLOPES,))
  assert_close(ours, theirs, 1e-4)


def test_sharded_heads_and_batch_see_global_indices(host_devices):
  # Heads sharded 2 ways: a device holding heads 2-3 must read slopes[2:4],
  # and a block mask sharded with the batch must stay its shard's.
  mesh = jax.make_mesh((2, 2), ("d", "m"))
  q, k, v = inputs(seed=14)
  per_batch = jnp.asarray([0.0, 3.0])
  score_mod = lambda s, b, h, qi, ki: s - SLOPES[h] * jnp.abs(qi - ki) + per_batch[b]
  bm = fa4_jax.create_block_mask(lambda b, h, qi, ki: (ki <= qi) | (b == 1), B, None, T, S)

  def loss(q, k, v, slopes):
    mod = lambda s, b, h, qi, ki: s - slopes[h] * jnp.abs(qi - ki) + per_batch[b]
    return loss_of(lambda q: fa4_jax.attention(q, k, v, score_mod=mod, block_mask=bm))(q)

  put = lambda x, *spec: jax.device_put(x, NamedSharding(mesh, P(*spec)))
  sharded = (put(q, "d", None, "m"), put(k, "d", None, "m"), put(v, "d", None, "m"))
  got = jax.jit(jax.value_and_grad(loss, argnums=(0, 3)))(*sharded, SLOPES)
  want = jax.value_and_grad(loss, argnums=(0, 3))(q, k, v, SLOPES)
  assert_close(got, want, 1e-4)
  mask = jnp.stack([explicit(lambda b, h, qi, ki: ki <= qi)[0], jnp.ones((1, T, S), bool)])
  bias = alibi_bias(SLOPES) + per_batch[:, None, None, None]
  assert_close(jax.jit(lambda q, k, v: fa4_jax.attention(q, k, v, score_mod=score_mod,
                                                         block_mask=bm))(*sharded),
               reference(q, k, v, bias, mask))


def test_flax_attention_fn_takes_the_mods():
  nnx = pytest.importorskip("flax.nnx")
  import fa4_jax.flax as fa4_flax
  layer = nnx.MultiHeadAttention(num_heads=N, in_features=64, qkv_features=N * D,
                                 decode=False, rngs=nnx.Rngs(0),
                                 attention_fn=fa4_flax.make_attention_fn(score_mod=alibi(SLOPES)))
  x = jnp.asarray(np.random.default_rng(15).normal(size=(B, 96, 64)), jnp.float32)
  flax_bias = lambda q, k, v, **kw: jax.nn.dot_product_attention(
      q, k, v, alibi_bias(SLOPES, 96, 96), implementation="xla")
  expected = nnx.MultiHeadAttention(num_heads=N, in_features=64, qkv_features=N * D,
                                    decode=False, rngs=nnx.Rngs(0), attention_fn=flax_bias)
  assert_close(layer(x), expected(x))


# --- Bad input ----------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    (dict(score_mod=lambda s, b, h: s), "must take 5 positional arguments"),
    (dict(mask_mod=lambda b, h, qi: qi > 0), "must take 4 positional arguments"),
    (dict(mask_mod=lambda b, h, qi, ki: qi - ki), "must return a bool"),
    (dict(score_mod=lambda s, b, h, qi, ki: qi > ki), "must return a float score"),
    (dict(score_mod=lambda s, b, h, qi, ki: jnp.stack([s, s])), "must be elementwise"),
    (dict(score_mod="alibi"), "must be a function"),
    (dict(score_mod=lambda s, b, h, qi, ki: s + undefined_name), "failed when called"),  # noqa: F821
    (dict(block_mask=np.ones((1, 1, 3, 4))), "must come from fa4_jax.create_block_mask"),
])
def test_bad_mods_raise_a_clear_value_error(kwargs, message):
  q, k, v = inputs(t=64, s=64)
  with pytest.raises(ValueError, match=message):
    fa4_jax.attention(q, k, v, **kwargs)


def test_a_block_mask_for_other_shapes_raises():
  q, k, v = inputs(t=64, s=64)
  bm = fa4_jax.create_block_mask(prefix_lm, None, None, 128, 64)
  with pytest.raises(ValueError, match="block_mask` was made for"):
    fa4_jax.attention(q, k, v, block_mask=bm)


def test_cudnn_refuses_mods():
  q, k, v = inputs(t=64, s=64)
  with pytest.raises(ValueError, match="score_mod"):
    fa4_jax.attention(q, k, v, score_mod=alibi(SLOPES), implementation="cudnn")


def test_a_kernel_that_cannot_run_an_op_names_it(monkeypatch):
  from fa4_jax import backends, interpret
  monkeypatch.setattr(interpret, "is_interpreting", lambda: True)
  q, k, v = inputs(t=64, s=64, dtype=jnp.bfloat16)
  with pytest.raises(ValueError, match="'sin'.*implementation='xla'"):
    fa4_jax.which_implementation(q, k, v, score_mod=lambda s, b, h, qi, ki: jnp.sin(s),
                                 implementation="sm90")
  assert backends.select(None, backends.CallInfo(
      q.shape, k.shape, q.dtype, scores.MaskSpec(), False, False)).name in ("xla", "sm90")


def test_a_captured_lookup_the_kernels_cannot_read_falls_back_to_xla(monkeypatch):
  # Per element along two axes: found before any kernel is traced.
  from fa4_jax import interpret
  monkeypatch.setattr(interpret, "is_interpreting", lambda: True)
  q, k, v = inputs(t=256, s=256, dtype=jnp.bfloat16)
  keep = jnp.asarray(np.random.default_rng(16).random((2, 2)) < 0.5)
  tiles = lambda b, h, qi, ki: keep[qi // 128, ki // 128]
  assert fa4_jax.which_implementation(q, k, v, mask_mod=tiles) == "xla"
  with pytest.raises(ValueError, match="two axes"):
    fa4_jax.which_implementation(q, k, v, mask_mod=tiles, implementation="sm90")


def test_paged_attention_takes_the_mods_on_the_xla_path():
  # A tree of 4 draft tokens after each row's cache: draft j sees the cache,
  # itself and its ancestors (parent[j]), through a page table.
  rng = np.random.default_rng(21)
  page, pages, heads = 16, 12, 4
  q = jnp.asarray(rng.normal(size=(2, 4, heads, D)), jnp.float32)
  key_pages, value_pages = (jnp.asarray(rng.normal(size=(pages, page, 2, D)), jnp.float32)
                            for _ in range(2))
  table = jnp.asarray(rng.permutation(pages)[:8].reshape(2, 4))
  lengths = jnp.asarray([50, 37])  # the drafts are each row's last 4 keys
  ancestor = jnp.asarray([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], bool)
  slopes = jnp.asarray([0.1, 0.2, 0.3, 0.4])

  def loss(q, slopes):
    tree = lambda b, h, i, j: ((j < lengths[b] - 4)
                               | ancestor[i, jnp.clip(j - (lengths[b] - 4), 0, 3)])
    alibi = lambda s, b, h, i, j: s - slopes[h] * jnp.abs(i - j)
    out = fa4_jax.paged_attention(q, key_pages, value_pages, table, lengths, is_causal=False,
                                  score_mod=alibi, mask_mod=tree)
    return jnp.sum(out * jnp.cos(out))

  from fa4_jax.paged import gather_pages
  k, v = gather_pages(key_pages, table), gather_pages(value_pages, table)
  j = jnp.arange(64)[None, None, :]
  start = (lengths - 4)[:, None, None]
  keep = (j < start) | ((j < lengths[:, None, None])
                        & ancestor[jnp.arange(4)[None, :, None], jnp.clip(j - start, 0, 3)])

  def reference_loss(q, slopes):
    bias = -slopes[None, :, None, None] * jnp.abs(jnp.arange(4)[:, None] - jnp.arange(64))
    out = reference(q, k, v, bias, keep[:, None])
    return jnp.sum(out * jnp.cos(out))

  assert fa4_jax.which_paged_implementation(q, key_pages, value_pages, table, lengths,
                                            mask_mod=lambda b, h, i, j: j >= 0) == "xla"
  assert_close(jax.value_and_grad(loss, argnums=(0, 1))(q, slopes),
               jax.value_and_grad(reference_loss, argnums=(0, 1))(q, slopes), 1e-4)


# --- The kernels' interpreter: positions as row and column vectors -------------


def _kernel_mods():
  """(name, traced mod, captured arrays): score_mods and mask_mods whose ops
  run on row or column vectors, on lazy row-minus-column sums, and on tiles."""
  table = jnp.asarray(np.random.default_rng(3).normal(size=(N, 32)), jnp.float32)

  def t5_bucket(q, k):
    rel = k - q
    dist = jnp.abs(rel)
    big = 8 + (jnp.log(jnp.maximum(dist, 1).astype(jnp.float32) / 8) * 2.885).astype(jnp.int32)
    return jnp.where(rel > 0, 16, 0) + jnp.where(dist < 8, dist, jnp.minimum(big, 15))

  fns = {
      "alibi": ("score_mod", alibi(SLOPES)),
      "causal alibi": ("score_mod",
                       lambda s, b, h, q, k: s - SLOPES[h] * (q - k).astype(jnp.float32)),
      "t5 table": ("score_mod", lambda s, b, h, q, k: s + table[h, t5_bucket(q, k)]),
      "column table": ("score_mod", lambda s, b, h, q, k: s * table[h, k % 32]),
      "row and column terms": ("score_mod",
                               lambda s, b, h, q, k: s + (q * 3).astype(jnp.float32)
                               - jnp.sqrt((k + 1).astype(jnp.float32))),
      "prefix-lm": ("mask_mod", lambda b, h, q, k: (k < 100) | (k <= q)),
      "chunked": ("mask_mod", lambda b, h, q, k: q // 64 == k // 64),
  }
  out = []
  for name, (kind, fn) in fns.items():
    mod, captured = fa4_jax.mod_functions.trace(fn, kind)
    out.append(pytest.param(mod, captured, id=name))
  return out


def _on_tile(mod, captured, along: bool, shape=(16, 24), q_lo=40, k_lo=8, bound=4096):
  from fa4_jax.mod_functions import Along, bind
  q_vec = q_lo + jnp.arange(shape[0], dtype=jnp.int32)
  k_vec = k_lo + jnp.arange(shape[1], dtype=jnp.int32)
  if along:
    q_idx, k_idx = Along(q_vec, 0, shape, bound), Along(k_vec, 1, shape, bound)
  else:
    q_idx = jnp.broadcast_to(q_vec[:, None], shape)
    k_idx = jnp.broadcast_to(k_vec[None, :], shape)
  score = jnp.asarray(np.random.default_rng(4).normal(size=shape), jnp.float32)
  tile_args = ((score,) if mod.kind == "score_mod" else ()) + (q_idx, k_idx)
  refs = [fa4_jax.mod_functions.kernel_operand(c) for c in captured]
  return bind(mod, refs, jnp.int32(1), jnp.int32(2))(*tile_args)


@pytest.mark.parametrize("mod,captured", _kernel_mods())
def test_positions_as_row_and_column_vectors_give_the_tiles_results(mod, captured):
  """The kernels hand a mod its positions as vectors along the tile's rows
  and columns (`mod_functions.Along`); the interpreter runs ops on a vector
  until one needs the tile. The values must be those of whole tiles, bit for
  bit (the same ops on the same values; the one rewrite, float(q - k) as
  float(q) - float(k), is exact below 2**24)."""
  got = _on_tile(mod, captured, along=True)
  want = _on_tile(mod, captured, along=False)
  assert got.shape == want.shape == (16, 24)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_alibi_converts_positions_per_vector_not_per_score():
  """ALiBi's (q_idx - kv_idx).astype(float32) (the causal form; the
  symmetric one takes abs first) issues no int-to-float conversion per score
  (a quarter-rate op on Hopper, as the softmax's exp2), only per row and per
  column; with positions that may reach 2**24 it keeps the exact per-score
  conversion."""
  causal_alibi = lambda s, b, h, q, k: s - SLOPES[h] * (q - k).astype(jnp.float32)
  mod, captured = fa4_jax.mod_functions.trace(causal_alibi, "score_mod")

  def tile_converts(bound):
    jaxpr = jax.make_jaxpr(lambda: _on_tile(mod, captured, along=True, bound=bound))()
    return sum(e.primitive.name == "convert_element_type" and e.outvars[0].aval.shape == (16, 24)
               for e in jaxpr.eqns)

  assert tile_converts(bound=4096) == 0
  assert tile_converts(bound=2 ** 24) == 1  # 2**24 + 2**24 is past float32's exact ints
