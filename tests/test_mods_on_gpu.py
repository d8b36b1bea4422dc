"""Score mods, mask mods and a value head dim of its own on real hardware
(skipped without a Hopper GPU).

The interpreter tests run these kernels at tiny shapes; here the same
contract is checked at training sizes, odd lengths and GQA: forward and
gradients (those of the arrays a score_mod captures included) of the sm90
kernels against `jax.nn.dot_product_attention(implementation="xla")` given
the same variant as an explicit bias or mask, computed in float32. Then
what ptxas makes of the kernels the mods add: no wgmma serialized, and the
spill bytes of each printed beside those of the plain kernel (`pytest -s`).
Kept apart from `test_on_gpu.py` so that each file runs within one
ten-minute device command.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ptxas_dumps

import fa4_jax
from fa4_jax import backends
from reference import relative_error
from test_table_lookups import _t5_bucket as t5_bucket  # T5's relative buckets

pytestmark = pytest.mark.skipif(backends.device_arch_major() != 9,
                                reason="needs a Hopper GPU")

f32 = lambda x: jnp.asarray(x, jnp.float32)


def _inputs(b, t, s, nq, nkv, d, dv=None, seed=0):
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(b, t, nq, d)), jnp.bfloat16)
  k = jnp.asarray(rng.normal(size=(b, s, nkv, d)), jnp.bfloat16)
  v = jnp.asarray(rng.normal(size=(b, s, nkv, dv or d)), jnp.bfloat16)
  dout = jnp.asarray(rng.normal(size=(b, t, nq, dv or d)), jnp.bfloat16)
  return q, k, v, dout


def _alibi(num_heads):
  return jnp.asarray([2.0 ** (-8 * (i + 1) / num_heads) for i in range(num_heads)], jnp.float32)


def _check(ours, reference, args, dout, wrt, *, out_tol=2e-2, grad_tol=2e-2):
  """ours(*args) and reference(*args) agree, outputs elementwise (bf16
  output: 2e-2 of values of order one) and gradients of the cotangent dout
  by relative error over all elements (bf16 inputs: about 1 % expected)."""
  out = ours(*args)
  want = reference(*[f32(a) for a in args])
  np.testing.assert_allclose(f32(out), want, atol=out_tol)
  grads = jax.grad(lambda *a: jnp.vdot(f32(ours(*a)), f32(dout)), argnums=wrt)(*args)
  want_grads = jax.grad(lambda *a: jnp.vdot(reference(*a), f32(dout)), argnums=wrt)(
      *[f32(a) for a in args])
  for index, got, expected in zip(wrt, grads, want_grads):
    assert relative_error(got, expected) < grad_tol, (index, relative_error(got, expected))


@pytest.mark.parametrize("b, t", [(1, 2000), (2, 2049)])
def test_alibi_score_mod_gqa_causal_odd_length_with_slope_gradients(b, t):
  nq, nkv, d = 8, 2, 128
  q, k, v, dout = _inputs(b, t, t, nq, nkv, d)
  slopes = _alibi(nq)
  scale = d ** -0.5

  def ours(q, k, v, slopes):
    return fa4_jax.attention(
        q, k, v, is_causal=True, implementation="sm90",
        score_mod=lambda s, b_, h, qi, ki: s - slopes[h] * (qi - ki).astype(jnp.float32))

  def reference(q, k, v, slopes):
    distance = (jnp.arange(t)[:, None] - jnp.arange(t)[None, :]).astype(jnp.float32)
    bias = -slopes[None, :, None, None] * distance[None, None]
    return jax.nn.dot_product_attention(q, k, v, bias=bias, scale=scale, is_causal=True,
                                        implementation="xla")

  assert fa4_jax.which_implementation(q, k, v, is_causal=True, score_mod=lambda s, *_: s) == "sm90"
  _check(ours, reference, (q, k, v, slopes), dout, (0, 1, 2, 3))


def test_affine_mod_of_twice_the_score_and_row_terms_gqa_causal():
  """A score_mod a * score + R(q_idx) (`mod_functions.affine_form`): the
  kernels keep the raw logits with a in the exp2 constant, and R moves the
  rows' running max and lse (forward) and lse2 (backward): forward and
  gradients as jax.nn's with twice the scale and R as a bias."""
  b, t, nq, nkv, d = 2, 2049, 8, 2, 128
  q, k, v, dout = _inputs(b, t, t, nq, nkv, d, seed=8)

  def ours(q, k, v):
    return fa4_jax.attention(
        q, k, v, is_causal=True, implementation="sm90",
        score_mod=lambda s, b_, h, qi, ki: 2 * s + 1e-3 * qi.astype(jnp.float32) + 0.5)

  def reference(q, k, v):
    rows = 1e-3 * jnp.arange(t, dtype=jnp.float32)[:, None] + 0.5
    return jax.nn.dot_product_attention(q, k, v, bias=jnp.broadcast_to(rows, (1, nq, t, t)),
                                        scale=2 * d ** -0.5, is_causal=True,
                                        implementation="xla")

  _check(ours, reference, (q, k, v), dout, (0, 1, 2))


@pytest.mark.parametrize("t", [4096, 4000], ids=["tiles-in-chunks", "tiles-across-chunks"])
def test_alibi_on_a_ring_of_one_gpu_in_the_affine_form(t):
  """ALiBi through `context_parallel_attention` on a ring of one GPU: its
  rows and keys are two chunks of t / 2, and the ring's remap of their
  positions (`context_parallel._at_global_positions`) keeps the affine form
  (`mod_functions._bind_positions`): a scalar shift per tile where chunks
  of 2048 hold whole tiles, per position where chunks of 2000 do not."""
  nq, nkv, d = 8, 2, 128
  q, k, v, dout = _inputs(1, t, t, nq, nkv, d, seed=9)
  slopes = _alibi(nq)
  mesh = jax.make_mesh((1,), ("seq",), devices=jax.devices()[:1])  # chunks 0, 1: natural order

  def ours(q, k, v, slopes):
    return fa4_jax.context_parallel_attention(
        q, k, v, mesh=mesh, axis_name="seq", is_causal=True, implementation="sm90",
        score_mod=lambda s, b_, h, qi, ki: s - slopes[h] * (qi - ki).astype(jnp.float32))

  def reference(q, k, v, slopes):
    distance = (jnp.arange(t)[:, None] - jnp.arange(t)[None, :]).astype(jnp.float32)
    bias = -slopes[None, :, None, None] * distance[None, None]
    return jax.nn.dot_product_attention(q, k, v, bias=bias, scale=d ** -0.5, is_causal=True,
                                        implementation="xla")

  _check(ours, reference, (q, k, v, slopes), dout, (0, 1, 2, 3))


def test_bucket_table_score_mod_dense_head_dim_64_with_table_gradients():
  b, t, s, nq, nkv, d = 2, 777, 1500, 4, 4, 64
  q, k, v, dout = _inputs(b, t, s, nq, nkv, d, seed=1)
  table = jnp.asarray(np.random.default_rng(2).normal(size=(nq, 16)) * 0.5, jnp.float32)

  def bucket(qi, ki):
    return jnp.clip(ki - qi, -8, 7) + 8

  def ours(q, k, v, table):
    return fa4_jax.attention(q, k, v, implementation="sm90",
                             score_mod=lambda sc, b_, h, qi, ki: sc + table[h, bucket(qi, ki)])

  def reference(q, k, v, table):
    buckets = bucket(jnp.arange(t)[:, None], jnp.arange(s)[None, :])
    return jax.nn.dot_product_attention(q, k, v, bias=table[:, buckets][None],
                                        implementation="xla")

  _check(ours, reference, (q, k, v, table), dout, (0, 1, 2, 3))


@pytest.mark.parametrize("bucket", ["clipped", "t5"])
def test_a_32_entry_table_read_per_element_gqa_causal_head_dim_128_with_table_gradients(
    bucket):
  """The sm90 kernels read table[h, index(q_idx, kv_idx)] by one load per
  element (`sm90_tiles.load_elements`): a clipped relative position (known
  within the table, read unclamped) and T5's log buckets (clamped)."""
  b, t, nq, nkv, d = 2, 2049, 8, 2, 128
  q, k, v, dout = _inputs(b, t, t, nq, nkv, d, seed=6)
  table = jnp.asarray(np.random.default_rng(7).normal(size=(nq, 32)) * 0.5, jnp.float32)
  index = ((lambda qi, ki: jnp.clip(ki - qi + 16, 0, 31)) if bucket == "clipped"
           else t5_bucket)

  def ours(q, k, v, table):
    return fa4_jax.attention(q, k, v, is_causal=True, implementation="sm90",
                             score_mod=lambda sc, b_, h, qi, ki: sc + table[h, index(qi, ki)])

  def reference(q, k, v, table):
    buckets = index(jnp.arange(t)[:, None], jnp.arange(t)[None, :])
    return jax.nn.dot_product_attention(q, k, v, bias=table[:, buckets][None], is_causal=True,
                                        implementation="xla")

  _check(ours, reference, (q, k, v, table), dout, (0, 1, 2, 3))


def test_prefix_lm_mask_mod_with_a_block_mask():
  b, t, nq, nkv, d, prefix = 2, 3001, 4, 2, 128, 1100
  q, k, v, dout = _inputs(b, t, t, nq, nkv, d, seed=3)
  prefix_lm = lambda b_, h, qi, ki: (ki <= qi) | (ki < prefix)
  block_mask = fa4_jax.create_block_mask(prefix_lm, None, None, t, t)

  def ours(q, k, v):
    return fa4_jax.attention(q, k, v, implementation="sm90", mask_mod=prefix_lm,
                             block_mask=block_mask)

  def reference(q, k, v):
    visible = prefix_lm(0, 0, jnp.arange(t)[:, None], jnp.arange(t)[None, :])
    return jax.nn.dot_product_attention(q, k, v, mask=visible[None, None],
                                        implementation="xla")

  _check(ours, reference, (q, k, v), dout, (0, 1, 2))


def test_chunked_local_mask_mod_without_a_block_mask_on_a_causal_base():
  b, t, nq, nkv, d, chunk = 1, 4099, 8, 1, 64, 1024
  q, k, v, dout = _inputs(b, t, t, nq, nkv, d, seed=4)
  chunked = lambda b_, h, qi, ki: qi // chunk == ki // chunk

  def ours(q, k, v):
    return fa4_jax.attention(q, k, v, is_causal=True, implementation="sm90", mask_mod=chunked)

  def reference(q, k, v):
    pos = jnp.arange(t)
    visible = (pos[:, None] >= pos[None, :]) & chunked(0, 0, pos[:, None], pos[None, :])
    return jax.nn.dot_product_attention(q, k, v, mask=visible[None, None],
                                        implementation="xla")

  _check(ours, reference, (q, k, v), dout, (0, 1, 2))


@pytest.mark.parametrize("d, dv, causal", [(192, 128, True), (128, 64, False), (64, 256, True)])
def test_value_head_dim_of_its_own(d, dv, causal):
  """The sm90 forward kernel with D != Dv, and the backward kernels (V as it
  is at 192 / 128 and 128 / 64, zero-padded at 64 / 256)."""
  b, t, nq, nkv = 2, 1537, 8, 2
  q, k, v, dout = _inputs(b, t, t, nq, nkv, d, dv=dv, seed=5)
  assert fa4_jax.which_implementation(q, k, v, is_causal=causal) == "sm90"

  def ours(q, k, v):
    return fa4_jax.attention(q, k, v, is_causal=causal, implementation="sm90")

  def reference(q, k, v):
    group = nq // nkv
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    logits = jnp.einsum("btnd,bsnd->bnts", q, k) * d ** -0.5
    if causal:
      logits = jnp.where(jnp.tril(jnp.ones((t, t), bool)), logits, -jnp.inf)
    return jnp.einsum("bnts,bsnd->btnd", jax.nn.softmax(logits, axis=-1), v)

  _check(ours, reference, (q, k, v), dout, (0, 1, 2))


# Compiles, with Mosaic GPU's ptxas dump on, the forward and backward of each
# item through the public API (so with the configs the heuristics pick for
# it), and prints the ptxas reports each left.
_COMPILE_MOD_KERNELS = r"""
import os, sys
import jax, jax.numpy as jnp
import fa4_jax

S = 2048
def call(d, causal, dv=None, grad=True, **mods):
  def run():
    q = jnp.ones((1, S, 4, d), jnp.bfloat16)
    v = jnp.ones((1, S, 2, dv or d), jnp.bfloat16)
    f = lambda q: fa4_jax.attention(q, q[:, :, :2], v, is_causal=causal,
                                    implementation="sm90", **mods).astype(jnp.float32).sum()
    return jax.grad(f)(q) if grad else f(q)
  return run

slopes = jnp.linspace(0.01, 0.5, 4)
alibi = lambda s, b, h, qi, ki: s - slopes[h] * (qi - ki).astype(jnp.float32)
prefix_lm = lambda b, h, qi, ki: (ki <= qi) | (ki < 700)
chunked = lambda b, h, qi, ki: qi // 512 == ki // 512
table = jnp.linspace(-1.0, 1.0, 4 * 32).reshape(4, 32)
relative = lambda s, b, h, qi, ki: s + table[h, jnp.clip(ki - qi + 16, 0, 31)]
items = {}
for d in (64, 128):
  items[f"plain causal d={d}"] = call(d, True)
  items[f"alibi causal d={d}"] = call(d, True, score_mod=alibi)
  items[f"plain dense d={d}"] = call(d, False)
  items[f"prefix-lm dense d={d}"] = call(
      d, False, mask_mod=prefix_lm,
      block_mask=fa4_jax.create_block_mask(prefix_lm, None, None, S, S))
  items[f"chunked causal d={d}"] = call(d, True, mask_mod=chunked)
  items[f"relative table dense d={d}"] = call(d, False, score_mod=relative)
items["plain causal d=192"] = call(192, True, grad=False)
items["value head dim causal d=192"] = call(192, True, dv=128, grad=False)

"""


def test_no_mod_kernel_has_its_wgmmas_serialized_by_ptxas(tmp_path):
  """As tests/test_ptxas_on_gpu.py for the heuristics' plain kernels: ptxas
  must not serialize the wgmmas of a kernel with a score_mod, a mask_mod or
  a value head dim of its own (C7507-C7519)."""
  calls = ptxas_dumps.compile_items(_COMPILE_MOD_KERNELS, tmp_path, timeout=540)
  ptxas_dumps.check_no_serialized_wgmmas(calls)
