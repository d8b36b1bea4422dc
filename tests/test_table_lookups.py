"""A score_mod's lookup into a captured table at an index that varies per
element (`table[h, clip(kv_idx - q_idx + 16, 0, 31)]`, T5 buckets) in the
sm90 kernels: one load per element from the table in GMEM
(`sm90_tiles.load_elements`, cached in L1), not a chain of selects over its
entries (two ops per entry and element; a 32-entry table spilled and ran
12x the plain forward on an H100).

* Cross-lowered for sm_90 (no GPU): the forward and both backward kernels
  read the table by invariant global loads (ld.global.nc), one per element
  of a thread's tile, with no select beyond those of the same mod without
  the table; where the int32 ranges of the index show it within the table
  (a user's jnp.clip), jnp's wrap of negative indices and the clamp are
  gone too (`mod_functions._int_ranges`).
* Values: in the GPU interpreter (which cannot run the loads: there the
  select chain reads the table, same values) and, with --kernels-on-gpu,
  on hardware, the forward and the gradients (the table's included)
  against an f32 einsum reference with the bias written out.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from fa4_jax import mod_functions
from reference import einsum_attention, relative_error, visible_mask

BUCKETS = 32
HEADS, KV_HEADS = 4, 2
TABLE = jnp.asarray(np.random.default_rng(3).normal(size=(HEADS, BUCKETS)) * 0.5, jnp.float32)



def _relative(table):
  return lambda s, b, h, q, kv: s + table[h, jnp.clip(kv - q + BUCKETS // 2, 0, BUCKETS - 1)]


def _index_only(s, b, h, q, kv):
  """`_relative`'s index computation without the table."""
  return s + jnp.clip(kv - q + BUCKETS // 2, 0, BUCKETS - 1).astype(jnp.float32)


def _t5_bucket(q, kv):
  rel = kv - q
  dist = jnp.abs(rel)
  big = 8 + (jnp.log(jnp.maximum(dist, 1).astype(jnp.float32) / 8) / np.log(16) * 8
             ).astype(jnp.int32)
  return jnp.where(rel > 0, 16, 0) + jnp.where(dist < 8, dist, jnp.minimum(big, 15))


_LOAD = re.compile(r"llvm\.load %\S+ invariant : !llvm\.ptr<1> -> (\w+)")


def _lowered(cross_lower, score_mod, mask_mod=None, seq=1000):
  """The Mosaic GPU modules of the forward, and of the forward and backward."""
  q = jax.ShapeDtypeStruct((2, seq, HEADS, 128), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((2, seq, KV_HEADS, 128), jnp.bfloat16)
  attention = lambda q, k, v: fa4_jax.attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod,
                                                 implementation="sm90")
  loss = lambda q, k, v: attention(q, k, v).astype(jnp.float32).sum()
  forward = cross_lower(attention, q, kv, kv, arch="sm_90").modules
  backward = cross_lower(jax.grad(loss, argnums=(0, 1, 2)), q, kv, kv, arch="sm_90").modules
  assert len(forward) == 1 and len(backward) == 3  # forward; forward, dK/dV, dQ
  return backward


def test_a_relative_table_is_one_load_per_element_and_no_select_chain(cross_lower):
  """Each kernel reads the table once per element of a thread's 64-element
  tiles (per body that evaluates the mod: masked and full blocks) and
  issues the selects of the same mod without the table and one more, the
  head index's wrap (a scalar, once per tile): the wrap and the clamp of
  the per-element index are known unneeded after the user's clip."""
  with_table = _lowered(cross_lower, _relative(TABLE))
  without = _lowered(cross_lower, _index_only)
  for kernel, (module, reference) in enumerate(zip(with_table, without)):
    loads = _LOAD.findall(module)
    assert loads and len(loads) % 64 == 0 and set(loads) == {"f32"}, (kernel, len(loads))
    assert module.count("arith.select") == reference.count("arith.select") + 1, kernel
    assert module.count("arith.cmpi") == reference.count("arith.cmpi") + 1, kernel


def test_t5_buckets_and_tables_of_other_dtypes_are_loaded_per_element(cross_lower):
  """An index the ranges cannot bound (T5's log buckets) is clamped and
  loaded; a bf16 table is a 16-bit load; a boolean table in a mask_mod is
  int32 in GMEM."""
  allowed = jnp.asarray(np.random.default_rng(4).random((HEADS, BUCKETS)) < 0.8)
  table16 = TABLE.astype(jnp.bfloat16)
  t5 = lambda s, b, h, q, kv: s + table16[h, _t5_bucket(q, kv)]
  mask = lambda b, h, q, kv: allowed[h, jnp.clip(kv - q + 16, 0, 31)] | (kv == q)
  modules = _lowered(cross_lower, t5, mask)
  for module in modules:
    assert {"bf16", "i32"} <= set(_LOAD.findall(module))


def test_a_table_indexed_along_its_first_axis_is_read_with_its_stride(cross_lower):
  """table_t[bucket, h]: the row of head h is strided by the heads."""
  table_t = TABLE.T
  mod = lambda s, b, h, q, kv: s + table_t[jnp.clip(kv - q + 16, 0, 31), h]
  q = jax.ShapeDtypeStruct((1, 512, HEADS, 64), jnp.bfloat16)
  kv = jax.ShapeDtypeStruct((1, 512, KV_HEADS, 64), jnp.bfloat16)
  [module] = cross_lower(lambda q, k, v: fa4_jax.attention(
      q, k, v, score_mod=mod, implementation="sm90"), q, kv, kv, arch="sm_90").modules
  loads = _LOAD.findall(module)
  assert loads and len(loads) % 64 == 0
  strided = re.findall(r"(%\S+) = arith\.muli %\S+, (%\S+) : i32\s+%\S+ = llvm\.getelementptr "
                       r"%\S+\[\1\]", module)
  assert len(strided) == len(loads)
  assert re.search(rf"{re.escape(strided[0][1])} = arith\.constant {HEADS} : i32", module)


def test_a_lookup_along_one_axis_loads_per_vector_element(cross_lower):
  """table[h, clip(kv_idx, 0, 31)] varies along the keys alone: the kernel
  loads the vector of a tile's keys, not every element."""
  module = _lowered(cross_lower, lambda s, b, h, q, kv: s + TABLE[h, jnp.clip(kv, 0, 31)])[0]
  loads = _LOAD.findall(module)
  assert loads and len(loads) < 2 * 64


def test_the_ranges_of_a_clipped_index_and_of_t5_buckets():
  """The analysis bounds what a clip bounds and leaves T5's log buckets
  (a float's conversion) unbounded below."""
  def index_range(fn):
    mod, _ = mod_functions.trace(fn, "score_mod")
    eqn = next(e for e in mod.jaxpr.eqns if e.primitive.name == "dynamic_slice")
    q, kv = (mod_functions.Along(None, axis, (64, 128), bound=2048) for axis in (0, 1))
    env = dict(zip(mod_functions._tile_vars(mod), (None, q, kv)))
    return mod_functions._range_of(eqn.invars[2], mod_functions._int_ranges(mod, env))

  assert index_range(_relative(TABLE)) == (0, BUCKETS - 1)
  assert index_range(lambda s, b, h, q, kv: s + TABLE[h, _t5_bucket(q, kv)]) is None


def _relative_bias(table, t, s):
  index = np.clip(np.arange(s)[None, :] - np.arange(t)[:, None] + BUCKETS // 2, 0, BUCKETS - 1)
  return table[:, index][None]  # [1, N, T, S]


@pytest.mark.parametrize("is_causal", [False, True], ids=["dense", "causal"])
def test_values_and_gradients_match_the_explicit_bias(is_causal, run_interpreted):
  """GQA, odd lengths; the gradient of the table is the backends' XLA pass's."""
  batch, t, s, d = (1, 88, 88, 64) if is_causal else (1, 80, 96, 64)
  keys = jax.random.split(jax.random.PRNGKey(5), 4)
  q = jax.random.normal(keys[0], (batch, t, HEADS, d), jnp.bfloat16)
  k = jax.random.normal(keys[1], (batch, s, KV_HEADS, d), jnp.bfloat16)
  v = jax.random.normal(keys[2], (batch, s, KV_HEADS, d), jnp.bfloat16)
  dout = jax.random.normal(keys[3], q.shape, jnp.float32)

  def ours(q, k, v, table):
    out = fa4_jax.attention(q, k, v, score_mod=_relative(table), is_causal=is_causal,
                            implementation="sm90")
    return jnp.sum(out.astype(jnp.float32) * dout), out

  def reference(q, k, v, table):
    f32 = lambda x: x.astype(jnp.float32)
    visible = visible_mask(t, s, is_causal=is_causal, batch=batch)
    out, _ = einsum_attention(f32(q), f32(k), f32(v), visible, _relative_bias(table, t, s),
                              1 / math.sqrt(d))
    return jnp.sum(out * dout), out

  (_, got), grads = run_interpreted(
      jax.value_and_grad(ours, argnums=(0, 1, 2, 3), has_aux=True), q, k, v, TABLE)
  (_, want), want_grads = jax.value_and_grad(reference, argnums=(0, 1, 2, 3), has_aux=True)(
      q, k, v, TABLE)
  assert relative_error(np.asarray(got, np.float32), np.asarray(want)) < 2e-2
  for name, g, w in zip(("dq", "dk", "dv", "dtable"), grads, want_grads):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    assert np.isfinite(g).all(), name
    assert relative_error(g, w) < 2e-2, (name, relative_error(g, w))


@pytest.mark.parametrize("fn, want", [
    (lambda q, kv: jnp.clip(kv - q, -8, 7) + 8, (0, 15)),
    (lambda q, kv: jax.lax.clamp(jnp.minimum(q, 3), kv, jnp.int32(9)), (0, 9)),
    (lambda q, kv: jnp.where(kv - q > 5000, 40, jnp.maximum(kv - q, 0)), (0, 4095)),
    (lambda q, kv: jnp.where(q >= 0, 3, 50), (3, 3)),  # positions are never negative
    (lambda q, kv: kv - q, (-4095, 4095)),
])
def test_int_ranges_of_positions_below_their_bound(fn, want):
  """The ranges that `_int_ranges` gives an index of positions below 4096."""
  mod, _ = mod_functions.trace(lambda s, b, h, q, kv: s + fn(q, kv).astype(jnp.float32),
                               "score_mod")
  q, kv = (mod_functions.Along(None, axis, (64, 128), bound=4096) for axis in (0, 1))
  ranges = mod_functions._int_ranges(mod, dict(zip(mod_functions._tile_vars(mod), (None, q, kv))))
  convert = next(e for e in mod.jaxpr.eqns if e.primitive.name == "convert_element_type"
                 and e.outvars[0].aval.dtype == jnp.float32)
  assert mod_functions._range_of(convert.invars[0], ranges) == want
