"""fa4_jax: FlashAttention-4-style attention for JAX.

`fa4_jax.attention` is a drop-in for `jax.nn.dot_product_attention`: Pallas
Mosaic GPU kernels on Hopper and Blackwell GPUs, an exact memory-linear XLA
implementation everywhere else, one `jax.custom_jvp` for gradients.
"""

from fa4_jax.api import attention, create_block_mask, which_implementation
from fa4_jax.context_parallel import context_parallel_attention, load_balance, unload_balance
from fa4_jax.interpret import interpret_mode
from fa4_jax.kernels.autotune import autotune
from fa4_jax.paged import paged_attention, which_paged_implementation
from fa4_jax.scores import BlockMask, MaskSpec
from fa4_jax.target import gpu_target

__version__ = "0.1.0"
__all__ = ["attention", "which_implementation", "interpret_mode", "MaskSpec", "__version__",
           "context_parallel_attention", "load_balance", "unload_balance", "paged_attention",
           "which_paged_implementation", "gpu_target", "create_block_mask", "BlockMask",
           "autotune"]
