"""Compiling our kernels ahead, on worker threads (`fa4_jax.kernels.compile_ahead`).

On the CPU there is no CUDA device to compile for, so these tests check the
hooks' logic with a stand-in device and a recorded compile: which kernels
are queued, with what, and that jax's compile waits for the queue. The H100
test (`tests/test_compile_ahead_on_gpu.py`) checks that the workers'
compiles succeed and that XLA's compile finds them.
"""

import concurrent.futures
import hashlib
import threading
import types

import jax
import jax.numpy as jnp
import pytest
from jax._src import config

import fa4_jax
from fa4_jax.kernels import compile_ahead

SPEC = jax.ShapeDtypeStruct((1, 256, 2, 64), jnp.bfloat16)


def causal_grad(q, k, v):
  loss = lambda q, k, v: fa4_jax.attention(q, k, v, is_causal=True).astype(jnp.float32).sum()
  return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)


@pytest.fixture
def recorded_compiles(monkeypatch):
  """A stand-in Hopper device; `_compile` records its arguments instead."""
  calls = []
  monkeypatch.setattr(compile_ahead, "_local_cuda_device",
                      lambda: types.SimpleNamespace(compute_capability="9.0", id=0))
  monkeypatch.setattr(compile_ahead, "_submitted", {})
  monkeypatch.setattr(compile_ahead, "_events", [])
  monkeypatch.setattr(compile_ahead, "_compile", lambda device, values, signature, event:
                      calls.append((values, signature)) or True)
  monkeypatch.delenv(compile_ahead.ENV_SWITCH, raising=False)
  return calls


def test_every_kernel_of_a_grad_is_queued_with_its_custom_call(cross_lower,
                                                               recorded_compiles):
  lowered = cross_lower(causal_grad, SPEC, SPEC, SPEC)
  again = cross_lower(causal_grad, SPEC, SPEC, SPEC)
  compile_ahead.wait_for_all()
  assert len(lowered.modules) == len(again.modules) == 3
  # Mosaic GPU numbers each module it lowers (`mosaic_gpu.dump_basename`), so
  # a second lowering of the same kernels makes new modules: 6 compiles.
  assert len({values["kernel_hash"] for values, _ in recorded_compiles}) == 6
  names = sorted(m.split("@", 1)[1].split(" ", 1)[0] for m in lowered.modules)
  assert names == ["fa4_jax_sm90_dkdv", "fa4_jax_sm90_dq", "fa4_jax_sm90_forward"]
  # The benchmarks' timeline names each queued kernel, in lowering order.
  queued = [event["name"] for event in compile_ahead.timeline()]
  assert queued == 2 * ["fa4_jax_sm90_forward", "fa4_jax_sm90_dq", "fa4_jax_sm90_dkdv"]
  for values, (operand_types, result_types) in recorded_compiles:
    # Mosaic GPU's kernel cache is keyed by the SHA-256 of the module bytes.
    assert values["kernel_hash"] == hashlib.sha256(values["module"]).digest()
    assert values["module"].startswith(b"ML\xefR")  # MLIR bytecode
    assert operand_types[0] == "tensor<1x256x2x64xbf16>" and result_types
    program = str(compile_ahead.one_op_program(values, (operand_types, result_types)))
    assert "stablehlo.custom_call @mosaic_gpu_v2" in program
    for name in values:  # the kernel's whole backend config travels
      assert f"{name} = " in program


def test_nothing_is_queued_without_a_cuda_device_of_the_kernels_arch(cross_lower, monkeypatch):
  monkeypatch.setattr(compile_ahead, "_submitted", {})
  monkeypatch.setattr(compile_ahead, "_local_cuda_device", lambda: None)  # a CPU host
  on_cpu = cross_lower(causal_grad, SPEC, SPEC, SPEC)
  monkeypatch.setattr(compile_ahead, "_local_cuda_device",
                      lambda: types.SimpleNamespace(compute_capability="10.0", id=0))
  on_sm100 = cross_lower(causal_grad, SPEC, SPEC, SPEC)  # lowered for sm_90
  assert len(on_cpu.modules) == len(on_sm100.modules) == 3  # the hook saw them
  assert compile_ahead._submitted == {}


def test_nothing_is_queued_when_exporting(recorded_compiles):
  with fa4_jax.gpu_target("sm90"):  # the module is for a GPU elsewhere
    jax.export.export(jax.jit(causal_grad), platforms=("cuda",))(SPEC, SPEC, SPEC)
  assert recorded_compiles == [] and compile_ahead._submitted == {}


def test_the_switch_and_the_persistent_cache_turn_it_off(monkeypatch, tmp_path):
  monkeypatch.delenv(compile_ahead.ENV_SWITCH, raising=False)
  assert compile_ahead.enabled()
  monkeypatch.setenv(compile_ahead.ENV_SWITCH, "0")
  assert not compile_ahead.enabled()
  monkeypatch.delenv(compile_ahead.ENV_SWITCH)
  with config.enable_compilation_cache(True), config.compilation_cache_dir(str(tmp_path)):
    assert not compile_ahead.enabled()


def test_jax_compiles_a_program_only_after_the_queued_kernels(monkeypatch):
  compile_ahead.install()
  release = threading.Event()
  queued = concurrent.futures.ThreadPoolExecutor(1).submit(release.wait)
  monkeypatch.setattr(compile_ahead, "_submitted", {b"a kernel": queued})
  monkeypatch.setattr(compile_ahead, "_events", [])
  threading.Timer(0.3, release.set).start()
  jax.jit(lambda x: x * 3.0).lower(1.0).compile()  # any program, through jax's compile
  assert queued.done()
  [wait] = compile_ahead.timeline()
  assert wait["name"] == "wait" and wait["finished"] - wait["started"] >= 0.2
