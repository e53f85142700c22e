"""The figure of ``offload_gpu.py``'s results: what offload buys (capacity) and what it costs (TPOT).

Two panels side by side, each the offload bar against its all-on-GPU anchor, with the issue's
target drawn as a dashed line (capacity: 3x the anchor; TPOT: 1.5x the anchor), so the figure
says at a glance whether each target holds. A part that did not run leaves its panel empty.
"""

from __future__ import annotations

#: (field, anchor key, offload key, panel title, y label, target multiple of the anchor)
PANELS = (
    ("max_concurrent_128k", "no_offload", "offload", "concurrent 128K contexts, same GPU budget", "requests decoding at once", 3.0),
    ("tpot_ms_128k_c8", "gpu_only", "offload", "TPOT, 8 concurrent 128K contexts", "ms per output token", 1.5),
)


def plot(result: dict, path: str) -> None:
    """Write the two-panel bar figure of ``result`` (an ``offload_gpu`` results dict) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(9, 3.6))
    for ax, (field, anchor_key, offload_key, title, ylabel, target) in zip(axes, PANELS):
        anchor, offload = result[field][anchor_key], result[field][offload_key]
        ax.set_title(title, fontsize=9)
        ax.set_ylabel(ylabel)
        if anchor is None or offload is None:
            ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes)
            continue
        ax.bar([0, 1], [anchor, offload], color=["tab:gray", "tab:blue"])
        ax.set_xticks([0, 1], ["all K/V on GPU", "sparse offload"])
        ax.axhline(target * anchor, color="tab:red", linestyle="--", linewidth=1, label=f"target: {target:g}x anchor")
        ax.legend(fontsize=8, loc="upper left")
        ax.set_ylim(0, max(offload, target * anchor) * 1.25)
    hit_rate = result.get("block_cache_hit_rate")
    subtitle = f", block-cache hit rate {hit_rate:.2f}" if hit_rate is not None else ""
    fig.suptitle(f"sparse offload, mid-size M3 on {result['gpu']} (commit {result['commit']}){subtitle}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
