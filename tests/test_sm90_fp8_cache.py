"""A bfloat16 or float16 query on a float8 KV cache in the sm90 kernel:
decode (the decode arrangement: packed GQA rows, split-K, ragged lengths),
the forward kernel itself, and float8 pages (decode and chunked prefill).

How the kernel differs from its 16-bit self (`ForwardStatics.fp8_cache`):
K and V arrive in float8 (half the bytes), each consumer widens every block
into float16 SMEM tiles of its own, and both GEMMs run in float16 (the query
converted; float16 holds every float8 value exactly). The k descale scales
the logits, the v descale O.

Reference: an f32 einsum on the dequantized cache and the query as given
(decode, forward), or our XLA path on the same pages (paged). Tolerance:
the cache is exact after widening, so the error is that of 16-bit GEMM
operands and a 16-bit output: P in float16 (2^-11 relative) and the output's
rounding (bfloat16 2^-8 of |out|), well inside 2^-7 max|v| + 2^-7 |out|. A
dropped descale, an unwidened or misread tile, or mixed-up heads are off by
O(max|v|).

`implementation=None` takes the kernel on a Hopper GPU (tests/test_fp8_cache_on_gpu.py
passed on an H100; it read a float8 cache 4-17x faster than the XLA path).
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from fa4_jax import gpu_target, which_implementation, which_paged_implementation
from fa4_jax.kernels import sm90_decode, sm90_forward
from fa4_jax.scores import MaskSpec, ScoreFunction

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}


def float8_cache(rng, shape, dtype=E4M3):
  """(the cache in `dtype`, one scale per head mapping its largest value to
  the type's largest, f32 [heads])."""
  x = rng.normal(size=shape)
  descale = np.abs(x).max(axis=(0, 1, 3)) / FP8_MAX[dtype]
  return jnp.asarray(x / descale[None, None, :, None], dtype), jnp.asarray(descale, jnp.float32)


def dequantized_reference(q, k8, k_descale, v8, v_descale, *, kv_lengths=None,
                          bottom_right_causal=False, sinks=None):
  """f32 attention of the query as given on the dequantized cache; `sinks`
  (natural-log logits [Hq]) add a virtual key of value zero per head."""
  widen = lambda x, d: np.asarray(x, np.float32) * np.asarray(d)[None, None, :, None]
  k, v = widen(k8, k_descale), widen(v8, v_descale)
  group = q.shape[2] // k.shape[2]
  k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
  logits = np.einsum("btnd,bsnd->bnts", np.asarray(q, np.float32), k) * q.shape[-1] ** -0.5
  b, t, s = q.shape[0], q.shape[1], k.shape[1]
  lengths = np.full((b,), s) if kv_lengths is None else np.asarray(kv_lengths)
  keys = np.arange(s)[None, None, None, :]
  visible = keys < lengths[:, None, None, None]
  if bottom_right_causal:
    position = lengths[:, None] - t + np.arange(t)[None, :]  # [B, T]
    visible = visible & (keys <= position[:, None, :, None])
  logits = np.where(visible, logits, -np.inf)
  top = logits.max(-1, keepdims=True)
  sink_term = 0.0
  if sinks is not None:
    sink = np.asarray(sinks, np.float32)[None, :, None, None]
    top = np.maximum(top, sink)
    sink_term = np.exp(sink - top)
  p = np.exp(logits - top)
  return np.einsum("bnts,bsnd->btnd", p / (p.sum(-1, keepdims=True) + sink_term), v), v


def assert_close(got, want, v):
  got = np.asarray(got, np.float32)
  bound = 2.0 ** -7 * np.abs(v).max() + 2.0 ** -7 * np.abs(want)
  excess = np.abs(got - want) - bound
  assert (excess <= 0).all(), f"off by {excess.max():.4g} beyond the bound"


def expected_float8_decode_shape(config):
  """Whether the float8 decode config at D64 / D128, where the packed rows
  fit one tile, is two consumers on halves of each CTA's 128-key blocks
  (`sm90_decode.fp8_cache_split_keys_config`)."""
  return (config.num_consumers, config.block_kv, config.consumers_split_keys) == (2, 128, True)


@pytest.mark.parametrize("b, s, n, kv_heads, d, q_dtype, cache_dtype, splits, short", [
    (2, 256, 8, 2, 64, jnp.bfloat16, E4M3, 2, 1 + 256 // 3),  # GQA 4, ragged, split in two
    (2, 512, 8, 2, 64, jnp.bfloat16, E4M3, 1, 1),  # a row of one key (one block, one half)
    (1, 200, 2, 1, 128, jnp.float16, E5M2, 1, None),  # MQA, odd length, e5m2, float16 query
    (2, 640, 16, 2, 128, jnp.bfloat16, E4M3, 1, 300),  # GQA 8, 5 blocks: halves of 3 and 2
])
@pytest.mark.parametrize("float8_plan", [False, True], ids=["16-bit plan", "float8 plan"])
def test_decode_on_a_float8_cache_matches_the_dequantized_reference(
    run_interpreted, float8_plan, b, s, n, kv_heads, d, q_dtype, cache_dtype, splits, short):
  rng = np.random.default_rng(d)
  q = jnp.asarray(rng.normal(size=(b, 1, n, d)), q_dtype)
  k8, k_descale = float8_cache(rng, (b, s, kv_heads, d), cache_dtype)
  v8, v_descale = float8_cache(rng, (b, s, kv_heads, d), cache_dtype)
  lengths = jnp.asarray([s, short][:b], jnp.int32)
  # The 16-bit call's plan, which the kernel shrinks for the widened tiles
  # (two consumers on their own rows), or the float8 plan's split keys.
  plan = sm90_decode.plan(q.shape, k8.shape, MaskSpec(), ragged=True, fp8_cache=float8_plan)
  assert (plan.config is not None and plan.config.consumers_split_keys) == float8_plan
  plan = sm90_decode.DecodePlan(splits, plan.config)

  def call(q, k, v):
    out, _ = sm90_decode.forward(q, k, v, None, lengths, score=ScoreFunction(d ** -0.5),
                                 mask=MaskSpec(),
                                 plan=plan, descales=(None, k_descale, v_descale))
    return out

  got = run_interpreted(call, q, k8, v8)
  assert got.dtype == q_dtype
  want, v = dequantized_reference(q, k8, k_descale, v8, v_descale, kv_lengths=lengths)
  assert_close(got, want, v)


# The interpreter's decode rows: B2 S512 H8/2 D64, the cache cut in two chunks.
_B, _S, _N, _KV_HEADS, _D = 2, 512, 8, 2, 64


def _decode_matches_the_dequantized_reference(run_interpreted, config, lengths, seed):
  """The decode arrangement under `config` on two chunks of a float8 cache."""
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.normal(size=(_B, 1, _N, _D)), jnp.bfloat16)
  k8, k_descale = float8_cache(rng, (_B, _S, _KV_HEADS, _D))
  v8, v_descale = float8_cache(rng, (_B, _S, _KV_HEADS, _D))
  plan = sm90_decode.DecodePlan(2, config)

  def call(q, k, v):
    out, _ = sm90_decode.forward(q, k, v, None, lengths, score=ScoreFunction(_D ** -0.5),
                                 mask=MaskSpec(), plan=plan,
                                 descales=(None, k_descale, v_descale))
    return out

  got = run_interpreted(call, q, k8, v8)
  want, v = dequantized_reference(q, k8, k_descale, v8, v_descale, kv_lengths=lengths)
  assert_close(got, want, v)


@pytest.mark.parametrize("ragged", [False, True])
def test_the_float8_decode_plan_matches_the_dequantized_reference(run_interpreted, ragged):
  """The plan `sm90_decode.plan(fp8_cache=True)` makes on these small rows
  (two consumers splitting the keys, `fp8_cache_decode_config`); ragged: one
  row shorter than a chunk."""
  plan = sm90_decode.plan((_B, 1, _N, _D), (_B, _S, _KV_HEADS, _D), MaskSpec(), ragged=ragged,
                          num_sms=132, fp8_cache=True)
  config = plan.config
  assert expected_float8_decode_shape(config)
  lengths = jnp.asarray([_S, 200], jnp.int32) if ragged else None
  _decode_matches_the_dequantized_reference(run_interpreted, config, lengths, seed=11)


@pytest.mark.parametrize("t, d, lengths", [
    (1, 128, [384, 1]),  # sinks; a row of one key: consumer 1's half is a reloaded block
    (4, 64, [512, 130]),  # causal bottom-right, 16 packed rows, sinks
])
def test_float8_decode_with_sinks_and_causal_rows_matches_the_reference(run_interpreted, t, d,
                                                                        lengths):
  """The float8 decode arrangement with per-head sinks (split keys: only
  consumer 0's half starts from the sink, the merge counts it once) and,
  for T > 1, causal rows aligned at each row's length (the band of each
  chunk, `MaskSpec(offset_from_lengths=True)`), GQA 4, per-head descales."""
  b, n, kv_heads, s = 2, 8, 2, 512
  rng = np.random.default_rng(t + d)
  q = jnp.asarray(rng.normal(size=(b, t, n, d)), jnp.bfloat16)
  k8, k_descale = float8_cache(rng, (b, s, kv_heads, d))
  v8, v_descale = float8_cache(rng, (b, s, kv_heads, d))
  sinks = jnp.asarray(rng.normal(size=(n,)), jnp.float32)
  lengths = jnp.asarray(lengths, jnp.int32)
  mask = MaskSpec(right=0, offset_from_lengths=True) if t > 1 else MaskSpec()
  plan = sm90_decode.plan(q.shape, k8.shape, mask, ragged=True, fp8_cache=True)
  assert plan.config.consumers_split_keys
  plan = sm90_decode.DecodePlan(2 if t > 1 else 1, plan.config)

  def call(q, k, v):
    return sm90_decode.forward(q, k, v, None, lengths, score=ScoreFunction(d ** -0.5),
                               mask=mask, plan=plan, sinks=sinks,
                               descales=(None, k_descale, v_descale))[0]

  got = run_interpreted(call, q, k8, v8)
  want, v = dequantized_reference(q, k8, k_descale, v8, v_descale, kv_lengths=lengths,
                                  bottom_right_causal=t > 1, sinks=sinks)
  assert_close(got, want, v)


@pytest.mark.parametrize("causal", [False, True])
def test_the_forward_kernel_splits_keys_with_sinks(run_interpreted, causal):
  """The forward kernel itself under a split-keys config (the decode
  arrangement adds its sinks after the combine; here the kernel starts the
  rows from them): 40 query rows of one head a CTA, 300 keys (3 blocks:
  halves of 2 and 1), one row of keys cut to 130, causal bottom-right or
  dense. Only consumer 0's half starts from the sink."""
  rng = np.random.default_rng(21 + causal)
  q = jnp.asarray(rng.normal(size=(2, 40, 4, 64)), jnp.bfloat16)
  k8, k_descale = float8_cache(rng, (2, 300, 2, 64))
  v8, v_descale = float8_cache(rng, (2, 300, 2, 64))
  sinks = jnp.asarray(3.0 * rng.normal(size=(4,)), jnp.float32)
  lengths = jnp.asarray([300, 130], jnp.int32)
  mask = MaskSpec(right=0, offset_from_lengths=True) if causal else MaskSpec()
  config = sm90_decode.fp8_cache_split_keys_config(64, sm90_forward.choose_config(64, mask))
  assert config.consumers_split_keys

  def call(q, k, v):
    q_lengths = jnp.full((2,), 40, jnp.int32)
    return sm90_forward.forward(q, k, v, q_lengths, lengths, score=ScoreFunction(64 ** -0.5),
                                mask=mask, config=config, sinks=sinks,
                                descales=(None, k_descale, v_descale))[0]

  got = run_interpreted(call, q, k8, v8)
  want, v = dequantized_reference(q, k8, k_descale, v8, v_descale, kv_lengths=lengths,
                                  bottom_right_causal=causal, sinks=sinks)
  assert_close(got, want, v)


def test_split_keys_configs_are_checked():
  """`consumers_split_keys` wants two consumers without turns, one CTA per
  item and an even ring (each consumer owns every other slot)."""
  base = sm90_forward.ForwardConfig(block_q=64, block_kv=128, num_kv_stages=2,
                                    num_consumers=2, pingpong=False, consumers_split_keys=True,
                                    producer_registers=24, consumer_registers=240)
  assert base.block_q_cta == 64
  for changes in (dict(num_kv_stages=3), dict(pingpong=True), dict(persistent=True),
                  dict(num_consumers=1)):
    with pytest.raises(ValueError, match="consumers_split_keys"):
      dataclasses.replace(base, **changes)


def test_the_forward_kernel_on_a_float8_cache_with_bottom_right_causal_rows(run_interpreted):
  """Chunked prefill's shape through `fa4_jax.attention`: 40 new tokens
  against a 150-key cache, causal aligned at the end, GQA, an f32 output."""
  rng = np.random.default_rng(7)
  q = jnp.asarray(rng.normal(size=(1, 40, 4, 64)), jnp.bfloat16)
  k8, k_descale = float8_cache(rng, (1, 150, 2, 64))
  v8, v_descale = float8_cache(rng, (1, 150, 2, 64))
  call = lambda q, k, v: fa4_jax.attention(
      q, k, v, is_causal=True, causal_alignment="bottom_right", key_descale=k_descale,
      value_descale=v_descale, output_dtype=jnp.float32, implementation="sm90")
  got = run_interpreted(call, q, k8, v8)
  assert got.dtype == jnp.float32
  want, v = dequantized_reference(q, k8, k_descale, v8, v_descale, bottom_right_causal=True)
  assert_close(got, want, v)


class _ShuffledFloat8Pages:
  """A bf16 query of `t` tokens, 8 heads, against float8 pages of 16 keys,
  2 KV heads, in a pool with 3 spare pages, B = 2 rows of `lengths` keys
  whose `max_pages` pages the table deals out shuffled."""

  def __init__(self, rng, t: int, d: int, max_pages: int, lengths):
    b, n, kv_heads, self.page = 2, 8, 2, 16
    pool = b * max_pages + 3
    self.key_pages, self.k_descale = float8_cache(rng, (pool, self.page, kv_heads, d))
    self.value_pages, self.v_descale = float8_cache(rng, (pool, self.page, kv_heads, d))
    self.table = jnp.asarray(rng.permutation(pool)[:b * max_pages].reshape(b, max_pages),
                             jnp.int32)
    self.lengths = jnp.asarray(lengths, jnp.int32)
    self.q = jnp.asarray(rng.normal(size=(b, t, n, d)), jnp.bfloat16)
    self.contiguous_shape = (b, max_pages * self.page, kv_heads, d)

  @property
  def arguments(self):
    """`paged_attention`'s positional arguments."""
    return self.q, self.key_pages, self.value_pages, self.table, self.lengths

  def check_against_the_xla_path(self, run_interpreted, **options):
    """The sm90 kernels (interpreted) against the XLA path's f32 output."""
    attend = lambda implementation, **kw: lambda q, kp, vp: fa4_jax.paged_attention(
        q, kp, vp, self.table, self.lengths, key_descale=self.k_descale,
        value_descale=self.v_descale, implementation=implementation, **options, **kw)
    got = run_interpreted(attend("sm90"), self.q, self.key_pages, self.value_pages)
    want = attend("xla", output_dtype=jnp.float32)(self.q, self.key_pages, self.value_pages)
    v = np.asarray(self.value_pages, np.float32) * np.asarray(self.v_descale)[None, None, :, None]
    assert_close(got, np.asarray(want), v)


@pytest.mark.parametrize("t", [1, 5])
def test_float8_pages_match_the_xla_path_through_a_shuffled_table(run_interpreted, t):
  """T = 1: the decode arrangement reading pages; T = 5 causal: chunked
  prefill, the forward kernel reading pages (both under the float8 decode
  plan: split keys)."""
  from fa4_jax import backends
  from fa4_jax.validation import validate_paged

  pages = _ShuffledFloat8Pages(np.random.default_rng(t), t, d=64, max_pages=8, lengths=[100, 37])
  with gpu_target("sm90"):
    assert which_paged_implementation(*pages.arguments, key_descale=pages.k_descale,
                                      value_descale=pages.v_descale,
                                      implementation="sm90") == "sm90"
    plan = backends.paged_decode_plan(validate_paged(
        *pages.arguments, scale=None, is_causal=True, sinks=None, logits_soft_cap=None,
        implementation="sm90"))
  if t == 1:  # the decode arrangement takes the float8 plan
    assert plan.config.consumers_split_keys
  pages.check_against_the_xla_path(run_interpreted, is_causal=True)


@pytest.mark.parametrize("d, t, factor", [(64, 1, 1), (64, 4, 2), (128, 1, 2), (128, 4, 1)])
def test_float8_pages_under_the_contiguous_plan_match_the_xla_path(run_interpreted, monkeypatch,
                                                                   d, t, factor):
  """`sm90_decode.FP8_PAGES_SPLITS_FACTOR` (issue #55): float8 pages under
  the contiguous float8 cache's plan (a CTA per item, chunks of whole pages),
  with `factor` times its splits. Small rows made to split as B8 S32k does on
  132 SMs: 8 SMs, chunks of at least 32 keys. Both head dims take two
  consumers on halves of the 128-key blocks (2 splits of 128 keys, a CTA per
  item; four 8-bit slots at D64, two at D128); T = 4 is causal bottom-right."""
  from fa4_jax import backends
  from fa4_jax.validation import validate_paged

  monkeypatch.setattr(sm90_decode, "FP8_PAGES_SPLITS_FACTOR", factor)
  monkeypatch.setattr(sm90_decode, "MIN_CHUNK", 32)
  monkeypatch.setattr(sm90_forward, "sm_count", lambda default=132: 8)
  jax.clear_caches()  # no trace of another plan for the same shapes
  pages = _ShuffledFloat8Pages(np.random.default_rng(d + t), t, d, max_pages=16,
                               lengths=[200, 37])
  causal = t > 1
  with gpu_target("sm90"):
    plan = backends.paged_decode_plan(validate_paged(
        *pages.arguments, scale=None, is_causal=causal, sinks=None, logits_soft_cap=None,
        implementation="sm90"))
    contiguous = sm90_decode.plan(pages.q.shape, pages.contiguous_shape, MaskSpec(),
                                  granule=pages.page, fp8_cache=True)
  assert contiguous.splits == 2 and expected_float8_decode_shape(contiguous.config)
  assert contiguous.config.num_kv_stages == {64: 4, 128: 2}[d]
  if factor == 1:
    assert plan == contiguous
  else:  # beyond the contiguous plan's splits, a CTA per item
    assert plan.splits == contiguous.splits * factor and not plan.config.persistent
  pages.check_against_the_xla_path(run_interpreted, is_causal=causal)


def test_which_float8_cache_calls_the_kernel_takes():
  bf = lambda *shape: jnp.zeros(shape, jnp.bfloat16)
  f8 = lambda *shape: jnp.zeros(shape, E4M3)
  cache = f8(4, 4096, 8, 128)
  sm90 = dict(implementation="sm90")
  with gpu_target("sm90"):
    assert which_implementation(bf(4, 1, 32, 128), cache, cache, **sm90) == "sm90_decode"
    assert which_implementation(bf(1, 1024, 8, 128), f8(1, 1024, 8, 128), f8(1, 1024, 8, 128),
                                is_causal=True, **sm90) == "sm90"
    # By default too: on an H100 it read a float8 cache 4-17x faster than the XLA path.
    assert which_implementation(bf(4, 1, 32, 128), cache, cache) == "sm90_decode"
    ids = jnp.zeros((1, 1024), jnp.int32)
    with pytest.raises(ValueError, match="float8 cache without segment ids"):
      which_implementation(bf(1, 1024, 8, 128), f8(1, 1024, 8, 128), f8(1, 1024, 8, 128),
                           query_segment_ids=ids, key_value_segment_ids=ids,
                           implementation="sm90")


@pytest.mark.parametrize("d", [64, 128, 256])
def test_float8_cache_kernels_cross_lower_to_widening_and_float16_wgmmas(cross_lower, d):
  """Decode (the arrangement, split) and prefill shapes at each head dim:
  the e4m3 -> f16 conversions and f16 wgmmas are there, no 8-bit or bf16
  wgmma, within SMEM."""
  for q_len, s in ((1, 8192), (512, 2048)):
    q_spec = jax.ShapeDtypeStruct((2, q_len, 8, d), jnp.bfloat16)
    kv_spec = jax.ShapeDtypeStruct((2, s, 2, d), E4M3)
    descale = jax.ShapeDtypeStruct((2,), jnp.float32)

    def call(q, k, v, kd, vd):
      with gpu_target("sm90"):
        return fa4_jax.attention(q, k, v, key_descale=kd, value_descale=vd,
                                 implementation="sm90")

    lowered = cross_lower(call, q_spec, kv_spec, kv_spec, descale, descale)
    text = "\n".join(lowered.modules)
    assert "cvt.rn.f16x2.e4m3x2" in text and "f32.f16.f16" in text
    assert "e4m3.e4m3" not in text and "bf16.bf16" not in text
    assert max(lowered.smem_bytes) <= sm90_forward.SMEM_LIMIT_BYTES


def test_a_float8_cache_fits_the_decode_arrangements_persistent_grid(cross_lower):
  """B64 T1 S4096 H32/8 D128: more items than SMs, so the decode arrangement
  hands the kernel a persistent config with two Q tiles per consumer, which
  leaves no SMEM for the widened float16 tiles. The kernel must shrink that
  config as it shrinks its own (an H100 run on 2026-12-06 raised
  KernelUnsupported here)."""
  q_spec = jax.ShapeDtypeStruct((64, 1, 32, 128), jnp.bfloat16)
  kv_spec = jax.ShapeDtypeStruct((64, 4096, 8, 128), E4M3)
  descale = jax.ShapeDtypeStruct((8,), jnp.float32)
  with gpu_target("sm90"):
    plan = sm90_decode.plan(q_spec.shape, kv_spec.shape, MaskSpec())
  assert plan is not None and plan.config is not None and plan.config.q_buffers == 2

  def call(q, k, v, kd, vd):  # the 16-bit plan (a float8 cache now plans its own)
    with gpu_target("sm90"):
      return sm90_decode.forward(q, k, v, None, None, score=ScoreFunction(128 ** -0.5),
                                 mask=MaskSpec(), plan=plan, descales=(None, kd, vd))[0]

  lowered = cross_lower(call, q_spec, kv_spec, kv_spec, descale, descale)
  assert "cvt.rn.f16x2.e4m3x2" in "\n".join(lowered.modules)
  assert max(lowered.smem_bytes) <= sm90_forward.SMEM_LIMIT_BYTES


def test_a_float8_cache_decodes_on_every_sm_with_two_consumers_on_halves_of_the_keys(
    cross_lower):
  """B8 T1 S32768 H32/8 D128 (issue #55): the 16-bit call's plan, shrunk
  for the widened tiles, read 32 KiB of float8 in flight per CTA on the
  H100's 64 streaming CTAs; the float8 plan takes a CTA per SM (2 chunks,
  128 CTAs) with two consumers on the same 4 packed rows, each on half of
  the 128-key blocks, two 8-bit slots (`sm90_decode.fp8_cache_decode_config`),
  and it must lower within SMEM. The 16-bit plan is unchanged."""
  from fa4_jax.kernels import device_tables

  q_spec = jax.ShapeDtypeStruct((8, 1, 32, 128), jnp.bfloat16)
  kv_spec = jax.ShapeDtypeStruct((8, 32768, 8, 128), E4M3)
  descale = jax.ShapeDtypeStruct((8,), jnp.float32)
  h100 = device_tables.DECODE["NVIDIA H100 80GB HBM3"]
  bf16_plan = sm90_decode.plan(q_spec.shape, kv_spec.shape, MaskSpec(), num_sms=132,
                               choices=h100)
  assert bf16_plan == sm90_decode.DecodePlan(1, None)
  plan = sm90_decode.plan(q_spec.shape, kv_spec.shape, MaskSpec(), num_sms=132, choices=h100,
                          fp8_cache=True)
  config = plan.config
  assert plan.splits == 2 and config is not None and not config.persistent
  assert expected_float8_decode_shape(config) and config.num_kv_stages == 2
  assert config.fits_smem(128, 2, False, 128, fp8_cache=True)
  # The kernel takes it as it is (no shrinking).
  assert sm90_forward.fp8_cache_config(config, 128, 128) == config

  def call(q, k, v, kd, vd):
    with gpu_target("sm90"):
      return fa4_jax.attention(q, k, v, key_descale=kd, value_descale=vd)

  lowered = cross_lower(call, q_spec, kv_spec, kv_spec, descale, descale)
  text = "\n".join(lowered.modules)
  assert "cvt.rn.f16x2.e4m3x2" in text and "f32.f16.f16" in text
  assert max(lowered.smem_bytes) <= sm90_forward.SMEM_LIMIT_BYTES
  # 193 KiB of the CTA's SMEM (`sm90_decode.fp8_cache_split_keys_config`).
  assert max(lowered.smem_bytes) >= config.smem_bytes(128, 2, fp8_cache=True)


@pytest.mark.parametrize("shape", [
    (64, 1, 4096, 32, 8, 128),   # more items than SMs: a persistent grid, one Q tile
    (16, 1, 16384, 8, 1, 64),    # MQA D64, short chunks: the forward's persistent grid
    (8, 1, 32768, 32, 8, 64),
    (8, 1, 32768, 32, 8, 128),   # issue #55's row
])
def test_float8_cache_decode_plans_fit_and_lower(cross_lower, shape):
  """Issue #55's decode rows under the float8 plan, split keys (two
  consumers on 240 registers each, one CTA per item on two 128-key slots at
  D128: 193 KiB), within SMEM."""
  b, t, s, n, kv_heads, d = shape
  q_spec = jax.ShapeDtypeStruct((b, t, n, d), jnp.bfloat16)
  kv_spec = jax.ShapeDtypeStruct((b, s, kv_heads, d), E4M3)
  descale = jax.ShapeDtypeStruct((kv_heads,), jnp.float32)
  plan = sm90_decode.plan(q_spec.shape, kv_spec.shape, MaskSpec(), num_sms=132, fp8_cache=True)
  config = plan.config
  assert config is not None and expected_float8_decode_shape(config)
  assert config.fits_smem(d, 2, False, d, fp8_cache=True) and not config.persistent
  assert config.num_kv_stages == {64: 4, 128: 2}[d] and config.consumer_registers == 240

  def call(q, k, v, kd, vd):
    with gpu_target("sm90"):
      return fa4_jax.attention(q, k, v, key_descale=kd, value_descale=vd)

  lowered = cross_lower(call, q_spec, kv_spec, kv_spec, descale, descale)
  text = "\n".join(lowered.modules)
  assert "cvt.rn.f16x2.e4m3x2" in text and "f32.f16.f16" in text
  assert max(lowered.smem_bytes) <= sm90_forward.SMEM_LIMIT_BYTES
  assert max(lowered.smem_bytes) >= config.smem_bytes(d, 2, fp8_cache=True)
  registers = f"setmaxnreg.inc.sync.aligned.u32 {config.consumer_registers};"
  assert registers in text


class _Issue55PagedRow:
  """Issue #55's paged rows: B8 S32768 H32/8 D128 under a bf16 query, pages
  of 64 keys of a float8 (or `validated`'s) cache, full lengths; T = 16 is
  causal (bottom-right)."""

  def __init__(self, t: int):
    self.b, self.s, self.n, self.kv_heads, self.d, self.page = 8, 32768, 32, 8, 128, 64
    self.t, self.causal = t, t > 1

  def _specs(self, pages_dtype):
    b, s, page = self.b, self.s, self.page
    return (jax.ShapeDtypeStruct((b, self.t, self.n, self.d), jnp.bfloat16),
            jax.ShapeDtypeStruct((b * s // page, page, self.kv_heads, self.d), pages_dtype),
            jax.ShapeDtypeStruct((b, s // page), jnp.int32),
            jax.ShapeDtypeStruct((b,), jnp.int32))

  def validated(self, pages_dtype):
    """`validation.validate_paged` of the row (zeros), as `paged_attention` sees it."""
    from fa4_jax.validation import validate_paged
    q, pages, table, _ = self._specs(pages_dtype)
    zeros = lambda spec: jnp.zeros(spec.shape, spec.dtype)
    return validate_paged(zeros(q), zeros(pages), zeros(pages), zeros(table),
                          jnp.full((self.b,), self.s, jnp.int32), scale=None,
                          is_causal=self.causal, sinks=None, logits_soft_cap=None,
                          implementation="sm90")

  def cross_lower(self, cross_lower, **target):
    """The float8 row's `paged_attention` (per-head descales) cross-lowered
    for sm90 under `gpu_target("sm90", **target)`."""
    q, pages, table, lengths = self._specs(E4M3)
    descale = jax.ShapeDtypeStruct((self.kv_heads,), jnp.float32)

    def call(q, kp, vp, table, lengths, kd, vd):
      with gpu_target("sm90", **target):
        return fa4_jax.paged_attention(q, kp, vp, table, lengths, is_causal=self.causal,
                                       key_descale=kd, value_descale=vd,
                                       implementation="sm90")

    return cross_lower(call, q, pages, pages, table, lengths, descale, descale)


@pytest.mark.parametrize("t", [1, 16])
def test_float8_pages_take_the_float8_decode_config(cross_lower, monkeypatch, t):
  """Pages of 64 keys, B8 S32768 H32/8 D128 (issue #55's paged rows; T = 16
  causal bottom-right, 64 packed rows): `backends.paged_decode_plan` keeps
  the paged call's splits and hands the kernel the float8 decode config
  (two consumers on halves of the 128-key blocks, a CTA per item), which
  must lower within SMEM as it is (the H200 read T = 1 at 4.42 TB/s of bf16
  bytes under the one-consumer config that preceded it, against 3.77 under
  the 16-bit config the kernel shrank). bfloat16 pages keep their plan."""
  from fa4_jax.backends import paged_decode_plan

  # The ragged plan, whatever the default (`FP8_PAGES_SPLITS_FACTOR`, issue #55).
  monkeypatch.setattr(sm90_decode, "FP8_PAGES_SPLITS_FACTOR", None)
  row = _Issue55PagedRow(t)
  s, n, kv_heads, d = row.s, row.n, row.kv_heads, row.d

  def plan_of(pages_dtype):
    with gpu_target("sm90"):
      return paged_decode_plan(row.validated(pages_dtype))

  plan, bf16_plan = plan_of(E4M3), plan_of(jnp.bfloat16)
  assert plan.splits == bf16_plan.splits
  assert bf16_plan.config is None or bf16_plan.config.num_consumers == 2
  config = plan.config
  rows = t * n // kv_heads
  assert config == sm90_decode.fp8_cache_decode_config(d, s // plan.splits, rows, None)
  assert expected_float8_decode_shape(config) and not config.persistent
  assert config.fits_smem(d, 2, False, d, fp8_cache=True)
  assert sm90_forward.fp8_cache_config(config, d, d) == config  # taken as it is

  lowered = row.cross_lower(cross_lower)
  text = "\n".join(lowered.modules)
  assert "cvt.rn.f16x2.e4m3x2" in text and "f32.f16.f16" in text
  assert max(lowered.smem_bytes) <= sm90_forward.SMEM_LIMIT_BYTES
  assert max(lowered.smem_bytes) >= config.smem_bytes(d, 2, fp8_cache=True)


@pytest.mark.parametrize("t", [1, 16])
def test_float8_pages_under_the_switches_take_the_contiguous_plan_and_lower(cross_lower,
                                                                          monkeypatch, t):
  """Issue #55's rows (B8 S32768 H32/8 D128, pages of 64; T = 16 causal)
  with `FP8_PAGES_SPLITS_FACTOR = 1` (the default since the H100 run of
  2026-12-07, pinned): pages take the contiguous float8 cache's plan (2
  chunks, a CTA per item on 128 of 132 SMs, two consumers on halves of the
  128-key blocks) with each consumer on 240 registers, and the call lowers
  within SMEM."""
  from fa4_jax.backends import paged_decode_plan

  monkeypatch.setattr(sm90_decode, "FP8_PAGES_SPLITS_FACTOR", 1)
  jax.clear_caches()
  row = _Issue55PagedRow(t)
  b, s, n, kv_heads, d = row.b, row.s, row.n, row.kv_heads, row.d
  with gpu_target("sm90", num_sms=132):
    plan = paged_decode_plan(row.validated(E4M3))
    contiguous = sm90_decode.plan((b, t, n, d), (b, s, kv_heads, d), MaskSpec(), fp8_cache=True)
  assert plan == contiguous and plan.splits == 2
  config = plan.config
  assert expected_float8_decode_shape(config)
  assert not config.persistent and config.consumer_registers == 240

  lowered = row.cross_lower(cross_lower, num_sms=132)
  assert "setmaxnreg.inc.sync.aligned.u32 240;" in "\n".join(lowered.modules)
  assert max(lowered.smem_bytes) <= sm90_forward.SMEM_LIMIT_BYTES
