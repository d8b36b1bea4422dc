"""Bad input gets a ValueError/TypeError that names the argument and what was expected."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fa4_jax

B, T, S, N, K, H = 2, 8, 8, 4, 2, 16


def qkv(dtype=jnp.float32, q_shape=(B, T, N, H), k_shape=(B, S, K, H), v_shape=None):
  return (jnp.zeros(q_shape, dtype), jnp.zeros(k_shape, dtype),
          jnp.zeros(v_shape or k_shape, dtype))


@pytest.mark.parametrize("args, kwargs, message", [
    (qkv(q_shape=(T, N, H)), {}, "must all be rank 4"),
    (qkv(q_shape=(1, B, T, N, H)), {}, "must all be rank 4"),
    (qkv(v_shape=(B, S + 1, K, H)), {}, r"`value` shape must equal `key` shape"),
    (qkv(q_shape=(B + 1, T, N, H)), {}, r"`query` batch size \(3\) must equal `key` batch size \(2\)"),
    (qkv(q_shape=(B, T, N, H + 8)), {}, r"`query` head_dim \(24\) must equal `key` head_dim \(16\)"),
    (qkv(q_shape=(B, T, 3, H)), {}, r"`query` heads \(3\) must be a multiple of `key`/`value` heads \(2\)"),
    (qkv(dtype=jnp.int32), {}, "`query` dtype must be one of"),
    (qkv(q_shape=(B, 0, N, H)), {}, "at least one position"),
    (qkv(), dict(bias=jnp.zeros((B, N, T, S + 1))), r"`bias` shape .* must broadcast to"),
    (qkv(), dict(bias=jnp.zeros((B, 3, T, S))), r"`bias` shape .* must broadcast to"),
    (qkv(), dict(bias=jnp.zeros((1, 1, 1, 1, 1))), "`bias` must have rank <= 4"),
    (qkv(), dict(mask=jnp.zeros((B, 1, T, S)), ), "`mask` must be a boolean array"),
    (qkv(), dict(query_seq_lengths=jnp.array([1, 2, 3], jnp.int32)), r"`query_seq_lengths` shape must be \(batch,\)"),
    (qkv(), dict(key_value_seq_lengths=jnp.array([1.0, 2.0])), "`key_value_seq_lengths` must be an integer array"),
    (qkv(), dict(key_value_seq_lengths=jnp.array([4, S + 1], jnp.int32)), r"values must lie in \[0, 8\]"),
    (qkv(), dict(query_seq_lengths=jnp.array([-1, 2], jnp.int32)), r"values must lie in \[0, 8\]"),
    (qkv(), dict(local_window_size=(3, -1)), "`local_window_size` sizes must be >= 0"),
    (qkv(), dict(local_window_size=(1, 2, 3)), "`local_window_size` must be an int or a pair"),
    (qkv(), dict(local_window_size=2.5), "`local_window_size` must be an int or a pair"),
    (qkv(), dict(scale=float("nan")), "`scale` must be finite"),
    (qkv(), dict(implementation="flash"), "`implementation` must be one of"),
])
def test_bad_input_raises_a_value_error_naming_the_argument(args, kwargs, message):
  with pytest.raises(ValueError, match=message):
    fa4_jax.attention(*args, **kwargs)


def test_mismatched_dtypes_are_named():
  q, k, v = qkv()
  with pytest.raises(ValueError, match="same dtype; got float32, bfloat16 and float32"):
    fa4_jax.attention(q, k.astype(jnp.bfloat16), v)


def test_a_traced_scale_is_a_type_error():
  q, k, v = qkv()
  with pytest.raises(TypeError, match="`scale` must be a Python number"):
    jax.jit(lambda s: fa4_jax.attention(q, k, v, scale=s))(0.5)


def test_is_causal_must_be_a_bool():
  with pytest.raises(TypeError, match="`is_causal` must be a bool"):
    fa4_jax.attention(*qkv(), is_causal="yes")


def test_lengths_inside_jit_are_not_checked_but_still_clamped():
  # Under jit the values are unknown at trace time; out-of-range lengths act
  # as the full length instead of reading out of bounds.
  q, k, v = (jnp.asarray(np.random.default_rng(0).normal(size=x.shape), jnp.float32)
             for x in qkv())
  f = jax.jit(lambda lens: fa4_jax.attention(q, k, v, key_value_seq_lengths=lens))
  np.testing.assert_allclose(f(jnp.array([S + 5, S], jnp.int32)), fa4_jax.attention(q, k, v),
                             atol=1e-6)
