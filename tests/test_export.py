"""Exporting for GPUs from a host without one: `fa4_jax.gpu_target`.

Inside `gpu_target(arch)`, a function exported for CUDA carries the Mosaic
GPU kernels (the `mosaic_gpu_v2` custom call) whatever the host has; exported
for ("cuda", "cpu") it carries the kernel for CUDA and the XLA path for the
CPU, which these tests run after a serialization round trip and compare with
`jax.nn.dot_product_attention`. Without a target, lowering for CUDA on a
host without a GPU warns.
"""

import re
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

import fa4_jax
from conftest import cpu_only
from fa4_jax import backends
from fa4_jax.kernels import sm90_forward

SHAPE = (1, 256, 2, 64)  # [B, T, N, H]: one small causal problem every kernel serves
SPEC = jax.ShapeDtypeStruct(SHAPE, jnp.bfloat16)
# bf16 outputs of magnitude < 4 are rounded to 2^-7 at most; gradients summed
# over 256 keys in float32 and rounded once more.
ATOL = 2e-2


def attention(q, k, v, implementation=None):
  return fa4_jax.attention(q, k, v, is_causal=True, implementation=implementation)


def attention_grads(q, k, v, implementation=None):
  def loss(q, k, v):
    return attention(q, k, v, implementation).astype(jnp.float32).sum()
  return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


def reference(q, k, v):
  return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")


def reference_grads(q, k, v):
  def loss(q, k, v):
    return reference(q, k, v).astype(jnp.float32).sum()
  return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


def exported(fn, platforms, arch="sm90", **specs):
  with fa4_jax.gpu_target(arch):
    return export.export(jax.jit(fn), platforms=platforms)(SPEC, SPEC, SPEC, **specs)


def kernel_calls(exp) -> int:
  return len(re.findall(r"custom_call @mosaic_gpu_v2\(", exp.mlir_module()))


def round_trip(exp):
  """`exp` serialized and loaded back, as a server would."""
  pytest.importorskip("flatbuffers", reason="jax.export serialization needs flatbuffers "
                      "(pip install -e '.[test]')")
  return export.deserialize(exp.serialize())


def inputs():
  keys = jax.random.split(jax.random.key(0), 3)
  return [jax.random.normal(key, SHAPE, jnp.bfloat16) for key in keys]


@pytest.fixture(scope="module")
def multi_platform():
  """Forward and gradients exported for ("cuda", "cpu") under the sm90 target."""
  return dict(forward=exported(attention, ("cuda", "cpu")),
              grads=exported(attention_grads, ("cuda", "cpu")))


@pytest.mark.parametrize("implementation", [None, "sm90"])
def test_exporting_for_cuda_under_a_target_carries_the_kernel_alone(implementation):
  exp = exported(lambda q, k, v: attention(q, k, v, implementation), ("cuda",))
  assert kernel_calls(exp) == 1
  text = exp.mlir_module()
  # Lowered for CUDA alone, the XLA path (its matmuls) is not in the module.
  assert "dot_general" not in text
  assert "wgmma" in text and "tcgen05" not in text


def test_the_sm100_target_lowers_the_blackwell_kernel():
  exp = exported(attention, ("cuda",), arch="sm100")
  assert kernel_calls(exp) == 1
  assert "tcgen05" in exp.mlir_module()


def test_a_multi_platform_export_carries_the_kernels_and_the_xla_path(multi_platform):
  assert kernel_calls(multi_platform["forward"]) == 1
  assert kernel_calls(multi_platform["grads"]) >= 2  # the forward and the fused backward
  assert all("dot_general" in exp.mlir_module() for exp in multi_platform.values())


def test_a_multi_platform_export_runs_the_xla_path_on_the_cpu(multi_platform):
  q, k, v = inputs()
  out = round_trip(multi_platform["forward"]).call(q, k, v)
  np.testing.assert_allclose(np.asarray(out, np.float32),
                             np.asarray(reference(q, k, v), np.float32), atol=ATOL)
  grads = round_trip(multi_platform["grads"]).call(q, k, v)
  for got, want in zip(grads, reference_grads(q, k, v)):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               atol=ATOL)


def test_a_multi_platform_export_under_vmap_runs_on_the_cpu():
  batched = jax.ShapeDtypeStruct((2,) + SHAPE, jnp.bfloat16)
  with fa4_jax.gpu_target("sm90"):
    exp = export.export(jax.jit(jax.vmap(attention)), platforms=("cuda", "cpu"))(
        batched, batched, batched)
  assert kernel_calls(exp) == 1
  q, k, v = (jnp.stack([x, x[:, ::-1]]) for x in inputs())
  out = round_trip(exp).call(q, k, v)
  np.testing.assert_allclose(np.asarray(out, np.float32),
                             np.asarray(jax.vmap(reference)(q, k, v), np.float32), atol=ATOL)


def test_a_multi_platform_export_with_explicit_sharding_runs_on_the_cpu(host_devices):
  """The shard_map path of `fa4_jax.sharding`, batch split over two devices."""
  mesh = jax.make_mesh((2,), ("b",), axis_types=(jax.sharding.AxisType.Explicit,),
                       devices=host_devices[:2])
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("b"))
  spec = jax.ShapeDtypeStruct((2,) + SHAPE[1:], jnp.bfloat16, sharding=sharding)
  with jax.set_mesh(mesh), fa4_jax.gpu_target("sm90"):
    exp = export.export(jax.jit(attention), platforms=("cuda", "cpu"))(spec, spec, spec)
  assert kernel_calls(exp) == 1
  q, k, v = (jax.device_put(jnp.concatenate([x, x[:, ::-1]]), sharding) for x in inputs())
  with jax.set_mesh(mesh):
    out = round_trip(exp).call(q, k, v)
  np.testing.assert_allclose(np.asarray(out, np.float32),
                             np.asarray(reference(q, k, v), np.float32), atol=ATOL)


def test_a_function_traced_outside_the_target_is_traced_again_inside():
  fn = jax.jit(attention)
  q, k, v = inputs()
  fn(q, k, v)  # traced (and cached) with the host's choice
  with fa4_jax.gpu_target("sm90"):
    assert kernel_calls(export.export(fn, platforms=("cuda",))(SPEC, SPEC, SPEC)) == 1


def test_the_target_decides_selection_and_the_persistent_grid():
  q = jnp.zeros(SHAPE, jnp.bfloat16)
  with fa4_jax.gpu_target("sm90"):
    assert fa4_jax.which_implementation(q, q, q, is_causal=True) == "sm90"
    assert sm90_forward.sm_count() == 132
    with pytest.raises(ValueError, match="needs a Blackwell .* the gpu_target is 'sm90'"):
      fa4_jax.which_implementation(q, q, q, implementation="sm100")
  with fa4_jax.gpu_target("sm100"):
    assert fa4_jax.which_implementation(q, q, q, is_causal=True) == "sm100"
  with fa4_jax.gpu_target("sm90", num_sms=114):  # an H100 PCIe
    assert sm90_forward.sm_count() == 114


@pytest.mark.parametrize("kwargs, argument", [
    (dict(arch="sm80"), "`arch`"), (dict(arch="sm90", num_sms=0), "`num_sms`"),
    (dict(arch="sm90", num_sms=1.5), "`num_sms`")])
def test_a_bad_target_names_the_argument(kwargs, argument):
  with pytest.raises(ValueError, match=argument):
    with fa4_jax.gpu_target(**kwargs):
      pass


@cpu_only
def test_asking_for_a_kernel_on_a_cpu_host_names_gpu_target():
  q = jnp.zeros(SHAPE, jnp.bfloat16)
  with pytest.raises(ValueError, match=r"fa4_jax.gpu_target\('sm100'\)"):
    fa4_jax.which_implementation(q, q, q, implementation="sm100")


@cpu_only
@pytest.mark.parametrize("platforms", [("cuda",), ("cuda", "cpu")])
def test_exporting_for_cuda_without_a_target_on_a_cpu_host_warns(platforms):
  with pytest.warns(UserWarning, match=r"XLA attention path.*gpu_target"):
    exp = export.export(jax.jit(attention), platforms=platforms)(SPEC, SPEC, SPEC)
  assert kernel_calls(exp) == 0


@cpu_only
def test_lowering_for_the_cpu_without_a_target_is_silent():
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    export.export(jax.jit(attention), platforms=("cpu",))(SPEC, SPEC, SPEC)


def test_a_kernel_chosen_for_this_hosts_gpu_cannot_be_exported_for_the_cpu(monkeypatch):
  """Without a target only the kernel is traced (no cost on a GPU host):
  lowering it for another platform says to use gpu_target."""
  monkeypatch.setattr(backends, "device_arch_major", lambda: 9)  # a Hopper host
  jax.clear_caches()
  with pytest.raises(ValueError, match=r"gpu_target\('sm90'\)"):
    export.export(jax.jit(attention), platforms=("cuda", "cpu"))(SPEC, SPEC, SPEC)
  jax.clear_caches()


def test_interpret_mode_stages_the_kernel_itself():
  """The interpreter runs on any platform: no CUDA/XLA split there."""
  q = jnp.zeros(SHAPE, jnp.bfloat16)
  call = backends.CallInfo(SHAPE, SHAPE, jnp.bfloat16, fa4_jax.MaskSpec(right=0),
                           has_bias=False, has_mask=False)
  with fa4_jax.interpret_mode():
    assert backends.select("sm90", call) is backends._arrangement("sm90", call)
    assert fa4_jax.which_implementation(q, q, q, is_causal=True,
                                        implementation="sm90") == "sm90"


SLOPES = jnp.asarray([0.25, 0.5])


def chunked(b, h, q_idx, kv_idx):
  return q_idx // 64 == kv_idx // 64


def test_mods_export_with_the_kernels_and_run_on_the_cpu():
  """score_mod and a block mask, exported for ("cuda", "cpu") under the sm90
  target: the kernels for CUDA (forward and fused backward), the XLA path on
  the CPU, gradients to the slopes too. The block mask is closed over (an
  exported function's arguments are arrays and registered pytrees; a
  BlockMask carries its Python mask_mod)."""
  block_mask = fa4_jax.create_block_mask(chunked, None, None, SHAPE[1], SHAPE[1])

  def loss(q, k, v, slopes, bm=block_mask):
    mod = lambda s, b, h, i, j: s - slopes[h] * (i - j).astype(jnp.float32)
    return fa4_jax.attention(q, k, v, is_causal=True, score_mod=mod,
                             block_mask=bm).astype(jnp.float32).sum()

  grads = jax.grad(loss, argnums=(0, 3))
  with fa4_jax.gpu_target("sm90"):
    exp = export.export(jax.jit(grads), platforms=("cuda", "cpu"))(
        SPEC, SPEC, SPEC, jax.ShapeDtypeStruct((2,), jnp.float32))
  assert kernel_calls(exp) >= 2
  q, k, v = inputs()
  got = round_trip(exp).call(q, k, v, SLOPES)
  i, j = jnp.arange(SHAPE[1])[:, None], jnp.arange(SHAPE[1])[None, :]

  def reference_loss(q, k, v, slopes):
    bias = (-slopes[:, None, None] * (i - j))[None]
    mask = ((j <= i) & (i // 64 == j // 64))[None, None]
    return jax.nn.dot_product_attention(
        q.astype(jnp.float32), k.astype(jnp.float32), v.astype(jnp.float32), bias, mask,
        implementation="xla").sum()

  want = jax.grad(reference_loss, argnums=(0, 3))(q, k, v, SLOPES)
  for g, w in zip(got, want):
    np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w), atol=ATOL,
                               rtol=ATOL)


def test_a_value_head_dim_of_its_own_exports_with_the_forward_kernel():
  v_spec = jax.ShapeDtypeStruct(SHAPE[:-1] + (128,), jnp.bfloat16)
  with fa4_jax.gpu_target("sm90"):
    exp = export.export(jax.jit(attention), platforms=("cuda", "cpu"))(SPEC, SPEC, v_spec)
  assert kernel_calls(exp) == 1
  q, k, _ = inputs()
  v = jax.random.normal(jax.random.key(5), v_spec.shape, jnp.bfloat16)
  out = round_trip(exp).call(q, k, v)
  q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
  logits = jnp.einsum("btnd,bsnd->bnts", q, k) / np.sqrt(SHAPE[-1])
  causal = jnp.tril(jnp.ones((SHAPE[1], SHAPE[1]), bool))
  want = jnp.einsum("bnts,bsnd->btnd", jax.nn.softmax(jnp.where(causal, logits, -jnp.inf)), v)
  assert out.shape == v.shape
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(want), atol=ATOL)
