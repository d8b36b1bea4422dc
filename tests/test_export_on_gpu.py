"""A module exported on a CPU host, served on a Hopper GPU (skipped elsewhere).

A subprocess that sees no GPU (`JAX_PLATFORMS=cpu`) exports the forward and
the gradients for ("cuda", "cpu") inside `fa4_jax.gpu_target("sm90")` and
serializes them; this process loads them on the GPU, checks that what XLA
compiles there runs the Mosaic GPU kernels, and compares the results with
`jax.nn.dot_product_attention`'s XLA path on the same GPU.
"""

import os
import pathlib
import subprocess
import sys

import jax
# A process that runs a deserialized module with Mosaic GPU kernels must
# import Mosaic GPU first: the import tells the custom call where its runtime
# library is (`MOSAIC_GPU_RUNTIME_LIB_PATH`); without it XLA fails to compile
# the module ("Symbols not found: mosaic_gpu_launch_kernel"). README, export.
import jax.experimental.mosaic.gpu  # noqa: F401
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from fa4_jax import backends
from reference import relative_error

pytestmark = pytest.mark.skipif(backends.device_arch_major() != 9, reason="needs a Hopper GPU")
pytest.importorskip("flatbuffers", reason="jax.export serialization needs flatbuffers "
                    "(pip install -e '.[test]')")

SHAPE = (2, 1000, 8, 128)  # [B, T, N, H]; T not a multiple of any block

EXPORT_ON_CPU = f"""
import sys
import jax, jax.numpy as jnp
from jax import export
import fa4_jax

assert jax.devices()[0].platform == "cpu"
spec = jax.ShapeDtypeStruct({SHAPE}, jnp.bfloat16)

def attention(q, k, v):
  return fa4_jax.attention(q, k, v, is_causal=True)

def grads(q, k, v, cotangent):
  loss = lambda q, k, v: jnp.sum(attention(q, k, v).astype(jnp.float32) * cotangent)
  return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

cotangent = jax.ShapeDtypeStruct({SHAPE}, jnp.float32)
with fa4_jax.gpu_target("sm90"):
  for name, fn, specs in (("forward", attention, (spec, spec, spec)),
                          ("grads", grads, (spec, spec, spec, cotangent))):
    exp = export.export(jax.jit(fn), platforms=("cuda", "cpu"))(*specs)
    open(f"{{sys.argv[1]}}/{{name}}.bin", "wb").write(exp.serialize())
"""


@pytest.fixture(scope="module")
def exported_on_cpu(tmp_path_factory):
  folder = tmp_path_factory.mktemp("exported")
  repo = pathlib.Path(__file__).resolve().parents[1]
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=os.pathsep.join(filter(None, [str(repo), os.environ.get("PYTHONPATH")])))
  subprocess.run([sys.executable, "-c", EXPORT_ON_CPU, str(folder)], env=env, check=True,
                 timeout=300)
  return {name: export.deserialize(bytearray((folder / f"{name}.bin").read_bytes()))
          for name in ("forward", "grads")}


def inputs():
  rng = np.random.default_rng(0)
  q, k, v = (jnp.asarray(rng.normal(size=SHAPE), jnp.bfloat16) for _ in range(3))
  return q, k, v, jnp.asarray(rng.normal(size=SHAPE), jnp.float32)


def reference(q, k, v):
  return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")


@pytest.mark.parametrize("name", ["forward", "grads"])
def test_the_gpu_compiles_the_kernels_of_a_module_exported_on_a_cpu(exported_on_cpu, name):
  q, k, v, cotangent = inputs()
  args = (q, k, v) if name == "forward" else (q, k, v, cotangent)
  compiled = jax.jit(exported_on_cpu[name].call).lower(*args).compile().as_text()
  assert "mosaic_gpu" in compiled


def test_a_module_exported_on_a_cpu_matches_the_xla_path_on_the_gpu(exported_on_cpu):
  q, k, v, cotangent = inputs()
  out = exported_on_cpu["forward"].call(q, k, v)
  # bf16 outputs of magnitude < 4: rounding 2^-7 at most.
  np.testing.assert_allclose(np.asarray(out, np.float32),
                             np.asarray(reference(q, k, v), np.float32), atol=2e-2)
  grads = exported_on_cpu["grads"].call(q, k, v, cotangent)
  f32 = [x.astype(jnp.float32) for x in (q, k, v)]
  loss = lambda q, k, v: jnp.sum(reference(q, k, v) * cotangent)  # noqa: E731
  for got, exact in zip(grads, jax.grad(loss, argnums=(0, 1, 2))(*f32)):
    # as tests/test_on_gpu.py: bf16 inputs and probabilities, ~3e-3 expected
    assert relative_error(got, exact) < 2e-2
