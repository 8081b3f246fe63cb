"""jax_flashattn: exact, memory-efficient attention for JAX as XLA FFI custom calls.

    out = jax_flashattn.flash_attention(q, k, v, is_causal=True)          # native API
    out, lse = jax_flashattn.flash_attention(q, k, v, return_lse=True)    # differentiable LSE
    out = jax_flashattn.dot_product_attention(q, k, v, is_causal=True)    # jax.nn drop-in
    out = jax_flashattn.varlen_attention(q, k, v, cu_q, cu_k, max_seqlen_q=..., max_seqlen_k=...)
    out = jax_flashattn.context_parallel_attention(q, k, v, axis_name="cp")  # inside shard_map
    out = jax_flashattn.flash_attention(q, k, v, mask=jax_flashattn.pack_mask(mask))  # bit-packed
    out = jax_flashattn.sparse_attention(q, k, v, indices)                # top-k sparse (DSA)
    out = jax_flashattn.paged_attention(q, k_pages, v_pages, block_table, seq_lengths)  # paged KV
"""
import pkgutil

# Run from a source checkout (`python -m jax_flashattn` or `python -m pytest` in the repo root put
# it first on sys.path), this package shadows the installed one, which alone holds the compiled
# extension: let submodule imports also search the installed copy.
__path__ = pkgutil.extend_path(__path__, __name__)

from . import batching as _batching  # noqa: F401  (registers the vmap rules)
from . import sharding as _sharding  # noqa: F401  (registers the partitioned lowerings)
from . import _sparse_sharding  # noqa: F401  (registers the sparse primitives' partitioned lowerings)
from . import _paged_sharding  # noqa: F401  (registers the paged forward's partitioned lowering)
from ._ext import build_info, export_disabled_checks
from ._version import __version__
from .attention import flash_attention
from .autodiff import CHECKPOINT_NAME
from .context_parallel import context_parallel_attention, load_balance
from .dropin import dot_product_attention
from .masks import PackedMask, block_mask, pack_mask
from .paged import paged_attention
from .sparse import attn_dist, sparse_attention
from .varlen import varlen_attention

__all__ = ["flash_attention", "dot_product_attention", "varlen_attention",
           "context_parallel_attention", "load_balance", "PackedMask", "pack_mask", "block_mask",
           "sparse_attention", "attn_dist", "paged_attention",
           "CHECKPOINT_NAME", "export_disabled_checks", "build_info", "__version__"]
