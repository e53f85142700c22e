"""What a tile's main pass reads, for chains of query tokens and for draft trees (shared by the kernels).

A decode tile holds one request's ``ntok`` query tokens from position ``pos0`` on. As a chain,
token ``t`` sits at ``pos0 + t`` and reads every key up to it. As a draft tree (speculative
verification of EAGLE trees), the tokens' positions follow their depths, not their order, so the
main pass over the paged blocks reads only the request's prefix (keys before ``pos0``), the same
for every token; each token's own path is added by a separate step that reads the tokens' slots.
"""

import triton
import triton.language as tl


@triton.jit
def main_pass_limits(pos0, ntok, t, TREE: tl.constexpr):
    """``(last key of the tile, last key of each row's token)``: the newest positions its main pass reads."""
    if TREE:
        last_pos = pos0 - 1
        row_pos = last_pos + 0 * t
    else:
        last_pos = pos0 + ntok - 1
        row_pos = pos0 + t
    return last_pos, row_pos
