"""The public signatures and the list `fa4_jax.api` forwards to validation:
a keyword added to `attention` must reach `validate` (and so every backend)
and be accepted by `which_implementation` too."""

import inspect

import jax.numpy as jnp
import pytest

import fa4_jax
from fa4_jax import api, validation

# `deterministic` picks among the sm90 backward's kernels, after validation
# and backend selection (`which_implementation(part="backward")` names the
# family, "sm90" either way).
OWN = {"attention": {"implementation", "return_residual", "deterministic"},
       "which_implementation": {"implementation", "part"}}


@pytest.mark.parametrize("name", sorted(OWN))
def test_every_keyword_of_the_public_functions_is_forwarded_to_validation(name):
  params = inspect.signature(getattr(fa4_jax, name)).parameters
  keywords = {p for p, v in params.items() if v.kind is inspect.Parameter.KEYWORD_ONLY}
  assert keywords - OWN[name] == set(api._VALIDATED)
  accepted = inspect.signature(validation.validate).parameters
  assert set(api._VALIDATED) <= set(accepted)


def test_cudnn_names_the_arguments_jax_nn_lacks():
  q = jnp.zeros((1, 8, 2, 16), jnp.bfloat16)
  with pytest.raises(ValueError, match="`sinks`, `logits_soft_cap`.*causal_alignment"):
    fa4_jax.attention(q, q, q, implementation="cudnn", sinks=jnp.zeros(2), logits_soft_cap=5.0,
                      causal_alignment="bottom_right")
