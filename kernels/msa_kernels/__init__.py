"""MSA (MiniMax Sparse Attention) kernels and their torch reference.

Depends on torch (and triton for the GPU kernels) only, never on SGLang, so it imports and
benchmarks on a GPU machine without SGLang installed.
"""

from msa_kernels.reference import MSAParams, block_scores, msa_attention, select_blocks, sparse_attention

__all__ = ["MSAParams", "block_scores", "msa_attention", "select_blocks", "sparse_attention"]
