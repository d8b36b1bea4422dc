"""Which implementation serves a call: None falls back, a named kernel raises."""

import types

import jax
import jax.numpy as jnp
import pytest

import fa4_jax
from conftest import cpu_only
from fa4_jax import backends

q = jnp.zeros((1, 128, 2, 64), jnp.bfloat16)


@cpu_only
def test_default_on_a_machine_without_a_gpu_is_the_xla_path():
  assert backends.device_arch_major() is None
  assert fa4_jax.which_implementation(q, q, q) == "xla"
  assert fa4_jax.which_implementation(q, q, q, is_causal=True) == "xla"


def test_a_gpu_machine_asked_to_compute_on_its_cpu_does_not_pick_a_gpu_kernel(monkeypatch):
  """The arch check reads the device set with `jax.default_device`, not the
  first device of the default backend."""
  cpu = jax.devices("cpu")[0]
  hopper = types.SimpleNamespace(platform="gpu", compute_capability="9.0",
                                 device_kind="NVIDIA H100 80GB HBM3")
  real_devices = jax.devices
  monkeypatch.setattr(jax, "devices", lambda *a: real_devices(*a) if a else [hopper])
  assert backends.device_arch_major() == 9
  for chosen in (cpu, "cpu"):
    with jax.default_device(chosen):
      assert backends.device_arch_major() is None
      assert fa4_jax.which_implementation(q, q, q) == "xla"
      with pytest.raises(ValueError, match="needs a Hopper .* default device is 'cpu'"):
        fa4_jax.which_implementation(q, q, q, implementation="sm90")


def test_xla_is_available_everywhere():
  assert fa4_jax.which_implementation(q, q, q, implementation="xla") == "xla"


@cpu_only
@pytest.mark.parametrize("name, gpu", [("sm90", "Hopper"), ("sm100", "Blackwell")])
def test_asking_for_a_kernel_without_its_gpu_says_why(name, gpu):
  with pytest.raises(ValueError, match=f"needs a {gpu} .* GPU.*interpret_mode"):
    fa4_jax.attention(q, q, q, implementation=name)


@pytest.mark.parametrize("name", ["sm90", "sm100"])
def test_kernels_refuse_a_bias_even_when_interpreted(name):
  with fa4_jax.interpret_mode():
    with pytest.raises(ValueError, match="does not support `bias`"):
      fa4_jax.which_implementation(q, q, q, bias=jnp.zeros((1, 1, 128, 128)),
                                   implementation=name)


@pytest.mark.parametrize("name", ["sm90", "sm100"])
def test_kernels_refuse_a_boolean_mask_even_when_interpreted(name):
  with fa4_jax.interpret_mode():
    with pytest.raises(ValueError, match="does not support a boolean `mask`"):
      fa4_jax.which_implementation(q, q, q, mask=jnp.ones((1, 1, 128, 128), bool),
                                   implementation=name)


def test_a_kernel_that_cannot_serve_the_arguments_falls_back_under_none(monkeypatch):
  # Pretend to be on a Hopper GPU: with a bias, None must still answer (XLA).
  monkeypatch.setattr(backends, "device_arch_major", lambda: 9)
  assert fa4_jax.which_implementation(q, q, q, bias=jnp.zeros((1, 1, 128, 128))) == "xla"


def test_cudnn_is_forwarded_to_jax_nn():
  assert fa4_jax.which_implementation(q, q, q, implementation="cudnn") == "cudnn"
