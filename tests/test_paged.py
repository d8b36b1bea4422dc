"""Attention against a paged KV cache (`fa4_jax.paged_attention`).

Specification:
* Layout: pages [num_pages, page_size, Hkv, D] (vLLM / FlashInfer), a page
  table [B, max_pages] naming row b's physical pages in order, and key
  lengths [B]; table entries past a row's pages are ignored (any value).
* Semantics: the T queries are the last T tokens of their row: query t of
  row b sits at position len_b - T + t and, with is_causal (the default),
  sees keys j <= that position (every valid key for T = 1); a query at a
  negative position sees nothing and gets zeros. is_causal=False: every
  query sees all len_b keys.
* The XLA path equals an einsum reference on the pages gathered by numpy,
  with shuffled physical pages, lengths that are not multiples of the page
  size, an empty row, T = 1 and T = 3, GQA, sinks and soft-cap.
* The sm90 kernel (interpreter, race detection) reads the pages through the
  table and equals the same reference: pages smaller than a key block, pages
  holding several blocks, several chunks of the decode arrangement, and
  chunked prefill (T > 1, causal, each row's band aligned by its length: the
  decode arrangement up to 256 packed rows, `tests/test_decode_causal.py`;
  beyond, the forward kernel).
* The paged kernel lowers for Hopper at D64 and D128 with page sizes 16 and
  64 in the SMEM of the unpaged kernel, one TMA per page of a block.
* Selection: on a Hopper GPU None runs "sm90" when it can serve (T = 1,
  not causal, and causal T > 1); other page sizes or head dims run on XLA, and
  implementation="sm90" then raises saying why. Without a Hopper GPU None
  runs XLA, and "sm90" runs only inside `interpret_mode()`. Gradients are
  the XLA path's.
* Bad input: a ValueError naming the argument.
"""

import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from fa4_jax.kernels import sm90_decode
from fa4_jax.scores import ScoreFunction
from reference import einsum_attention


def _paged_cache(seed, *, batch, t, q_heads, kv_heads, head_dim, page_size, max_pages,
                 lengths, dtype=jnp.float32):
  """(q, key_pages, value_pages, page_table, lengths): each row's pages at
  shuffled physical places (more pages than rows use), table entries past a
  row's pages holding random pages in range."""
  rng = np.random.default_rng(seed)
  num_pages = batch * max_pages + 3
  draw = lambda shape, shift=0.0: jnp.asarray(shift + rng.normal(size=shape), dtype)
  q = draw((batch, t, q_heads, head_dim))
  key_pages = draw((num_pages, page_size, kv_heads, head_dim))
  value_pages = draw((num_pages, page_size, kv_heads, head_dim), 1.0)
  table = rng.permutation(num_pages)[:batch * max_pages].reshape(batch, max_pages)
  for b, n in enumerate(lengths):
    used = -(-n // page_size)
    table[b, used:] = rng.integers(0, num_pages, size=max_pages - used)
  return (q, key_pages, value_pages, jnp.asarray(table, jnp.int32),
          jnp.asarray(lengths, jnp.int32))


def _reference(q, key_pages, value_pages, table, lengths, *, is_causal=True, **options):
  """einsum attention over the pages gathered by numpy, with the explicit
  bottom-right mask."""
  table, lengths = np.asarray(table), np.asarray(lengths)
  b, max_pages = table.shape
  _, page_size, kv_heads, d = key_pages.shape
  gather = lambda pages: jnp.asarray(
      np.asarray(pages, np.float32)[table].reshape(b, max_pages * page_size, kv_heads, d))
  t, s = q.shape[1], max_pages * page_size
  j = np.arange(s)[None, None, :]
  visible = j < lengths[:, None, None]
  if is_causal:
    visible = visible & (j <= (lengths[:, None] - t + np.arange(t)[None, :])[:, :, None])
  return einsum_attention(q, gather(key_pages), gather(value_pages), visible[:, None],
                          **options)[0]


def _assert_close(out, want, tol):
  out = np.asarray(out, np.float32)
  assert np.all(np.isfinite(out))
  np.testing.assert_allclose(out, np.asarray(want), atol=tol, rtol=tol)


# --- the XLA path --------------------------------------------------------------

XLA_CASES = {
    "page 16, T1, GQA 8/2, an empty row, sinks": (
        dict(batch=3, t=1, q_heads=8, kv_heads=2, head_dim=32, page_size=16, max_pages=6,
             lengths=(90, 0, 17)), dict(sinks=True)),
    "page 128, T3 causal, GQA 4/1, a row shorter than T, soft-cap": (
        dict(batch=3, t=3, q_heads=4, kv_heads=1, head_dim=16, page_size=128, max_pages=3,
             lengths=(300, 2, 129)), dict(logits_soft_cap=5.0)),
    "page 16, T3 not causal": (
        dict(batch=2, t=3, q_heads=2, kv_heads=2, head_dim=16, page_size=16, max_pages=4,
             lengths=(33, 64)), dict(is_causal=False)),
    "page 24 (not a power of two), T1, MQA, scale": (
        dict(batch=2, t=1, q_heads=4, kv_heads=1, head_dim=16, page_size=24, max_pages=3,
             lengths=(50, 72)), dict(scale=0.3)),
}


@pytest.mark.parametrize("name", XLA_CASES)
def test_xla_path_equals_attention_over_the_gathered_pages(name):
  shape, options = XLA_CASES[name]
  q, kp, vp, table, lengths = _paged_cache(0, **shape)
  options = dict(options)
  if options.pop("sinks", False):
    options["sinks"] = jnp.linspace(-1.0, 2.0, shape["q_heads"], dtype=jnp.float32)
  out = jax.jit(lambda *a: fa4_jax.paged_attention(*a, implementation="xla", **options))(
      q, kp, vp, table, lengths)
  reference_options = {{"logits_soft_cap": "soft_cap"}.get(k, k): v for k, v in options.items()}
  _assert_close(out, _reference(q, kp, vp, table, lengths, **reference_options), 1e-5)


def test_queries_at_negative_positions_and_empty_rows_get_zeros():
  q, kp, vp, table, lengths = _paged_cache(1, batch=2, t=3, q_heads=2, kv_heads=1,
                                           head_dim=16, page_size=16, max_pages=2,
                                           lengths=(1, 0))
  out = np.asarray(fa4_jax.paged_attention(q, kp, vp, table, lengths))
  assert np.all(out[0, :2] == 0) and np.any(out[0, 2] != 0)  # positions -2, -1; then 0
  assert np.all(out[1] == 0)


# --- the sm90 kernel under the interpreter -------------------------------------

KERNEL_CASES = {
    # D64 reads 128-key blocks: 8 pages of 16 per block; 68 pages make 2
    # chunks of 34 (the last block of a chunk reads 6 padded table entries);
    # the row of 700 keys ends inside a page of its second chunk.
    "page 16 < block 128, 2 chunks, GQA 8/2, T1": (
        dict(batch=1, t=1, q_heads=8, kv_heads=2, head_dim=64, page_size=16, max_pages=68,
             lengths=(700,)), dict(), 2),
    # 128-key blocks inside 256-key pages: a block starts mid-page.
    "page 256 > block 128, 2 chunks, T3 not causal, sinks, soft-cap": (
        dict(batch=1, t=3, q_heads=4, kv_heads=2, head_dim=64, page_size=256, max_pages=4,
             lengths=(600,)), dict(is_causal=False, sinks=True, logits_soft_cap=20.0), 2),
    "page 128 = block, 1 chunk, MQA, an empty row": (
        dict(batch=2, t=1, q_heads=4, kv_heads=1, head_dim=64, page_size=128, max_pages=2,
             lengths=(130, 0)), dict(), 1),
}


@pytest.mark.parametrize("name", KERNEL_CASES)
def test_kernel_reads_the_pages_through_the_table_without_races(name, run_interpreted):
  shape, options, chunks = KERNEL_CASES[name]
  q, kp, vp, table, lengths = _paged_cache(2, dtype=jnp.bfloat16, **shape)
  options = dict(options)
  if options.pop("sinks", False):
    options["sinks"] = jnp.linspace(-1.0, 2.0, shape["q_heads"], dtype=jnp.float32)
  b, s = shape["batch"], shape["max_pages"] * shape["page_size"]
  plan = sm90_decode.plan(q.shape, (b, s, shape["kv_heads"], 64), fa4_jax.MaskSpec(), ragged=True,
                          granule=shape["page_size"])
  assert plan.splits == chunks
  out = run_interpreted(lambda *a: fa4_jax.paged_attention(*a, implementation="sm90", **options),
                        q, kp, vp, table, lengths)
  reference_options = {{"logits_soft_cap": "soft_cap"}.get(k, k): v for k, v in options.items()}
  _assert_close(out, _reference(q, kp, vp, table, lengths, **reference_options), 2e-2)


@pytest.mark.parametrize("t", [40, 130])
def test_kernel_serves_chunked_prefill_aligned_by_each_rows_length(t, run_interpreted):
  # t new tokens per row after 300 - t and after 45 - t cached ones (row 1's
  # first queries sit at negative positions: they see nothing and get zeros);
  # pages of 16 shuffled, GQA 4/2. 40 tokens: 80 packed rows, the decode
  # arrangement; 130: 260 rows, the forward kernel itself.
  q, kp, vp, table, lengths = _paged_cache(5, batch=2, t=t, q_heads=4, kv_heads=2, head_dim=64,
                                           page_size=16, max_pages=20, lengths=(300, 45),
                                           dtype=jnp.bfloat16)
  out = run_interpreted(lambda *a: fa4_jax.paged_attention(*a, implementation="sm90"),
                        q, kp, vp, table, lengths)
  _assert_close(out, _reference(q, kp, vp, table, lengths), 2e-2)


def test_gradients_are_the_xla_paths_also_when_the_kernel_ran_the_forward(run_interpreted):
  q, kp, vp, table, lengths = _paged_cache(3, batch=1, t=1, q_heads=2, kv_heads=1, head_dim=64,
                                           page_size=64, max_pages=2, lengths=(100,),
                                           dtype=jnp.bfloat16)
  loss = lambda impl: lambda q, kp, vp: jnp.sum(fa4_jax.paged_attention(
      q, kp, vp, table, lengths, implementation=impl).astype(jnp.float32))
  got = run_interpreted(jax.grad(loss("sm90"), argnums=(0, 1, 2)), q, kp, vp)
  want = jax.grad(loss("xla"), argnums=(0, 1, 2))(q, kp, vp)
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


# --- selection -----------------------------------------------------------------


def _small(**overrides):
  shape = dict(batch=1, t=1, q_heads=4, kv_heads=2, head_dim=64, page_size=16, max_pages=4,
               lengths=(40,), dtype=jnp.bfloat16) | overrides
  return _paged_cache(4, **shape)


@pytest.fixture
def hopper(monkeypatch):
  """Selection sees a Hopper GPU as the default device."""
  from fa4_jax import backends
  monkeypatch.setattr(backends, "device_arch_major", lambda: 9)


@pytest.mark.parametrize("name, overrides, options, reason", [
    ("page 24", dict(page_size=24), dict(), r"page size \(key_pages.shape\[1\]\) must be a power"),
    ("page 4", dict(page_size=4, lengths=(13,)), dict(), r"key_pages.shape\[1\]\) must be a power"),
    ("head_dim 80", dict(head_dim=80), dict(), "head_dim must be a multiple of 64"),
    ("float32", dict(dtype=jnp.float32), dict(), "dtype"),
    ("T129 x 2 heads per KV head", dict(t=129), dict(is_causal=False), "256"),
])
def test_on_hopper_what_the_kernel_cannot_serve_runs_on_xla_and_sm90_says_why(
    name, overrides, options, reason, hopper):
  args = _small(**overrides)
  assert fa4_jax.which_paged_implementation(*args, **options) == "xla"
  with pytest.raises(ValueError, match=reason):
    fa4_jax.which_paged_implementation(*args, implementation="sm90", **options)


def test_on_hopper_the_kernel_serves_t1_and_non_causal_queries_with_pages_of_16_to_128(hopper):
  for page_size in (16, 32, 64, 128):
    args = _small(page_size=page_size)
    assert fa4_jax.which_paged_implementation(*args) == "sm90"
    assert fa4_jax.which_paged_implementation(*args, implementation="xla") == "xla"
  assert fa4_jax.which_paged_implementation(*_small(t=3), is_causal=False) == "sm90"
  assert fa4_jax.which_paged_implementation(*_small(t=300)) == "sm90"  # chunked prefill


@pytest.mark.skipif(jax.devices()[0].platform == "gpu", reason="describes a machine without a GPU")
def test_without_a_hopper_gpu_none_picks_xla_and_sm90_runs_only_in_the_interpreter():
  args = _small()
  assert fa4_jax.which_paged_implementation(*args) == "xla"
  with pytest.raises(ValueError, match="Hopper"):
    fa4_jax.paged_attention(*args, implementation="sm90")
  with fa4_jax.interpret_mode():
    assert fa4_jax.which_paged_implementation(*args) == "xla"
    assert fa4_jax.which_paged_implementation(*args, implementation="sm90") == "sm90"


# --- cross-lowering for Hopper ---------------------------------------------------


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("page_size", [16, 64])
def test_paged_kernel_lowers_for_hopper_with_one_tma_per_page_in_the_unpaged_smem(
    head_dim, page_size, cross_lower):
  from fa4_jax.kernels import sm90_forward
  from fa4_jax.scores import MaskSpec

  b, rows, kv_heads, pages = 4, 4, 8, 256
  q = jax.ShapeDtypeStruct((b, rows, kv_heads, head_dim), jnp.bfloat16)
  cache = jax.ShapeDtypeStruct((b * pages, page_size, kv_heads, head_dim), jnp.bfloat16)
  table = jax.ShapeDtypeStruct((b, pages), jnp.int32)
  lengths = jax.ShapeDtypeStruct((b,), jnp.int32)
  paged = cross_lower(lambda q, k, v, t, n: sm90_forward.forward(
      q, k, v, None, n, score=ScoreFunction(0.1), mask=MaskSpec(), page_table=t),
                      q, cache, cache, table, lengths)
  dense_kv = jax.ShapeDtypeStruct((b, pages * page_size, kv_heads, head_dim), jnp.bfloat16)
  dense = cross_lower(lambda q, k, v, n: sm90_forward.forward(
      q, k, v, None, n, score=ScoreFunction(0.1), mask=MaskSpec()), q, dense_kv, dense_kv, lengths)
  assert paged.smem_bytes == dense.smem_bytes
  assert paged.max_smem_bytes <= sm90_forward.SMEM_LIMIT_BYTES
  for instruction in ("wgmma.mma_async", "cp.async.bulk.tensor", "mbarrier.try_wait.parity"):
    assert paged.has(instruction)
  config = sm90_forward.choose_config(head_dim, MaskSpec(), pages * page_size, rows)
  copies = sm90_forward.kv_copies_per_block(config.block_kv, page_size)
  assert copies == config.block_kv // page_size > 1
  # The producer's loads: Q tiles, then K and V of a block, one TMA per page.
  assert _tma_loads(paged) == _tma_loads(dense) + 2 * (copies - 1)
  # The K and V full barriers (one per ring slot) expect one arrival per copy.
  slots = 2 * config.num_kv_stages
  assert _barrier_arrivals(paged) == (_barrier_arrivals(dense) - Counter({1: slots})
                                      + Counter({copies: slots}))


def _tma_loads(lowered) -> int:
  return sum(m.count("nvvm.cp.async.bulk.tensor.shared.cluster.global") for m in lowered.modules)


def _barrier_arrivals(lowered) -> Counter:
  """How many barriers expect how many arrivals (a warpgroup's arrival counts
  its 128 threads in the mbarrier's initial count)."""
  counts = [int(c) for m in lowered.modules
            for c in re.findall(r"mbarrier\.init[^\n]*%c(\d+)_i32", m)]
  assert counts and all(c % 128 == 0 for c in counts)
  return Counter(c // 128 for c in counts)


# --- bad input -------------------------------------------------------------------


def _bad(name):
  q, kp, vp, table, lengths = _small(dtype=jnp.float32)
  cases = {
      "query rank": ((q[0], kp, vp, table, lengths), "`query`"),
      "key_pages rank": ((q, kp[0], vp, table, lengths), "`key_pages`"),
      "value_pages shape": ((q, kp, vp[:-1], table, lengths), "`value_pages`"),
      "value dtype": ((q, kp, vp.astype(jnp.bfloat16), table, lengths), "same dtype"),
      "head_dim": ((q[..., :32], kp, vp, table, lengths), "head_dim"),
      "heads": ((q[:, :, :3], kp, vp, table, lengths), "multiple of `key_pages` heads"),
      "float table": ((q, kp, vp, table.astype(jnp.float32), lengths), "`page_table`"),
      "table rank": ((q, kp, vp, table[0], lengths), "`page_table`"),
      "table batch": ((q, kp, vp, jnp.concatenate([table, table]), lengths), "`page_table`"),
      "float lengths": ((q, kp, vp, table, lengths.astype(jnp.float32)),
                        "`key_value_seq_lengths`"),
      "lengths shape": ((q, kp, vp, table, jnp.concatenate([lengths, lengths])),
                        "`key_value_seq_lengths`"),
      "length past the table": ((q, kp, vp, table, lengths + 1000), "`key_value_seq_lengths`"),
  }
  return cases[name]


@pytest.mark.parametrize("name", [
    "query rank", "key_pages rank", "value_pages shape", "value dtype", "head_dim", "heads",
    "float table", "table rank", "table batch", "float lengths", "lengths shape",
    "length past the table"])
def test_bad_input_raises_a_value_error_naming_the_argument(name):
  args, message = _bad(name)
  with pytest.raises(ValueError, match=message):
    fa4_jax.paged_attention(*args)


def test_bad_options_are_named():
  args = _small(dtype=jnp.float32)
  for options, message in ((dict(implementation="cudnn"), "`implementation`"),
                           (dict(is_causal=1), "`is_causal`"),
                           (dict(sinks=jnp.zeros((3,))), "`sinks`"),
                           (dict(logits_soft_cap=-1.0), "`logits_soft_cap`")):
    with pytest.raises(ValueError, match=message):
      fa4_jax.paged_attention(*args, **options)
