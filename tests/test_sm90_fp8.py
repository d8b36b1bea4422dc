"""The sm90 forward kernel on float8 operands (e4m3 / e5m2 q, k and v with
their descales), against an f32 einsum on the dequantized values.

How the kernel differs from its 16-bit self (`sm90_forward`, `ForwardStatics.fp8`):
8-bit Q, K and V tiles, V transposed (an 8-bit wgmma reads its B operand
only K-major), P rounded to e4m3 and staged through SMEM, the head's q and
k descales folded into the softmax's scale and its v descale into O.

Tolerance: P = exp2(...) in e4m3 has a relative rounding error up to 2^-4
per element, so an output row sum_i p_i v_i / sum_i p_i can move by up to
2^-4 max|v| (the bound, whatever the signs; random errors stay far below
it); the bfloat16 output adds 2^-8 of |out|. A kernel that read V
untransposed, dropped a descale or mixed up heads is off by O(max|v|).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from fa4_jax import gpu_target, which_implementation
from fa4_jax.kernels import sm90_forward
from fa4_jax.scores import ScoreFunction

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}


def quantized(x, dtype, axis_heads=2):
  """(x in dtype with one scale per head, the per-head descales f32)."""
  other = tuple(a for a in range(x.ndim) if a != axis_heads)
  descale = np.abs(x).max(axis=other) / FP8_MAX[dtype]
  shape = [1] * x.ndim
  shape[axis_heads] = -1
  return jnp.asarray(x / descale.reshape(shape), dtype), jnp.asarray(descale, jnp.float32)


def fp8_inputs(b, t, s, n, kv_heads, d, dtype=E4M3, seed=0):
  rng = np.random.default_rng(seed)
  q8, qd = quantized(rng.normal(size=(b, t, n, d)), dtype)
  k8, kd = quantized(rng.normal(size=(b, s, kv_heads, d)), dtype)
  v8, vd = quantized(rng.normal(size=(b, s, kv_heads, d)), dtype)
  return (q8, k8, v8), dict(query_descale=qd, key_descale=kd, value_descale=vd)


def dequantized_logits(q8, k8, v8, descales, scale=None):
  """(logits, v) of the dequantized operands: f32 logits [B, N, T, S] at
  `scale` (None: 1 / sqrt(D)) and V [B, S, N, D], keys and values repeated
  over each GQA group."""
  f32 = lambda x, d: np.asarray(x, np.float32) * np.asarray(d)[None, None, :, None]
  q = f32(q8, descales["query_descale"])
  k = f32(k8, descales["key_descale"])
  v = f32(v8, descales["value_descale"])
  group = q.shape[2] // k.shape[2]
  k, v = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
  logits = jnp.einsum("btnd,bsnd->bnts", q, k) * (scale or q.shape[-1] ** -0.5)
  return np.asarray(logits), v


def sink_share(logits, sinks):
  """The keys' share of each row's softmax once its head's sink logit
  joins the keys (sum / (sum + e^sink)), [B, T, N, 1]: what a sink scales
  the output by. `logits` [B, N, T, S], masked keys at -inf."""
  top = np.maximum(logits.max(-1), np.asarray(sinks)[None, :, None])
  keys = np.exp(logits - top[..., None]).sum(-1)
  sink = np.exp(np.asarray(sinks)[None, :, None] - top)
  return np.transpose(keys / (keys + sink), (0, 2, 1))[..., None]


def dequantized_reference(q8, k8, v8, descales, *, causal, scale=None, score_mod=None,
                          soft_cap=None):
  """f32 attention of the dequantized operands (bottom... top-left causal)."""
  logits, v = dequantized_logits(q8, k8, v8, descales, scale)
  logits = jnp.asarray(logits)
  t, s = q8.shape[1], k8.shape[1]
  if score_mod is not None:
    qi, ki = jnp.arange(t)[:, None], jnp.arange(s)[None, :]
    heads = jnp.arange(q8.shape[2])[None, :, None, None]
    logits = score_mod(logits, 0, heads, qi, ki)
  if soft_cap is not None:
    logits = soft_cap * jnp.tanh(logits / soft_cap)
  if causal:
    logits = jnp.where(jnp.tril(jnp.ones((t, s), bool)), logits, -jnp.inf)
  return np.asarray(jnp.einsum("bnts,bsnd->btnd", jax.nn.softmax(logits, axis=-1), v)), v


def assert_close_to_p_rounding(got, want, v):
  got = np.asarray(got, np.float32)
  bound = 2.0 ** -4 * np.abs(v).max() + 2.0 ** -8 * np.abs(want)
  excess = np.abs(got - want) - bound
  assert (excess <= 0).all(), f"off by {excess.max():.4g} beyond the bound"


@pytest.mark.parametrize("b, t, s, n, kv_heads, d, causal, dtype", [
    (1, 100, 100, 2, 1, 64, True, E4M3),      # GQA, odd length, causal
    (1, 300, 150, 2, 2, 128, False, E4M3),   # dense: 300 rows (past the decode arrangement)
    (1, 90, 90, 2, 2, 64, True, E5M2),       # e5m2 operands (P stays e4m3)
])
def test_fp8_forward_matches_the_dequantized_reference(run_interpreted, b, t, s, n, kv_heads,
                                                       d, causal, dtype):
  (q8, k8, v8), descales = fp8_inputs(b, t, s, n, kv_heads, d, dtype)
  call = lambda q, k, v: fa4_jax.attention(q, k, v, is_causal=causal, implementation="sm90",
                                           **descales)
  got = run_interpreted(call, q8, k8, v8)
  assert got.dtype == jnp.bfloat16
  want, v = dequantized_reference(q8, k8, v8, descales, causal=causal)
  assert_close_to_p_rounding(got, want, v)


def test_fp8_p_in_registers_takes_v_in_its_key_order(run_interpreted):
  """With `fp8_p_in_registers` P's keys are reordered within 16-key chunks
  and V^T's alike: the output is the same attention (odd key count, GQA,
  causal). The interpreter checks the two orders agree; the register
  layout that makes the reordering free is hardware's (GPU tests)."""
  import dataclasses

  from fa4_jax.scores import MaskSpec

  (q8, k8, v8), descales = fp8_inputs(1, 150, 150, 4, 2, 128, seed=2)
  mask = MaskSpec(right=0)
  config = dataclasses.replace(sm90_forward.choose_config(128, mask, 150, 150),
                               persistent=False, work_queue=False, fp8_p_in_registers=True)
  call = lambda q, k, v: sm90_forward.forward(
      q, k, v, None, None, score=ScoreFunction(128 ** -0.5), mask=mask, config=config,
      descales=tuple(descales[x] for x in ("query_descale", "key_descale", "value_descale")))[0]
  got = run_interpreted(call, q8, k8, v8)
  want, v = dequantized_reference(q8, k8, v8, descales, causal=True)
  assert_close_to_p_rounding(got, want, v)


def test_fp8_with_soft_cap_score_mod_and_f32_output(run_interpreted):
  """The descales scale the logits before a score_mod and soft-cap (the
  kernel folds them into the tanh's argument and the score_mod's input)."""
  (q8, k8, v8), descales = fp8_inputs(1, 80, 80, 2, 1, 64, seed=1)
  slopes = jnp.asarray([0.25, 0.5], jnp.float32)
  alibi = lambda sc, b, h, qi, ki: sc - slopes[h] * (qi - ki).astype(jnp.float32)
  call = lambda q, k, v: fa4_jax.attention(
      q, k, v, is_causal=True, implementation="sm90", score_mod=alibi, logits_soft_cap=5.0,
      output_dtype=jnp.float32, **descales)
  got = run_interpreted(call, q8, k8, v8)
  assert got.dtype == jnp.float32
  want, v = dequantized_reference(q8, k8, v8, descales, causal=True, soft_cap=5.0,
                                  score_mod=lambda sc, b, h, qi, ki: sc - slopes[h] * (qi - ki))
  assert_close_to_p_rounding(got, want, v)


def test_a_negative_descale_gives_nan_not_a_silent_answer(run_interpreted):
  """The kernel folds the q*k descale into the softmax's scale, whose sign
  it must know: descales are quantization scales (>= 0), and a head with a
  negative one gets NaN rather than a wrong softmax."""
  (q8, k8, v8), descales = fp8_inputs(1, 64, 64, 2, 2, 64, seed=2)
  descales["query_descale"] = descales["query_descale"].at[1].multiply(-1.0)
  call = lambda q, k, v: fa4_jax.attention(q, k, v, is_causal=True, implementation="sm90",
                                           **descales)
  got = np.asarray(run_interpreted(call, q8, k8, v8), np.float32)
  assert np.isnan(got[:, :, 1]).all() and np.isfinite(got[:, :, 0]).all()


def test_which_calls_the_fp8_kernel_takes():
  """All-float8 calls of training and prefill shapes; the XLA path for
  all-float8 decode-like short queries (a 16-bit query on a float8 cache:
  tests/test_sm90_fp8_cache.py)."""
  f8 = lambda *shape: jnp.zeros(shape, E4M3)
  with gpu_target("sm90"):
    assert which_implementation(f8(1, 1024, 8, 128), f8(1, 1024, 8, 128), f8(1, 1024, 8, 128),
                                is_causal=True) == "sm90"
    assert which_implementation(f8(4, 1, 32, 128), f8(4, 4096, 8, 128),
                                f8(4, 4096, 8, 128)) == "xla"
    with pytest.raises(ValueError, match="float8 decode"):
      fa4_jax.attention(jnp.zeros((4, 1, 32, 128), E4M3), jnp.zeros((4, 256, 8, 128), E4M3),
                        jnp.zeros((4, 256, 8, 128), E4M3), implementation="sm90")


@pytest.mark.parametrize("d", [64, 128, 256])
def test_heuristic_fp8_configs_cross_lower_to_fp8_wgmma(cross_lower, d):
  """The heuristics' configs at each head dim lower for sm_90a with e4m3
  wgmmas for both GEMMs (no 16-bit one left) within SMEM."""
  spec = jax.ShapeDtypeStruct((2, 4096, 8, d), E4M3)

  def call(q, k, v):
    with gpu_target("sm90"):
      return fa4_jax.attention(q, k, v, is_causal=True, implementation="sm90")

  lowered = cross_lower(call, spec, spec, spec)
  text = "\n".join(lowered.modules)
  assert "e4m3.e4m3" in text
  assert ".bf16.bf16" not in text
  assert max(lowered.smem_bytes) <= sm90_forward.SMEM_LIMIT_BYTES


def test_fp8_p_can_be_the_pv_operand_in_registers_where_the_sums_follow_the_hand_off(
    cross_lower):
  """`fp8_p_in_registers` at D = 128 (row sums after the hand-off): the P V
  wgmma reads the e4m3 P from registers (V^T's keys in the operand's
  order), no SMEM round trip; at D = 256 (sums before, an optimization
  barrier no 8-bit array passes) P is staged in SMEM all the same."""
  import dataclasses
  import re

  from fa4_jax.kernels import sm90_forward
  from fa4_jax.scores import MaskSpec

  def pv_operands(d):
    q_spec = jax.ShapeDtypeStruct((1, 1024, 4, d), E4M3)
    kv_spec = jax.ShapeDtypeStruct((1, 1024, 2, d), E4M3)
    config = dataclasses.replace(sm90_forward.choose_config(d, MaskSpec(), 1024, 1024),
                                 fp8_p_in_registers=True)

    def call(q, k, v):
      with gpu_target("sm90"):
        return sm90_forward.forward(q, k, v, None, None, score=ScoreFunction(d ** -0.5),
                                    mask=MaskSpec(),
                                    config=config)[0]

    text = "\n".join(cross_lower(call, q_spec, kv_spec, kv_spec).modules)
    # After the accumulator's registers: "{" for A in registers, "$" for a descriptor.
    return {m.group(1) for m in re.finditer(r"e4m3\.e4m3 \{[$\d,]+\}, (\S)", text)}

  assert pv_operands(128) == {"{", "$"}  # P V from registers, Q K^T from SMEM
  assert pv_operands(256) == {"$"}


@pytest.mark.parametrize("t, s, d", [(300, 150, 128), (2053, 3001, 64)])
def test_fp8_at_key_counts_off_the_tile_lowers(cross_lower, t, s, d):
  """Key counts that are no multiple of the V^T tile's 128-key swizzle lower
  (the TMA of a transposed V needs its key axis in whole tiles; the
  interpreter cannot see this, an H200 run found it)."""
  q_spec = jax.ShapeDtypeStruct((1, t, 4, d), E4M3)
  kv_spec = jax.ShapeDtypeStruct((1, s, 2, d), E4M3)

  def call(q, k, v):
    with gpu_target("sm90"):
      return fa4_jax.attention(q, k, v, implementation="sm90")

  lowered = cross_lower(call, q_spec, kv_spec, kv_spec)
  assert "e4m3.e4m3" in "\n".join(lowered.modules)


def test_fp8_under_vmap_with_descales_of_each_call(run_interpreted):
  """vmap over calls that each bring their own query descales (the kernel's
  descale operand is built per call)."""
  (q8, k8, v8), descales = fp8_inputs(2, 64, 64, 2, 1, 64, seed=3)
  query_descales = jnp.stack([descales["query_descale"], 2 * descales["query_descale"]])
  one = lambda q, k, v, qd: fa4_jax.attention(
      q[None], k[None], v[None], is_causal=True, implementation="sm90", query_descale=qd,
      key_descale=descales["key_descale"], value_descale=descales["value_descale"])[0]
  got = run_interpreted(jax.vmap(one), q8, k8, v8, query_descales)
  for i in range(2):
    want, v = dequantized_reference(q8[i:i + 1], k8[i:i + 1], v8[i:i + 1],
                                    dict(descales, query_descale=query_descales[i]), causal=True)
    assert_close_to_p_rounding(got[i:i + 1], want, v)


@pytest.mark.parametrize("causal", [False, True])
def test_fp8_three_consumers_without_turns_at_d128(run_interpreted, causal):
  """`bench_fp8.py --overlap`'s candidate "fp8 serial kv128 3 consumers"
  (issue #55: three softmaxes beside the GEMMs, as bf16 D64 does): 192-row
  CTAs, P in registers, the row sums on the tensor core; 300 rows leave the
  second CTA's third consumer with no row and its second with a part."""
  import dataclasses

  from fa4_jax.kernels import sm90_forward
  from fa4_jax.scores import MaskSpec

  (q8, k8, v8), descales = fp8_inputs(1, 300, 300, 2, 1, 128, seed=31)
  mask = MaskSpec(right=0) if causal else MaskSpec()
  config = sm90_forward.fp8_config(sm90_forward.choose_config(128, mask, 300, 300), mask,
                                   128, 128, False)
  config = dataclasses.replace(config, num_consumers=3, pingpong=False, block_kv=128,
                               num_kv_stages=2, producer_registers=24, consumer_registers=160)
  assert config.row_sums_on_tensor_core

  def call(q, k, v):
    return sm90_forward.forward(
        q, k, v, None, None, score=ScoreFunction(128 ** -0.5), mask=mask, config=config,
        descales=tuple(descales[x] for x in ("query_descale", "key_descale", "value_descale")))[0]

  got = run_interpreted(call, q8, k8, v8)
  want, v = dequantized_reference(q8, k8, v8, descales, causal=causal)
  assert_close_to_p_rounding(got, want, v)


def test_the_heuristic_runs_three_consumers_on_dense_and_causal_d128_calls_only():
  """`fp8_config` (H100-measured, `sm90_forward.FP8_THREE_CONSUMERS`): dense
  and causal D128 calls at long lengths run three consumers without turns on
  128-key blocks, two stages, serial; windows, segment ids, mods and other
  head dims keep two consumers and their turns (not timed with three)."""
  from fa4_jax.kernels import sm90_forward
  from fa4_jax.scores import MaskSpec

  def config(d, mask, segment_ids=False, mods=False, with_base=False):
    base = sm90_forward.choose_config(d, mask, 8192, 8192, segment_ids=segment_ids)
    chosen = sm90_forward.fp8_config(base, mask, d, d, segment_ids, mods)
    return (chosen, base) if with_base else chosen

  dense, causal = config(128, MaskSpec()), config(128, MaskSpec(right=0))
  bottom_right = config(128, MaskSpec(right=0, offset_from_lengths=True))
  for c in (dense, causal, bottom_right):
    assert (c.num_consumers, c.pingpong, c.block_kv, c.num_kv_stages) == (3, False, 128, 2)
    assert c.consumer_registers == 160
  two = [dict(d=128, mask=MaskSpec(left=256, right=0)),
         dict(d=128, mask=MaskSpec(), segment_ids=True),
         dict(d=128, mask=MaskSpec(), mods=True), dict(d=128, mask=MaskSpec(right=0), mods=True),
         dict(d=64, mask=MaskSpec()), dict(d=256, mask=MaskSpec(right=0))]
  for case in two:
    chosen, base = config(**case, with_base=True)
    assert chosen.num_consumers == base.num_consumers and chosen.pingpong == base.pingpong, case


def growing_inputs(b, t, s, n, kv_heads, d, seed):
  """`fp8_inputs`' operands, but with logits that grow along the keys by
  about 50 log2 units over the key length (q and k share a direction):
  the running max moves by more than the rescale threshold in most blocks,
  so a block whose O missed its alpha is off by orders of magnitude."""
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(b, t, n, d))
  k = rng.normal(size=(b, s, kv_heads, d))
  q[..., 0] += 10.0
  k[..., 0] += 40.0 * np.arange(s)[None, :, None] / s
  (q8, qd), (k8, kd) = quantized(q, E4M3), quantized(k, E4M3)
  v8, vd = quantized(rng.normal(size=(b, s, kv_heads, d)), E4M3)
  return (q8, k8, v8), dict(query_descale=qd, key_descale=kd, value_descale=vd)


def test_three_consumers_with_soft_cap_bottom_right_causal_and_key_lengths(run_interpreted):
  """The heuristic's causal D128 config at long lengths (three consumers
  without turns, `FP8_THREE_CONSUMERS`) on what it also serves there: a
  soft-cap (its tanh in the softmax), queries aligned bottom-right, and
  per-row key lengths (a row of 190 keys, one of 77: masked edge blocks,
  and consumers whose rows see no key)."""
  from fa4_jax.scores import MaskSpec

  d, t, s, cap = 128, 130, 190, 20.0
  lengths = np.asarray([190, 77], np.int32)
  mask = MaskSpec(right=0, offset_from_lengths=True)
  (q8, k8, v8), descales = growing_inputs(2, t, s, 2, 1, d, seed=14)
  config = sm90_forward.fp8_config(sm90_forward.choose_config(d, mask, 8192, 8192), mask, d, d,
                                   False)
  assert (config.num_consumers, config.pingpong, config.persistent) == (3, False, False)

  def call(q, k, v):
    # bottom-right with lengths: each row's offset is kv_len - q_len, so the
    # query lengths are given too (`validation._align` fills them with t)
    return sm90_forward.forward(q, k, v, jnp.full((2,), t, jnp.int32), jnp.asarray(lengths),
                                score=ScoreFunction(d ** -0.5, cap), mask=mask, config=config,
                                descales=tuple(descales[x] for x in (
                                    "query_descale", "key_descale", "value_descale")))[0]

  got = np.asarray(run_interpreted(call, q8, k8, v8), np.float32)
  logits, v = dequantized_logits(q8, k8, v8, descales)
  logits = cap * np.tanh(logits / cap)
  i, j = np.arange(t)[None, :, None], np.arange(s)[None, None, :]
  position = lengths[:, None, None] - t + i  # each query's place among its row's keys
  visible = (j <= position) & (j < lengths[:, None, None])  # [B, t, s]
  logits = np.where(visible[:, None], logits, -np.inf)
  top = logits.max(-1, keepdims=True)
  w = np.exp(logits - np.where(np.isfinite(top), top, 0.0))
  total = w.sum(-1, keepdims=True)
  want = np.einsum("bnts,bsnd->btnd", w / np.where(total > 0, total, 1.0), v)
  assert_close_to_p_rounding(got, want, v)
  sees_nothing = ~visible.any(-1)  # row 1's first 53 queries
  assert sees_nothing[1, :53].all() and not sees_nothing[0].any()
  assert (got[1, :53] == 0).all()
