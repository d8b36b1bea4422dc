"""The sm90 MLA decode kernel (`fa4_jax.kernels.sm90_mla_decode`).

Specification:
* `attention(q, k, None, value_head_dim=Dv)` and `paged_attention(q, pages,
  None, ..., value_head_dim=Dv)` with one latent KV head (MLA's absorbed
  decode, 576 / 512) run the MLA kernel on sm_90 (both say "sm90_mla") and
  the XLA path elsewhere.
* Numerics (interpreter with race detection): out (and lse) equal an f32
  einsum with the caller's scale, per-row key lengths (a token that sees
  one key included), T = 1 without a band and the bottom-right causal band
  among T <= 4 new tokens, contiguous and paged caches (a shuffled page
  table; pages of 16 and 128 against blocks of 64), one chunk or two (the
  log-sum-exp combine), one row tile or two, bfloat16 and float16. Three
  interpreted runs (the interpreter's cost is mostly a price per run), one
  per way of reading the cache: contiguous T = 1; pages smaller than a
  block, T = 4 in two chunks; pages larger, the public paged call T = 3.
* The planner's configurations at serving sizes lower for sm_90a: one
  kernel, within the SMEM limit, with wgmma and TMA.
* The barrier table: every `MlaBarrierTable` accessor is listed in the row
  of the barrier it touches, on its declared side (`barrier_tables`).
"""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import barrier_tables
import fa4_jax
from fa4_jax import testing
from fa4_jax.kernels import sm90_mla_decode as mla
from fa4_jax.scores import MaskSpec, ScoreFunction

D, DV = 576, 512
SCALE = 192 ** -0.5  # MLA's usual scale: never 1 / sqrt(576)


def _inputs(seed, b, t, n, s, dtype=jnp.bfloat16):
  kq, kk = jax.random.split(jax.random.key(seed))
  return (jax.random.normal(kq, (b, t, n, D), dtype),
          jax.random.normal(kk, (b, s, 1, D), dtype))


def _reference(q, k, lengths, causal: bool):
  """f32 out [B, T, Hq, Dv] and lse [B, Hq, T]; rows that see nothing: 0, -inf."""
  b, t, n, _ = q.shape
  s = k.shape[1]
  qf, kf = np.asarray(q, np.float32), np.asarray(k, np.float32)[:, :, 0]
  logits = np.einsum("btnd,bsd->bnts", qf, kf) * SCALE
  limit = np.asarray(lengths)[:, None] - ((t - 1 - np.arange(t))[None, :] if causal else 0)
  visible = np.arange(s)[None, None, :] < limit[:, :, None]  # [B, T, S]
  logits = np.where(visible[:, None], logits, -np.inf)
  m = logits.max(-1, keepdims=True)
  m = np.where(np.isfinite(m), m, 0.0)
  e = np.exp(logits - m)
  total = e.sum(-1, keepdims=True)
  out = np.einsum("bnts,bsd->btnd", e / np.where(total > 0, total, 1.0), kf[..., :DV])
  lse = np.where(total[..., 0] > 0, np.log(np.where(total[..., 0] > 0, total[..., 0], 1.0))
                 + m[..., 0], -np.inf)
  return out, lse


def _check(out, want, lse=None, want_lse=None):
  np.testing.assert_allclose(np.asarray(out, np.float32), want, atol=2e-2, rtol=2e-2)
  if lse is not None:
    np.testing.assert_allclose(np.asarray(lse, np.float32), want_lse, atol=2e-2, rtol=1e-2)


def _paged(k, page_size, seed):
  """k [B, S, 1, D] as a shuffled pool of pages and its table."""
  b, s = k.shape[:2]
  per_row = s // page_size
  order = np.random.default_rng(seed).permutation(b * per_row)
  pool = np.zeros((b * per_row, page_size, 1, D), np.float32)
  pages = np.asarray(k, np.float32).reshape(b * per_row, page_size, 1, D)
  pool[order] = pages
  return jnp.asarray(pool, k.dtype), jnp.asarray(order.reshape(b, per_row), jnp.int32)


def test_attention_with_latent_values_matches_an_f32_einsum_without_races(run_interpreted):
  """The contiguous cache through `fa4_jax.attention`: one token (no band),
  Hq 128 (two row tiles), ragged lengths (1 included)."""
  b, t, n, s = 3, 1, 128, 256
  q, k = _inputs(0, b, t, n, s)
  lengths = jnp.asarray((1, 256, 70), jnp.int32)
  options = dict(value_head_dim=DV, scale=SCALE, key_value_seq_lengths=lengths)
  with fa4_jax.interpret_mode():
    assert fa4_jax.which_implementation(q, k, None, implementation="sm90",
                                        **options) == "sm90_mla"
  out, lse = run_interpreted(lambda q, k, n: fa4_jax.attention(
      q, k, None, implementation="sm90", return_residual=True,
      **dict(options, key_value_seq_lengths=n)), q, k, lengths)
  want, want_lse = _reference(q, k, lengths, causal=False)
  _check(out, want, np.asarray(lse, np.float32).transpose(0, 2, 1), want_lse)


def test_paged_latent_cache_through_a_shuffled_table_matches_an_f32_einsum(run_interpreted):
  """Four tokens causal, pages of 16 (4 per block of 64), two chunks (the
  combine): 5 leaves the first token two keys; 130 puts the tokens at
  126..129, across the chunks' boundary."""
  b, t, n, s, splits = 3, 4, 16, 256, 2
  q, k = _inputs(1, b, t, n, s)
  pool, table = _paged(k, 16, seed=splits)
  lengths = jnp.asarray((5, 130, 256), jnp.int32)
  mask = MaskSpec(right=0, offset_from_lengths=True)
  out, lse = run_interpreted(lambda q, p, tb, n: mla.forward(
      q, p, None, n, value_head_dim=DV, score=ScoreFunction(SCALE), mask=mask, page_table=tb,
      plan=mla.MlaPlan(splits=splits)), q, pool, table, lengths)
  want, want_lse = _reference(q, k, lengths, causal=True)
  _check(out, want, lse, want_lse)


def test_paged_attention_with_latent_pages_runs_the_kernel(run_interpreted):
  """The public entry point: float16, three tokens causal, pages of 128
  (two blocks each), the planner's one chunk."""
  b, t, n, s = 3, 3, 16, 256
  q, k = _inputs(2, b, t, n, s, jnp.float16)
  pool, table = _paged(k, 128, seed=3)
  lengths = jnp.asarray((3, 200, 256), jnp.int32)
  assert mla.choose_plan(q.shape, k.shape, page_size=128).splits == 1
  with fa4_jax.interpret_mode():
    assert fa4_jax.which_paged_implementation(q, pool, None, table, lengths, value_head_dim=DV,
                                              scale=SCALE, implementation="sm90") == "sm90_mla"
  out = run_interpreted(lambda q, p, tb, n: fa4_jax.paged_attention(
      q, p, None, tb, n, value_head_dim=DV, scale=SCALE, implementation="sm90"),
      q, pool, table, lengths)
  _check(out, _reference(q, k, lengths, causal=True)[0])


# Each serving shape in one dtype (the dtype changes no SMEM size or plan).
SERVING = [
    ("memory-bound B32 Hq16 S4k", 32, 1, 16, 4096, None, jnp.bfloat16),
    ("memory-bound B128 Hq16 S32k paged 64", 128, 1, 16, 32768, 64, jnp.float16),
    ("compute-bound B64 Hq128 T2 S8k", 64, 2, 128, 8192, None, jnp.float16),
    ("compute-bound B128 Hq128 S4k paged 64", 128, 1, 128, 4096, 64, jnp.bfloat16),
    ("B64 Hq16 T4 S16k paged 64", 64, 4, 16, 16384, 64, jnp.bfloat16),
]


@pytest.mark.parametrize("name, b, t, n, s, page_size, dtype", SERVING)
def test_the_planners_kernels_lower_for_hopper_within_smem(name, b, t, n, s, page_size, dtype,
                                                           cross_lower):
  q = jax.ShapeDtypeStruct((b, t, n, D), dtype)
  lengths = jax.ShapeDtypeStruct((b,), jnp.int32)
  mask = MaskSpec(right=0, offset_from_lengths=True) if t > 1 else MaskSpec()
  plan = mla.choose_plan(q.shape, (b, s, 1, D), page_size=page_size, num_sms=132)
  assert plan.fits_smem(D) and s % (plan.splits * max(plan.block_kv, page_size or 1)) == 0
  run = lambda q, k, n, **kw: mla.forward(q, k, None, n, value_head_dim=DV,
                                          score=ScoreFunction(SCALE), mask=mask, plan=plan,
                                          **kw)[0]
  if page_size is None:
    lowered = cross_lower(run, q, jax.ShapeDtypeStruct((b, s, 1, D), dtype), lengths)
  else:
    pool = jax.ShapeDtypeStruct((b * s // page_size, page_size, 1, D), dtype)
    table = jax.ShapeDtypeStruct((b, s // page_size), jnp.int32)
    lowered = cross_lower(lambda q, k, tb, n: run(q, k, n, page_table=tb), q, pool, table,
                          lengths)
  assert len(lowered.modules) == 1
  assert lowered.max_smem_bytes <= testing.SMEM_LIMIT_BYTES
  for instruction in ("wgmma.mma_async", "cp.async.bulk.tensor", "mbarrier.try_wait.parity"):
    assert lowered.has(instruction)


def test_splits_make_chunks_of_whole_blocks_and_pages():
  for b, t, n, s, page_size in [(32, 1, 16, 4096, None), (1, 1, 16, 32768, 64),
                                (128, 2, 128, 8192, 256)]:
    plan = mla.choose_plan((b, t, n, D), (b, s, 1, D), page_size=page_size, num_sms=132)
    granule = max(plan.block_kv, page_size or 1)
    assert plan.splits >= 1 and s % (plan.splits * granule) == 0
    assert s // plan.splits >= 512 or plan.splits == 1


def test_sm90_picks_the_mla_kernel_and_other_devices_the_xla_path():
  b, t, n, s = 4, 1, 16, 4096
  q = jnp.zeros((b, t, n, D), jnp.bfloat16)
  k = jnp.zeros((b, s, 1, D), jnp.bfloat16)
  lengths = jnp.full((b,), s, jnp.int32)
  pool = jnp.zeros((b * s // 64, 64, 1, D), jnp.bfloat16)
  table = jnp.arange(b * s // 64, dtype=jnp.int32).reshape(b, s // 64)
  options = dict(value_head_dim=DV, scale=SCALE, key_value_seq_lengths=lengths)
  paged = lambda q: fa4_jax.which_paged_implementation(q, pool, None, table, lengths,
                                                       value_head_dim=DV, scale=SCALE)
  with fa4_jax.gpu_target("sm90"):
    assert fa4_jax.which_implementation(q, k, None, **options) == "sm90_mla"
    assert fa4_jax.which_implementation(q, k, None, **options, part="backward") == "xla"
    assert paged(q) == "sm90_mla"
    # Explicit values (even equal to the keys' prefix) are not read from the keys.
    assert fa4_jax.which_implementation(q, k, k[..., :DV], scale=SCALE) != "sm90_mla"
    # Five tokens, a soft-cap, several latent heads: the XLA path.
    q5 = jnp.zeros((b, 5, n, D), jnp.bfloat16)
    assert fa4_jax.which_implementation(q5, k, None, **options) == "xla"
    assert fa4_jax.which_implementation(q, k, None, **options, logits_soft_cap=30.0) == "xla"
    k2 = jnp.zeros((b, s, 2, D), jnp.bfloat16)
    assert fa4_jax.which_implementation(q, k2, None, **options) == "xla"
    assert paged(q5) == "xla"
  with fa4_jax.gpu_target("sm100"):
    assert fa4_jax.which_implementation(q, k, None, **options) == "xla"
  assert fa4_jax.which_implementation(q, k, None, **options) == "xla"  # this CPU
  assert paged(q) == "xla"


def test_bad_latent_arguments_raise_value_errors():
  q = jnp.zeros((2, 1, 16, D), jnp.bfloat16)
  k = jnp.zeros((2, 256, 1, D), jnp.bfloat16)
  pool = jnp.zeros((8, 64, 1, D), jnp.bfloat16)
  table = jnp.zeros((2, 4), jnp.int32)
  lengths = jnp.full((2,), 256, jnp.int32)
  with pytest.raises(ValueError, match="value_head_dim"):
    fa4_jax.attention(q, k, None, value_head_dim=D + 64)
  with pytest.raises(ValueError, match="value_head_dim"):
    fa4_jax.paged_attention(q, pool, None, table, lengths, value_head_dim=1024)
  with pytest.raises(ValueError, match="page_table"):
    fa4_jax.paged_attention(q, pool, None, jnp.zeros((3, 4), jnp.int32), lengths,
                            value_head_dim=DV)
  with pytest.raises(ValueError, match="key_pages"):
    fa4_jax.paged_attention(q, pool[0], None, table, lengths, value_head_dim=DV)
  with pytest.raises(ValueError, match="head_dim"):
    fa4_jax.paged_attention(q, pool[..., :512], None, table, lengths, value_head_dim=DV)
  # implementation="sm90" names what the MLA kernel cannot take.
  with fa4_jax.interpret_mode(), pytest.raises(ValueError, match="value head dim"):
    fa4_jax.attention(q, k, None, value_head_dim=DV, logits_soft_cap=30.0,
                      implementation="sm90")


def test_barrier_table_lists_every_arrive_and_wait(monkeypatch):
  """Every MlaBarrierTable accessor (the only way the roles touch a barrier)
  appears in the row of the barrier it arrives on or waits on, on its
  declared side, and every barrier has both an arriving and a waiting side;
  the interpreter-only drain is named where it waits."""
  # The table reads the plan's stages and the TMA copies of a block (pages of 16: 4).
  st = types.SimpleNamespace(plan=mla.MlaPlan(), copies_per_block=4)
  barrier_tables.check_table(mla.MlaBarrierTable, lambda refs: mla.MlaBarrierTable(st, refs),
                             mla, monkeypatch, indent=12, named_only=("drain_kv",))


@pytest.mark.parametrize("config", sorted(mla.CONFIGS))
def test_each_config_plans_and_lowers_the_serving_rows(config, cross_lower):
  """Every `CONFIGS` entry: its plan fits and tiles the cache, and the
  kernel lowers for sm_90a at a memory-bound and a causal compute-bound row."""
  for b, t, n, s in ((32, 1, 16, 32768), (64, 2, 128, 4096)):
    q = jax.ShapeDtypeStruct((b, t, n, D), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((b, s, 1, D), jnp.bfloat16)
    lengths = jax.ShapeDtypeStruct((b,), jnp.int32)
    with mla.use_config(config):
      plan = mla.choose_plan(q.shape, k.shape, num_sms=132)
      assert plan.fits_smem(D)
      assert s % (plan.splits * plan.block_kv) == 0
      lowered = cross_lower(lambda q, k, n: fa4_jax.attention(
          q, k, None, value_head_dim=DV, scale=SCALE, key_value_seq_lengths=n,
          is_causal=t > 1, causal_alignment="bottom_right", implementation="sm90"), q, k, lengths)
    assert lowered.has("wgmma.mma_async")


def test_tiles_adjacent_contiguous_matches_an_f32_einsum_without_races(run_interpreted):
  """The default plan (row tiles as CUDA's fastest grid axis) through
  `fa4_jax.attention`: T1 Hq128 (two row tiles), ragged lengths (0 and 1
  included)."""
  b, t, n, s = 4, 1, 128, 256
  q, k = _inputs(4, b, t, n, s)
  lengths = jnp.asarray((1, 256, 70, 0), jnp.int32)

  def call(q, k, n):
    with mla.use_config("default"):
      assert mla.choose_plan(q.shape, k.shape).tiles_adjacent
      return fa4_jax.attention(q, k, None, value_head_dim=DV, scale=SCALE,
                               key_value_seq_lengths=n, implementation="sm90",
                               return_residual=True)

  out, lse = run_interpreted(call, q, k, lengths)
  want, want_lse = _reference(q, k, lengths, causal=False)
  _check(out, want, np.asarray(lse, np.float32).transpose(0, 2, 1), want_lse)


@pytest.mark.parametrize("t, n, page_size", [(2, 64, 16), (4, 32, 128)])
def test_tiles_adjacent_paged_causal_matches_an_f32_einsum_without_races(t, n, page_size,
                                                                         run_interpreted):
  """The same grid order over a shuffled page table, bottom-right causal,
  two row tiles (T x Hq = 128) and two chunks (the combine); pages smaller
  and larger than a block."""
  b, s, splits = 3, 256, 2
  q, k = _inputs(5 + t, b, t, n, s)
  pool, table = _paged(k, page_size, seed=t)
  lengths = jnp.asarray((3, 130, 256), jnp.int32)
  mask = MaskSpec(right=0, offset_from_lengths=True)
  plan = mla.MlaPlan(splits=splits, tiles_adjacent=True)
  out, lse = run_interpreted(lambda q, p, tb, n: mla.forward(
      q, p, None, n, value_head_dim=DV, score=ScoreFunction(SCALE), mask=mask, page_table=tb,
      plan=plan), q, pool, table, lengths)
  want, want_lse = _reference(q, k, lengths, causal=True)
  _check(out, want, lse, want_lse)


def _launch_grid(module: str) -> tuple[int, ...]:
  """(x, y, z) CTAs of the module's one `gpu.launch`."""
  line = module[module.index("gpu.launch"):].split("\n")[0]
  sizes = line.split(" in (")[1].split(")")[0]
  return tuple(int(part.split("%c")[1]) for part in sizes.split(", "))


@pytest.mark.parametrize("config, want", [("items_first", (128, 2, 1)),
                                          ("default", (2, 128, 1))])
def test_tiles_adjacent_puts_the_row_tiles_on_cudas_x_axis(config, want, cross_lower):
  """B128 T1 Hq128 S8k (one chunk, two row tiles): "items_first" launches
  the items along x (tile 1 of an item a wave after tile 0); the default
  (`tiles_adjacent`) launches the two tiles of an item side by side. Same
  SMEM either way."""
  b, t, n, s = 128, 1, 128, 8192
  q = jax.ShapeDtypeStruct((b, t, n, D), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((b, s, 1, D), jnp.bfloat16)
  lengths = jax.ShapeDtypeStruct((b,), jnp.int32)

  def call(q, k, n):
    with mla.use_config(config):
      return fa4_jax.attention(q, k, None, value_head_dim=DV, scale=SCALE,
                               key_value_seq_lengths=n, implementation="sm90")

  with mla.use_config(config):
    assert mla.choose_plan(q.shape, k.shape, num_sms=132).splits == 1
  lowered = cross_lower(call, q, k, lengths)
  assert len(lowered.modules) == 1
  assert _launch_grid(lowered.modules[0]) == want
  assert lowered.max_smem_bytes == 231480


ALTERNATE = mla.MlaPlan(schedule="alternate")


@pytest.mark.parametrize("lengths", [(1, 256, 70, 0), (128, 192, 65, 64)])
def test_alternate_schedule_contiguous_matches_an_f32_einsum_without_races(lengths,
                                                                           run_interpreted):
  """`schedule="alternate"` (both warpgroups compute S, every other block):
  T1 Hq64, per-row lengths giving odd and even block counts (1, 4, 2 and 0
  blocks; 2, 3, 2 and 1), masked last blocks and unmasked pairs."""
  b, t, n, s = 4, 1, 64, 256
  q, k = _inputs(6, b, t, n, s)
  lengths = jnp.asarray(lengths, jnp.int32)
  out, lse = run_interpreted(lambda q, k, n: mla.forward(
      q, k, None, n, value_head_dim=DV, score=ScoreFunction(SCALE), mask=MaskSpec(),
      plan=ALTERNATE), q, k, lengths)
  want, want_lse = _reference(q, k, lengths, causal=False)
  _check(out, want, lse, want_lse)


@pytest.mark.parametrize("t, n, page_size", [(2, 64, 16), (4, 16, 128)])
def test_alternate_schedule_paged_causal_matches_an_f32_einsum_without_races(t, n, page_size,
                                                                            run_interpreted):
  """The alternate schedule with adjacent tiles over a shuffled page table,
  bottom-right causal, two chunks; T2 Hq64 (two row tiles) and T4 Hq16."""
  b, s = 3, 512
  q, k = _inputs(8 + t, b, t, n, s)
  pool, table = _paged(k, page_size, seed=t + 1)
  lengths = jnp.asarray((3, 300, 512), jnp.int32)
  mask = MaskSpec(right=0, offset_from_lengths=True)
  plan = mla.MlaPlan(splits=2, tiles_adjacent=True, schedule="alternate")
  out, lse = run_interpreted(lambda q, p, tb, n: mla.forward(
      q, p, None, n, value_head_dim=DV, score=ScoreFunction(SCALE), mask=mask, page_table=tb,
      plan=plan), q, pool, table, lengths)
  want, want_lse = _reference(q, k, lengths, causal=True)
  _check(out, want, lse, want_lse)


def test_alternate_barrier_table_lists_every_arrive_and_wait(monkeypatch):
  st = types.SimpleNamespace(plan=ALTERNATE, copies_per_block=4)
  barrier_tables.check_table(mla.MlaAlternateBarrierTable,
                             lambda refs: mla.MlaAlternateBarrierTable(st, refs), mla,
                             monkeypatch, indent=12, named_only=("drain_kv", "drain_p"))


def test_alternate_schedule_lowers_within_smem(cross_lower):
  """B128 T1 Hq128 S8k: one kernel with wgmma, 231,512 B of SMEM (the
  default's 231,480, P single, the two warpgroups' m and l beside it)."""
  b, t, n, s = 128, 1, 128, 8192
  q = jax.ShapeDtypeStruct((b, t, n, D), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((b, s, 1, D), jnp.bfloat16)
  lengths = jax.ShapeDtypeStruct((b,), jnp.int32)

  def call(q, k, n):
    with mla.use_config("alternate"):
      return fa4_jax.attention(q, k, None, value_head_dim=DV, scale=SCALE,
                               key_value_seq_lengths=n, implementation="sm90")

  lowered = cross_lower(call, q, k, lengths)
  assert len(lowered.modules) == 1 and lowered.has("wgmma.mma_async")
  assert lowered.max_smem_bytes == 231512 <= testing.SMEM_LIMIT_BYTES
  assert _launch_grid(lowered.modules[0]) == (2, 128, 1)
