"""Packed sequences on a Hopper GPU, at training sizes (skipped without one).

* The default implementation serves segment ids with the sm90 kernels.
* Forward at B2 x 16k tokens (H16 D128, GQA 32/8 D128, H32 D64; bf16, causal,
  documents of mean 1k; each takes the persistent grid's work queue):
  sampled rows against an f32 einsum with the explicit mask.
* Gradients at 4k tokens (dense and causal, GQA 16/4, a window, interleaved
  ids) against jax.nn's XLA attention in f32 given the explicit mask; rows
  whose segment has no key give zeros and zero gradients.
* Gradients are bit-identical from run to run.
* At 16k tokens the dK/dV kernel's work queue (packed causal rows at head
  dim 64; at 128 when asked for) gives dK and dV bit for bit equal to one
  CTA per key tile (each element is computed by one CTA in the same order
  either way).

bf16 tolerances: one bf16 rounding of P and of the output (2^-8 relative)
over sums of thousands of terms; the f32 references see the same bf16 inputs.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax
from reference import packed_segment_ids, relative_error, visible_mask

ON_HOPPER = (jax.devices()[0].platform == "gpu"
             and str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9"))
pytestmark = pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")


def _packing(rng, batch, length, mean):
  rows = []
  for _ in range(batch):
    lengths, total = [], 0
    while total < length:
      n = min(length - total, max(1, int(rng.exponential(mean))))
      lengths.append(n)
      total += n
    rows.append(packed_segment_ids(lengths, length))
  return np.stack(rows)


def _inputs(seed, b, t, n, kv_heads, d):
  keys = jax.random.split(jax.random.key(seed), 4)
  draw = lambda key, heads, shift=0.0: (shift + jax.random.normal(key, (b, t, heads, d))).astype(jnp.bfloat16)
  return draw(keys[0], n), draw(keys[1], kv_heads), draw(keys[2], kv_heads, 1.0), draw(keys[3], n)


@pytest.mark.parametrize("n, kv_heads, d", [(16, 16, 128), (32, 8, 128), (32, 32, 64)])
def test_forward_at_16k_tokens_matches_an_f32_einsum_on_sampled_rows(n, kv_heads, d):
  b, t = 2, 16384
  q, k, v, _ = _inputs(0, b, t, n, kv_heads, d)
  ids = _packing(np.random.default_rng(0), b, t, 1024)
  attend = lambda q, k, v, ids: fa4_jax.attention(
      q, k, v, is_causal=True, query_segment_ids=ids, key_value_segment_ids=ids,
      return_residual=True)
  assert fa4_jax.which_implementation(q, k, v, is_causal=True, query_segment_ids=ids,
                                      key_value_segment_ids=ids) == "sm90"
  out, lse = jax.jit(attend)(q, k, v, jnp.asarray(ids))
  rows = np.sort(np.random.default_rng(1).choice(t, 512, replace=False))
  qf, kf, vf = (x.astype(jnp.float32) for x in (q, k, v))
  kf, vf = (jnp.repeat(x, n // kv_heads, axis=2) for x in (kf, vf))  # query head h reads h // G
  logits = jnp.einsum("btnd,bsnd->bnts", qf[:, rows], kf, precision="highest") / np.sqrt(d)
  visible = (ids[:, rows, None] == ids[:, None, :]) & (np.arange(t)[None, None, :] <= rows[None, :, None])
  logits = jnp.where(visible[:, None], logits, -jnp.inf)
  want_lse = jax.nn.logsumexp(logits, axis=-1)
  want = jnp.einsum("bnts,bsnd->btnd", jax.nn.softmax(logits, axis=-1), vf, precision="highest")
  np.testing.assert_allclose(np.asarray(out[:, rows], np.float32), np.asarray(want),
                             atol=2e-2, rtol=2e-2)
  np.testing.assert_allclose(np.asarray(lse[:, rows], np.float32),
                             np.asarray(want_lse).transpose(0, 2, 1), atol=2e-2, rtol=1e-2)


def _ids_of(kind, rng, b, t):
  if kind == "interleaved":
    return np.stack([(np.arange(t) // 7) % 3 for _ in range(b)]).astype(np.int32)
  return _packing(rng, b, t, 300)


@pytest.mark.parametrize("name, is_causal, window, kind", [
    ("causal", True, None, "packed"),
    ("dense", False, None, "packed"),
    ("causal window", True, (256, 0), "packed"),
    ("interleaved", True, None, "interleaved"),
])
def test_gradients_at_4k_tokens_match_f32_jax_nn_with_the_explicit_mask(name, is_causal, window,
                                                                        kind):
  b, t, n, kv_heads, d = 1, 4096, 16, 4, 128
  q, k, v, dout = _inputs(2, b, t, n, kv_heads, d)
  ids = _ids_of(kind, np.random.default_rng(3), b, t)
  kv_ids = ids.copy()
  kv_ids[:, 3:5] = -1  # keys no query sees
  ids[:, :3] = -2  # rows of a segment without keys: zeros, zero gradients
  visible = visible_mask(t, t, is_causal=is_causal, window=window, batch=b,
                         q_segment_ids=ids, kv_segment_ids=kv_ids)
  seen = jnp.asarray(visible.any(-1).transpose(0, 2, 1)[..., None], jnp.float32)  # [B,T,1,1]

  def ours(q, k, v):
    return fa4_jax.attention(q, k, v, is_causal=is_causal, local_window_size=window,
                             query_segment_ids=jnp.asarray(ids),
                             key_value_segment_ids=jnp.asarray(kv_ids))

  def theirs(q, k, v):
    f32 = lambda x: x.astype(jnp.float32)
    return jax.nn.dot_product_attention(f32(q), f32(k), f32(v), mask=jnp.asarray(visible),
                                        implementation="xla")

  assert fa4_jax.which_implementation(q, k, v, is_causal=is_causal, local_window_size=window,
                                      query_segment_ids=ids, key_value_segment_ids=kv_ids) == "sm90"
  loss = lambda attend: (lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32) * seen
                                                 * dout.astype(jnp.float32)))
  out = jax.jit(ours)(q, k, v)
  assert np.all(np.asarray(out[:, :3], np.float32) == 0)
  np.testing.assert_allclose(np.asarray(out, np.float32) * np.asarray(seen),
                             np.asarray(jax.jit(theirs)(q, k, v)) * np.asarray(seen),
                             atol=2e-2, rtol=2e-2)
  grad = jax.jit(jax.grad(loss(ours), argnums=(0, 1, 2)))
  got = grad(q, k, v)
  want = jax.jit(jax.grad(loss(theirs), argnums=(0, 1, 2)))(q, k, v)
  for g, w, label in zip(got, want, "qkv"):
    g, w = np.asarray(g, np.float32), np.asarray(w)
    assert np.all(np.isfinite(g)), label
    rel = relative_error(g, w)
    assert rel < 1e-2, (label, rel)
  assert np.all(np.asarray(got[0][:, :3]) == 0)
  again = grad(q, k, v)
  for g, h in zip(got, again):
    np.testing.assert_array_equal(np.asarray(g), np.asarray(h))  # deterministic


@pytest.mark.parametrize("n, kv_heads, d", [(16, 16, 128), (32, 8, 128), (32, 32, 64)])
def test_the_dk_dv_work_queue_gives_the_gradients_of_one_cta_per_key_tile(n, kv_heads, d):
  from fa4_jax.kernels import sm90_backward, sm90_forward
  from fa4_jax.scores import MaskSpec, ScoreFunction

  b, t = 2, 16384
  q, k, v, dout = _inputs(4, b, t, n, kv_heads, d)
  ids = jnp.asarray(_packing(np.random.default_rng(5), b, t, 1024))
  mask = MaskSpec(right=0)
  out, lse = jax.jit(lambda q, k, v: sm90_forward.forward(
      q, k, v, None, None, score=ScoreFunction(d ** -0.5), mask=mask,
      segment_ids=(ids, ids)))(q, k, v)
  # (The heuristic takes the queue at head dim 64 only; it must be right at 128 too.)
  config = sm90_backward.choose_config(d, mask, n // kv_heads, segment_ids=True)
  queued = dataclasses.replace(config, dkv=dataclasses.replace(config.dkv, work_queue=True))
  per_tile = dataclasses.replace(config, dkv=dataclasses.replace(config.dkv, work_queue=False))

  def grads(config):
    return jax.jit(lambda *args: sm90_backward.backward(
        *args, None, None, score=ScoreFunction(d ** -0.5), mask=mask, config=config,
        segment_ids=(ids, ids)))(q, k, v, out, lse, dout)

  got, want = grads(queued), grads(per_tile)
  for g, w, label in zip(got, want, ("dq", "dk", "dv")):
    assert np.all(np.isfinite(np.asarray(g, np.float32))), label
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=label)
