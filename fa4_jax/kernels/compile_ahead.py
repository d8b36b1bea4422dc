"""Compile each of our Mosaic GPU kernels on a worker thread once it is lowered.

Why: a program's first call lowers it (Python: Pallas and Mosaic GPU turn
each kernel into a module), then XLA compiles it, and XLA compiles the
Mosaic GPU custom calls in it one after another (per kernel: Mosaic GPU's
passes to LLVM, LLVM's NVPTX backend, ptxas; about a second for our kernels
on an H100 host). `jax.grad` of attention holds three kernels (forward,
dK/dV, dQ), so that compile stage was most of its first call (issue #28).

Mosaic GPU keeps the kernels it compiles in a process-wide cache keyed by
the SHA-256 of the kernel's serialized module (`KernelCache` in jaxlib's
`mosaic/gpu/custom_call.cc`), and XLA's compile of the program looks there
first. So as soon as one of our kernels is lowered, a worker thread compiles
a one-op program holding the same custom call (same module bytes, same
hash) while the main thread goes on lowering the next kernel and the rest of
the program; XLA's own compile then finds the kernel compiled. The C++
compile runs without the GIL, so the threads overlap.

Only a warm-up of that cache: the program itself still carries the whole
kernel and compiles it if the worker has not finished (or failed). Nothing
here changes what runs on the GPU.

Runs only where a CUDA device of the kernel's architecture is present (not
when cross-lowering on a CPU host, `fa4_jax.gpu_target`), only for fa4_jax's
kernels (their bodies are named by `named`), not under `jax.export` (the
module is compiled elsewhere), and not while JAX's persistent compilation
cache is on. Off with `FA4_JAX_COMPILE_AHEAD=0`.

How it hooks in (jax is pinned; `tests/test_compile_ahead.py` checks both
hooks on the CPU): Pallas emits every Mosaic GPU kernel through
`jax.experimental.mosaic.gpu.core._mosaic_gpu_lowering_rule`, which `install`
wraps to queue the compile; and jax compiles every program through
`jax._src.compiler.backend_compile_and_load`, which `install` wraps to wait
for the queued compiles first, since XLA would otherwise compile a kernel a
worker has not finished a second time (Mosaic GPU's cache does not wait for
a compile under way).
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import threading
import time

NAME_PREFIX = "fa4_jax_"
ENV_SWITCH = "FA4_JAX_COMPILE_AHEAD"
MAX_WORKERS = 4

_lock = threading.Lock()
_installed = False
_submitted: dict[bytes, concurrent.futures.Future] = {}
# For benchmarks (`timeline`): per queued kernel its module name and the
# perf_counter times it was queued, started and finished; and the waits.
_events: list[dict] = []
_executor: concurrent.futures.ThreadPoolExecutor | None = None


def named(body, role: str):
  """`body` (a kernel body for `plgpu.kernel`) named so that this module
  recognizes its lowering: the name becomes the Mosaic GPU module's. Also
  installs the hook, before any of our kernels can be lowered."""
  install()
  body.__name__ = NAME_PREFIX + role
  return body


def enabled() -> bool:
  """On unless `FA4_JAX_COMPILE_AHEAD=0`, or JAX's persistent compilation
  cache is on: a program it holds is not compiled at all, and workers would
  compile its kernels for nothing (and hold up the process's exit)."""
  from jax._src import compilation_cache

  return (os.environ.get(ENV_SWITCH, "1") != "0"
          and not compilation_cache.is_persistent_cache_enabled())


def install() -> None:
  """Wraps Mosaic GPU's lowering rule and jax's backend compile (once per
  process)."""
  global _installed
  from jax._src import compiler
  from jax.experimental.mosaic.gpu import core as mgpu_core

  with _lock:
    if _installed:
      return
    _installed = True
  lowering_rule = mgpu_core._mosaic_gpu_lowering_rule

  def lowering_rule_then_compile_ahead(ctx, *args, module, **kwargs):
    outs = lowering_rule(ctx, *args, module=module, **kwargs)
    try:
      exporting = ctx.module_context.lowering_parameters.for_export  # compiled elsewhere
      if enabled() and not exporting and _is_ours(module) and len(outs):
        _submit(outs[0].owner, module)
    except Exception:  # noqa: BLE001 - a warm-up must never fail a lowering
      pass
    return outs

  backend_compile = compiler.backend_compile_and_load

  def backend_compile_after_workers(*args, **kwargs):
    # XLA would compile a kernel a worker is still compiling a second time
    # (Mosaic GPU's cache does not wait for a compile under way): wait.
    started = time.perf_counter()
    if wait_for_all():
      with _lock:
        _events.append(dict(name="wait", queued=started, started=started,
                            finished=time.perf_counter()))
    return backend_compile(*args, **kwargs)

  mgpu_core._mosaic_gpu_lowering_rule = lowering_rule_then_compile_ahead
  compiler.backend_compile_and_load = backend_compile_after_workers


def _is_ours(module) -> bool:
  return module_name(module).startswith(NAME_PREFIX)


def module_name(module) -> str:
  """The Mosaic GPU module's name (its kernel body's `__name__`)."""
  from jax._src.lib.mlir import ir

  return ir.StringAttr(module.operation.attributes["sym_name"]).value


@functools.cache
def _local_cuda_device():
  """A CUDA device of this process, or None (CPU host, cross-lowering)."""
  import jax

  try:
    devices = jax.devices("cuda")
  except RuntimeError:
    return None
  return devices[0] if devices else None


def _module_arch(module) -> str:
  from jax._src.lib.mlir import ir

  attrs = module.operation.attributes
  major = ir.IntegerAttr(attrs["mosaic_gpu.arch_major"]).value
  minor = ir.IntegerAttr(attrs["mosaic_gpu.arch_minor"]).value
  return f"{major}.{minor}"


def _submit(custom_call, module) -> None:
  """Queues the compile of `custom_call`'s kernel. (Each lowering makes a
  new module: Mosaic GPU numbers them in `mosaic_gpu.dump_basename`.)"""
  device = _local_cuda_device()
  if device is None or getattr(device, "compute_capability", None) != _module_arch(module):
    return
  found = custom_call_config(custom_call)
  if found is None:
    return
  values, signature = found
  kernel_hash = values["kernel_hash"]
  global _executor
  with _lock:
    if kernel_hash in _submitted:
      return
    if _executor is None:
      _executor = concurrent.futures.ThreadPoolExecutor(
          max_workers=min(MAX_WORKERS, max(1, (os.cpu_count() or 2) - 1)),
          thread_name_prefix="fa4_jax_compile_ahead")
    event = dict(name=module_name(module), queued=time.perf_counter())
    _events.append(event)
    _submitted[kernel_hash] = _executor.submit(_compile, device, values, signature, event)


def custom_call_config(custom_call):
  """(backend config values, (operand types, result types)) of a Mosaic GPU
  custom call, as `one_op_program` takes them; None if the config holds an
  attribute this version does not know, or no kernel hash or module."""
  from jax._src.lib.mlir import ir

  config = ir.DictAttr(custom_call.attributes["mhlo.backend_config"])
  values = {}
  for i in range(len(config)):
    entry = config[i]
    attr = entry.attr
    if isinstance(attr, ir.BoolAttr):
      values[entry.name] = attr.value
    elif isinstance(attr, ir.StringAttr):
      values[entry.name] = attr.value_bytes
    else:  # an attribute this version of the hook does not know: leave it
      return None
  if "kernel_hash" not in values or "module" not in values:
    return None
  signature = ([str(v.type) for v in custom_call.operands],
               [str(r.type) for r in custom_call.results])
  return values, signature


def one_op_program(values: dict, signature: tuple[list[str], list[str]]):
  """A module whose `main` is the Mosaic GPU custom call with `values` as
  its backend config (kernel hash, module bytes, flags), in a fresh context."""
  from jax._src.interpreters import mlir
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import func

  def row_major(types):
    return [list(reversed(range(ir.RankedTensorType(t).rank))) for t in types]

  context = mlir.make_ir_context()
  with context, ir.Location.unknown():
    operand_types = [ir.Type.parse(t) for t in signature[0]]
    result_types = [ir.Type.parse(t) for t in signature[1]]
    program = ir.Module.create()
    program.operation.attributes["sym_name"] = ir.StringAttr.get(NAME_PREFIX + "compile_ahead")
    with ir.InsertionPoint(program.body):
      main = func.FuncOp("main", (operand_types, result_types))
      main.attributes["sym_visibility"] = ir.StringAttr.get("public")
      with ir.InsertionPoint(main.add_entry_block()):
        config = {name: (ir.BoolAttr.get(v) if isinstance(v, bool) else ir.StringAttr.get(v))
                  for name, v in values.items()}
        call = mlir.custom_call(
            "mosaic_gpu_v2", result_types=result_types, operands=list(main.arguments),
            backend_config=config, api_version=4,
            operand_layouts=row_major(operand_types), result_layouts=row_major(result_types))
        func.ReturnOp(call.results)
  return program


def _compile(device, values, signature, event: dict) -> bool:
  """Compiles the one-op program on `device`'s backend; False on failure
  (the program's own compile then does the work, as without this module)."""
  event["started"] = time.perf_counter()
  try:
    import numpy as np
    from jax._src import compiler
    from jax._src.lib import xla_client as xc

    program = one_op_program(values, signature)
    options = compiler.get_compile_options(
        num_replicas=1, num_partitions=1, device_assignment=np.array([[device.id]]),
        backend=device.client)
    with program.context:  # the client itself: jax's wrapper waits for the workers
      device.client.compile_and_load(program, executable_devices=xc.DeviceList((device,)),
                                     compile_options=options)
    return True
  except Exception:  # noqa: BLE001 - a warm-up; the real compile reports errors
    return False
  finally:
    event["finished"] = time.perf_counter()


def outcomes() -> dict[str, int]:
  """How the compiles queued so far went: {"compiled", "failed", "running"}."""
  with _lock:
    futures = list(_submitted.values())
  done = [f for f in futures if f.done()]
  compiled = sum(1 for f in done if f.result())
  return dict(compiled=compiled, failed=len(done) - compiled, running=len(futures) - len(done))


def timeline(since: float = 0.0) -> list[dict]:
  """For benchmarks: each kernel queued so far (`name`: its module's) and
  each wait of a program's compile (`name` "wait"), with the seconds from
  `since` (a `time.perf_counter()` reading) to when it was queued, started
  and finished (None while not yet)."""
  def rel(t):
    return None if t is None else round(t - since, 4)

  with _lock:
    return [dict(name=e["name"], queued=rel(e["queued"]), started=rel(e.get("started")),
                 finished=rel(e.get("finished"))) for e in _events]


def wait_for_all() -> bool:
  """Blocks until every queued compile has finished; True if it had to wait."""
  with _lock:
    pending = [f for f in _submitted.values() if not f.done()]
  if pending:
    concurrent.futures.wait(pending)
  return bool(pending)
