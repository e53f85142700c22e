"""Measure the down-projection table that SGLang's fused MoE reads beside its up table.

SGLang 0.5.23 looks for a second file next to a tuned table, the same name ending in ``_down.json``:
its entries serve the second GEMM, and ``"USE_TMA": true`` there has that GEMM read the sorted
intermediate through Hopper's tensor-memory-accelerator descriptors. Without the file SGLang reuses
the up tile for the second GEMM, without TMA, and logs "Down MoE config file not found ...
Performance might be sub-optimal". Upstream's M3 reads its tables through that lookup, so its
anchor is at its best only with this file too. (The M3 plugin hands one tile per call through
``override_config``, which leaves SGLang no down table: this tunes upstream's shape only.)

For each token count the up tile stays the installed up table's (``tune_fused_moe.py --upstream``
first), and each candidate for the second GEMM, with and without TMA, its ``BLOCK_SIZE_M`` tied to
the up tile's (both GEMMs share one alignment sort, SGLang enforces it), runs through SGLang's own
file lookup in a scratch config folder. The baseline is SGLang without the file. The table lands in
``--out`` and its report; ``--install`` also writes it beside the up table under
``benchmarks/upstream_moe_configs/``.

    scripts/gpu/run.sh exec python benchmarks/tune_fused_moe_down.py --out "$OUT" [--install] [--ep 2 | --tp 2]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import multiprocessing
import os
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from sglang_m3.models.moe_kernel_configs import nearest  # noqa: E402
from tune_fused_moe import (  # noqa: E402
    SMALL_INTERMEDIATE, TOKENS, UPSTREAM_CONFIG_DIR, MoeCase, candidates, publish_single_rank, small_case, try_each,
)

TRITON_DIR = "triton_{}"


def down_candidates(tokens: int, block_m: int) -> list[dict]:
    """Tiles for the second GEMM at this token count: the up tile's ``BLOCK_SIZE_M`` (both GEMMs
    share one alignment sort), every other dimension as the up tuner's, each with and without TMA."""
    tiles = {tuple(sorted({**tile, "BLOCK_SIZE_M": block_m}.items())) for tile in candidates(tokens)}
    return [{**dict(tile), "USE_TMA": tma} for tile in sorted(tiles) for tma in (False, True)]


def up_table_path(experts: int, intermediate: int, triton_version: str) -> str:
    """Where ``tune_fused_moe.py --upstream --install`` put upstream's up table for this shape."""
    from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config import get_config_file_name

    return os.path.join(UPSTREAM_CONFIG_DIR, "configs", TRITON_DIR.format(triton_version.replace(".", "_")),
                        get_config_file_name(experts, intermediate, None))


@contextlib.contextmanager
def sglang_lookup(folder: str, triton_version: str, experts: int, intermediate: int, up: dict, down: dict | None):
    """SGLang's own table lookup (``SGLANG_MOE_CONFIG_DIR``) seeing exactly ``up`` and ``down``
    (None: no down file) for this shape, its cache of earlier lookups cleared on the way in and out."""
    from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config import get_config_file_name, get_moe_configs

    tables = os.path.join(folder, "configs", TRITON_DIR.format(triton_version.replace(".", "_")))
    os.makedirs(tables, exist_ok=True)
    for name, table in ((get_config_file_name(experts, intermediate, None), up),
                        (get_config_file_name(experts, intermediate, None, down_moe=True), down)):
        path = os.path.join(tables, name)
        if table is None:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
            continue
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(table, handle)
    previous = os.environ.get("SGLANG_MOE_CONFIG_DIR")
    os.environ["SGLANG_MOE_CONFIG_DIR"] = folder
    get_moe_configs.cache_clear()
    try:
        yield
    finally:
        get_moe_configs.cache_clear()
        if previous is None:
            os.environ.pop("SGLANG_MOE_CONFIG_DIR", None)
        else:
            os.environ["SGLANG_MOE_CONFIG_DIR"] = previous


def compile_share(args) -> tuple[int, str]:
    """Worker: run each (tokens, up tile, down tile) of its share once on a small case through the
    lookup, filling the shared Triton cache (compiling ~600 variants one after another would take
    most of a device call)."""
    *case_args, share = args
    small = small_case(*case_args)
    scratch = tempfile.mkdtemp(prefix="m3-moe-tables-")

    def run(tokens: int, up_tile: dict, down_tile: dict) -> None:
        import triton

        with sglang_lookup(scratch, triton.__version__, small.experts, SMALL_INTERMEDIATE, {str(tokens): up_tile}, {str(tokens): down_tile}):
            small.run(tokens, None)

    return try_each((f"M={tokens} {down}", functools.partial(run, tokens, up, down)) for tokens, up, down in share)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--install", action="store_true", help="also write the table beside upstream's up table")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel ranks: one rank's 128/ep local experts")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks without expert parallelism")
    parser.add_argument("--workers", type=int, default=12, help="processes that compile the candidates")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args(argv)
    if args.tp > 1 and args.ep > 1:
        parser.error("--tp and --ep are exclusive: under expert parallelism each rank holds whole experts")

    import torch
    import triton
    from midsize_m3 import midsize_text_config, write_midsize_checkpoint

    model = midsize_text_config(1, 3)
    shared_fused = args.ep == 1  # upstream fuses its shared expert only without expert parallelism
    experts = model["num_local_experts"] // args.ep + int(shared_fused)
    intermediate, hidden = model["intermediate_size"] // args.tp, model["hidden_size"]
    up_path = up_table_path(experts, intermediate, triton.__version__)
    if not os.path.exists(up_path):
        parser.error(f"no up table at {up_path}: run tune_fused_moe.py --upstream --install with the same --ep/--tp first")
    with open(up_path, encoding="utf-8") as handle:
        up = json.load(handle)
    up_tiles = {tokens: nearest({int(measured): tile for measured, tile in up.items()}, tokens) for tokens in TOKENS}

    started = time.perf_counter()
    model_dir = write_midsize_checkpoint(tempfile.mkdtemp(prefix="m3-tune-"), 1, 3)
    work = [(tokens, up_tiles[tokens], tile) for tokens in TOKENS for tile in down_candidates(tokens, up_tiles[tokens]["BLOCK_SIZE_M"])]
    shares = [work[i :: args.workers] for i in range(args.workers)]
    with ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        outcomes = list(pool.map(compile_share, [(model_dir, model["swiglu_alpha"], model["swiglu_limit"], shared_fused, args.ep, share)
                                                 for share in shares]))
    failed = sum(count for count, _ in outcomes)
    print(f"compiled {len(work)} (tokens, down tile) pairs in {time.perf_counter() - started:.0f} s ({failed} failed)", flush=True)
    if failed == len(work):
        raise RuntimeError(f"no candidate ran: {next(error for _, error in outcomes if error)}")
    publish_single_rank(model_dir)
    torch.set_grad_enabled(False)
    case = MoeCase(experts, intermediate, hidden, model["swiglu_alpha"], model["swiglu_limit"], shared_fused=shared_fused, ep=args.ep)
    scratch = tempfile.mkdtemp(prefix="m3-moe-tables-")
    table, report = {}, []
    for tokens in TOKENS:
        up_tile = up_tiles[tokens]
        with sglang_lookup(scratch, triton.__version__, experts, intermediate, up, None):
            without_us = case.time_us(tokens, None, args.reps)
        timings = [(without_us, None)]
        for tile in down_candidates(tokens, up_tile["BLOCK_SIZE_M"]):
            try:
                with sglang_lookup(scratch, triton.__version__, experts, intermediate, up, {str(tokens): tile}):
                    timings.append((case.time_us(tokens, None, args.reps), tile))
            except Exception as error:  # out of resources for this tile
                print(f"  M={tokens} {tile}: {type(error).__name__}", flush=True)
        best_us, best = min(timings, key=lambda row: row[0])
        # no file entry beats every candidate: the up tile without TMA, written out, is SGLang's own fallback
        table[str(tokens)] = best or {**up_tile, "USE_TMA": False}
        report.append({"tokens": tokens, "without_down_us": without_us, "best_us": best_us, "best": table[str(tokens)]})
        print(f"M={tokens:5d}: without {without_us:9.1f} us, best {best_us:9.1f} us ({without_us / best_us:.2f}x) {table[str(tokens)]}", flush=True)

    from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config import get_config_file_name

    installed = os.path.join(os.path.dirname(up_path), get_config_file_name(experts, intermediate, None, down_moe=True))
    os.makedirs(args.out, exist_ok=True)
    if args.install:
        with open(installed, "w", encoding="utf-8") as handle:
            json.dump(table, handle, indent=1)
    report_name = f"tune_fused_moe_down{f'_ep{args.ep}' if args.ep > 1 else ''}{f'_tp{args.tp}' if args.tp > 1 else ''}_report.json"
    from provenance import commit
    with open(os.path.join(args.out, report_name), "w", encoding="utf-8") as handle:
        json.dump({"gpu": torch.cuda.get_device_name(), "commit": commit(), "triton": triton.__version__, "shape": [experts, intermediate, hidden],
                   "top_k": case.top_k, "shared_fused": shared_fused, "ep": args.ep, "tp": args.tp,
                   "seconds": time.perf_counter() - started, "rows": report,
                   "installed_as": os.path.relpath(installed, os.path.join(os.path.dirname(__file__), "..")), "table": table},
                  handle, indent=1)
    print(f"wrote {os.path.join(args.out, report_name)}{f' and {installed}' if args.install else ''} in {time.perf_counter() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
