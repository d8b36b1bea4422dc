"""MLA decode on a Hopper GPU, at serving sizes (skipped without one).

* `attention(q, k, None, value_head_dim=512)` and `paged_attention(q,
  pages, None, ..., value_head_dim=512)` pick the sm90 MLA decode kernel
  ("sm90_mla" / "sm90") and equal the XLA path (`implementation="xla"`) on
  the same inputs: memory-bound rows (Hq 16, one token, per-row lengths
  incl. 1 and a full row), compute-bound rows (Hq 128, two tokens,
  bottom-right causal), contiguous and paged (pages of 64 at shuffled
  positions), bf16 and fp16, scale 1/sqrt(192).
* A row of length 1 sees only its first key: its output is that key's
  first 512 features.

bf16 tolerances: one bf16 rounding of P and of each chunk's output, then
the merge in f32; the XLA path sees the same inputs. Every case finishes
in seconds (first compiles included); the file well inside 10 minutes.

Run: python3 -m pytest tests/test_mla_on_gpu.py -x -q
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax

ON_HOPPER = (jax.devices()[0].platform == "gpu"
             and str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9"))
pytestmark = pytest.mark.skipif(not ON_HOPPER, reason="needs a Hopper GPU")

D, DV, PAGE = 576, 512, 64
SCALE = 192 ** -0.5


def _inputs(seed, b, t, n, s, dtype):
  kq, kk, kl = jax.random.split(jax.random.key(seed), 3)
  q = jax.random.normal(kq, (b, t, n, D), dtype)
  latent = jax.random.normal(kk, (b, s, 1, D), dtype)
  lengths = jax.random.randint(kl, (b,), 1, s + 1).astype(jnp.int32)
  lengths = lengths.at[0].set(1).at[-1].set(s)
  return q, latent, lengths


def _paged(latent, seed):
  b, s = latent.shape[:2]
  order = np.random.default_rng(seed).permutation(b * s // PAGE)
  pool = jnp.zeros((b * s // PAGE, PAGE, 1, D), latent.dtype).at[order].set(
      latent.reshape(b * s // PAGE, PAGE, 1, D))
  return pool, jnp.asarray(order.reshape(b, s // PAGE), jnp.int32)


def _check(out, want):
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want, np.float32),
                             atol=2e-2, rtol=2e-2)


CASES = [
    ("memory-bound B32 Hq16 S8k", 32, 1, 16, 8192),
    ("memory-bound B64 Hq16 S32k", 64, 1, 16, 32768),
    ("compute-bound B64 Hq128 T2 S4k", 64, 2, 128, 4096),
    ("compute-bound B128 Hq128 S4k", 128, 1, 128, 4096),
]


@pytest.mark.parametrize("name, b, t, n, s", CASES)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_latent_attention_equals_the_xla_path(name, b, t, n, s, dtype):
  q, latent, lengths = _inputs(0, b, t, n, s, dtype)
  options = dict(value_head_dim=DV, scale=SCALE, key_value_seq_lengths=lengths,
                 is_causal=t > 1, causal_alignment="bottom_right")
  assert fa4_jax.which_implementation(q, latent, None, **options) == "sm90_mla"
  run = lambda impl: jax.jit(lambda q, k: fa4_jax.attention(
      q, k, None, implementation=impl, **options))(q, latent)
  out, want = run(None), run("xla")
  _check(out, want)
  np.testing.assert_allclose(np.asarray(out[0], np.float32),
                             np.broadcast_to(np.asarray(latent[0, 0, 0, :DV], np.float32),
                                             out[0].shape) if t == 1 else np.asarray(
                                                 want[0], np.float32), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("name, b, t, n, s", CASES)
def test_latent_pages_equal_the_xla_path(name, b, t, n, s):
  q, latent, lengths = _inputs(1, b, t, n, s, jnp.bfloat16)
  pool, table = _paged(latent, seed=b)
  options = dict(value_head_dim=DV, scale=SCALE, is_causal=t > 1)
  assert fa4_jax.which_paged_implementation(q, pool, None, table, lengths, **options) == "sm90_mla"
  run = lambda impl: jax.jit(lambda q, p, tb, n: fa4_jax.paged_attention(
      q, p, None, tb, n, implementation=impl, **options))(q, pool, table, lengths)
  _check(run(None), run("xla"))


CONFIG_CASES = [CASES[1], CASES[2], CASES[3]]  # memory-bound S32k; compute-bound T2 causal, T1
# The non-default CONFIGS (a plain list: this file imports no kernel module at collection).
NON_DEFAULT_CONFIGS = ["waves8", "items_first", "alternate", "waves2", "waves8_adjacent"]


@pytest.mark.parametrize("name, b, t, n, s", CONFIG_CASES)
@pytest.mark.parametrize("config", NON_DEFAULT_CONFIGS)
def test_configs_equal_the_xla_path(config, name, b, t, n, s):
  """`sm90_mla_decode.CONFIGS` candidates (bench_mla.py's columns), contiguous
  and paged, against the XLA path."""
  from fa4_jax.kernels import sm90_mla_decode as mla
  q, latent, lengths = _inputs(2, b, t, n, s, jnp.bfloat16)
  pool, table = _paged(latent, seed=b)

  def under_config(f):
    def g(*args):
      with mla.use_config(config):
        return f(*args)
    return jax.jit(g)

  options = dict(value_head_dim=DV, scale=SCALE, is_causal=t > 1)
  contiguous = lambda impl: under_config(lambda q, k, n: fa4_jax.attention(
      q, k, None, implementation=impl, key_value_seq_lengths=n,
      causal_alignment="bottom_right", **options))(q, latent, lengths)
  paged = lambda impl: under_config(lambda q, p, tb, n: fa4_jax.paged_attention(
      q, p, None, tb, n, implementation=impl, **options))(q, pool, table, lengths)
  want = contiguous("xla")
  _check(contiguous(None), want)
  _check(paged(None), want)
