"""Choices per device kind (`fa4_jax.kernels.device_tables`), as the decode
arrangement reads them (`fa4_jax.kernels.sm90_decode.device_choices`).

Specification:
* `sm90_decode.plan` consults the table of the default device's kind: an H100
  streams a D128 cache with 64 CTAs, an H200 with 128, a kind the table
  does not name with every SM; on an H200 a D64 call of up to 8 packed rows
  and full, equal key lengths runs one CTA per item with one consumer
  warpgroup and 4 K/V slots, where other kinds, ragged lengths and more rows
  keep the kernel's three consumers.
* Under `fa4_jax.gpu_target` the generic choices apply and lowering queries
  no device (an export made on a CPU host runs the same rules everywhere).
* Numerics (interpreter with race detection): the one-consumer config of the
  H200 table computes the same attention as an f32 einsum, over chunks.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from fa4_jax.kernels import device_tables, sm90_decode
from fa4_jax.scores import MaskSpec, ScoreFunction
from reference import einsum_attention

H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"


@pytest.fixture
def device_kind(monkeypatch):
  """set(kind): the default device decode sees is a GPU of that kind."""
  class Device:
    platform, device_kind = "gpu", H100

  monkeypatch.setattr(sm90_decode, "default_device", lambda: Device)

  def set_kind(kind):
    Device.device_kind = kind
  return set_kind


def _plan(b, t, s, n, kv_heads, d, **options):
  return sm90_decode.plan((b, t, n, d), (b, s, kv_heads, d), MaskSpec(), num_sms=132, **options)


@pytest.mark.parametrize("kind, grid", [(H100, 64), (H200, 128), ("NVIDIA H20", 132)])
def test_the_d128_grid_streams_with_the_device_kinds_ctas(device_kind, kind, grid):
  device_kind(kind)
  plan = _plan(64, 1, 4096, 32, 8, 128)  # 512 items
  assert plan.splits == 1 and plan.config.persistent and plan.config.num_sms == grid
  b1 = _plan(1, 1, 131072, 32, 8, 128)  # 8 KV heads: chunks fill the streams
  assert b1.splits == {64: 8, 128: 16, 132: 16}[grid] and b1.config is None


@pytest.mark.parametrize("kind", [H200, H100])
@pytest.mark.parametrize("name, shape, splits", [
    ("MQA B16 S16k", (16, 1, 16384, 8, 1), 8),
    ("GQA 8/2 B64 S1024", (64, 1, 1024, 8, 2), 1),
    ("GQA 32/8 B8 S32k", (8, 1, 32768, 32, 8), 2),
])
def test_an_h100_or_h200_runs_d64_decode_on_one_consumer_with_four_slots(
    device_kind, kind, name, shape, splits):
  b, t, s, n, kv_heads = shape
  device_kind(kind)
  plan = _plan(b, t, s, n, kv_heads, 64)
  assert plan.splits == splits
  config = plan.config
  assert (config.num_consumers, config.num_kv_stages, config.persistent) == (1, 4, False)
  assert not config.pingpong and config.block_q == 64
  device_kind("NVIDIA H20")  # not measured there: the kernel's own choice
  assert _plan(b, t, s, n, kv_heads, 64).config is None or (
      _plan(b, t, s, n, kv_heads, 64).config.num_consumers == 3)


def test_one_consumer_is_kept_to_what_was_measured(device_kind):
  device_kind(H200)
  assert _plan(16, 1, 16384, 8, 1, 64, ragged=True).config is None  # per-row lengths
  assert _plan(16, 4, 16384, 8, 1, 64).config is None  # 4 tokens: 32 rows
  assert _plan(8, 1, 32768, 32, 8, 128).config is None  # D128: two consumers
  assert _plan(256, 1, 1024, 8, 2, 64).config is None  # 512 items: the heuristic's grid


def test_the_table_is_read_by_kind_and_unknown_kinds_get_the_generic_rules():
  assert device_tables.decode_choices(H200).streaming_ctas == 128
  assert device_tables.decode_choices(H100).streaming_ctas == 64
  assert device_tables.decode_choices(H100).one_consumer_max_rows == 8
  for kind in (None, "", "cpu", "NVIDIA GH200 480GB"):
    assert device_tables.decode_choices(kind) is device_tables.GENERIC_DECODE


def test_gpu_target_lowering_queries_no_device(monkeypatch):
  """Under a target the plan is the generic one and no device is asked for
  its kind, also while the whole call is lowered for CUDA."""
  def no_device():
    raise AssertionError("the default device was queried under gpu_target")

  monkeypatch.setattr(sm90_decode, "default_device", no_device)
  kinds = []
  table = device_tables.decode_choices
  monkeypatch.setattr(device_tables, "decode_choices", lambda kind: kinds.append(kind) or
                      table(kind))
  spec = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.bfloat16)
  with fa4_jax.gpu_target("sm90"):
    plan = sm90_decode.plan((64, 1, 32, 128), (64, 4096, 8, 128), MaskSpec())
    assert plan.config.num_sms == 132  # every SM: no kind named
    assert sm90_decode.plan((16, 1, 8, 64), (16, 16384, 1, 64), MaskSpec()).config is None
    for q, kv in [((16, 1, 8, 64), (16, 16384, 1, 64)), ((64, 1, 32, 128), (64, 4096, 8, 128))]:
      lowered = jax.jit(fa4_jax.attention).trace(spec(*q), spec(*kv), spec(*kv)).lower(
          lowering_platforms=("cuda",))
      assert "mosaic_gpu" in lowered.as_text()
  assert kinds and set(kinds) == {None}


@pytest.mark.parametrize("shape, splits", [((2, 1, 1024, 8, 2), 2), ((2, 1, 1024, 8, 1), 1)],
                         ids=["GQA 8/2, two chunks", "MQA 8/1"])
def test_the_one_consumer_config_matches_an_f32_einsum(run_interpreted, shape, splits):
  b, t, s, n, kv_heads = shape
  d = 64
  keys = jax.random.split(jax.random.key(3), 3)
  q = jax.random.normal(keys[0], (b, t, n, d), jnp.bfloat16)
  k = jax.random.normal(keys[1], (b, s, kv_heads, d), jnp.bfloat16)
  v = jax.random.normal(keys[2], (b, s, kv_heads, d), jnp.bfloat16) + 1.0
  config = sm90_decode.one_consumer_config(d, MaskSpec(), s // splits, n // kv_heads,
                                           b * kv_heads * splits, num_sms=132,
                                           choices=device_tables.DECODE[H200])
  assert config is not None and config.num_consumers == 1
  plan = sm90_decode.DecodePlan(splits, config)
  out, lse = run_interpreted(lambda q, k, v: sm90_decode.forward(
      q, k, v, None, None, score=ScoreFunction(d ** -0.5), mask=MaskSpec(), plan=plan), q, k, v)
  visible = np.ones((1, 1, 1, s), bool)
  want, want_lse = einsum_attention(q, k, v, visible)
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want), atol=2e-2, rtol=2e-2)
  np.testing.assert_allclose(np.asarray(lse), np.asarray(want_lse), atol=2e-2, rtol=1e-2)
