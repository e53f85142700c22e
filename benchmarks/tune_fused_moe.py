"""Measure SGLang's Triton fused MoE tiles at M3's expert shapes and write the winners' table.

For each token count the M3 MoE block meets (decode batches up to 64, prefill graphs and chunks up
to 8,192 tokens) every candidate tile config runs SGLang's own ``fused_experts`` (both expert GEMMs
and M3's swiglu-oai between them) on random bf16 weights and uniformly random top-4 choices; the
fastest config wins, SGLang's heuristic default is always among the candidates, so a table entry is
never slower than what SGLang would pick. The table lands in ``--out`` (and with ``--install`` in
``sglang_m3/models/moe_kernel_configs/``, where the M3 MoE block reads it).

``--shared-slot`` tunes the shape the M3 MoE block serves decode-size batches with (up to its
``FUSED_SHARED_MAX_ROWS`` rows): the shared expert held in the fused layer as one more expert that
every token chooses (E=129, top-5, as upstream's). ``--ep N`` tunes one rank's share under expert parallelism: 128/N local experts, and each token's
top-4 drawn over all 128 experts with the other ranks' choices dropped (id -1, as SGLang's
dispatcher maps them), so a rank sees about 4/N of the choices. Upstream's M3 does not fuse its
shared expert under expert parallelism, so ``--upstream --ep N`` tunes the same shape and writes
it in SGLang's layout. ``--tp N`` tunes one tensor-parallel rank's slice: every expert's intermediate
size divided by N (with ``--ep``, the experts are split instead, as SGLang does inside the TP group).

Triton compiles one kernel per config and argument class, which dominates the run; worker
processes compile every candidate on small tensors of the same argument classes first (the cache
is shared), then one process times them at the real shape.

    scripts/gpu/run.sh exec python benchmarks/tune_fused_moe.py --out "$OUT" [--install] [--upstream] [--ep 2 | --tp 2]
    python benchmarks/tune_fused_moe.py --install-report REPORT...   # here, from the reports that came back
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import multiprocessing
import os
import sys
import tempfile
import time
import types
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

TOKENS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 2048, 4096, 8192)
TOP_K = 4
UPSTREAM_CONFIG_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "upstream_moe_configs")


def candidates(tokens: int, tma: bool = False) -> list[dict]:
    """Tile configs worth timing at this token count (small tiles for decode, large for prefill);
    with ``tma`` each also with ``USE_TMA`` (SGLang then reads the first GEMM's weights through
    Hopper's tensor descriptors; it honours the key in a per-call override too)."""
    if tokens <= 64:
        space = itertools.product([16], [32, 64, 128], [64, 128, 256], [1], [4], [3, 4])
    elif tokens <= 512:
        space = itertools.product([32, 64], [64, 128], [64, 128], [16], [4], [3, 4])
    else:
        space = itertools.product([64, 128], [128, 256], [64, 128], [16], [4, 8], [3, 4])
    keys = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps", "num_stages")
    tiles = [dict(zip(keys, values)) for values in space]
    return tiles + [{**tile, "USE_TMA": True} for tile in tiles] if tma else tiles


def publish_single_rank(model_dir: str) -> None:
    """SGLang's fused MoE reads its runtime context (execution flags, the TP group for symmetric
    memory); publish one for a single rank, as a server's scheduler would."""
    from sglang.srt.runtime_context import get_parallel, publish
    from sglang.srt.server_args import ServerArgs

    publish(ServerArgs(model_path=model_dir, skip_tokenizer_init=True, load_format="dummy"), role="scheduler")
    group = types.SimpleNamespace(world_size=1, rank_in_group=0)
    # Held for the process's life: the override undoes itself when its context object is collected.
    _SINGLE_RANK.append(get_parallel().override(tp_group=group, tp_size=1, tp_rank=0))
    _SINGLE_RANK[-1].__enter__()


_SINGLE_RANK: list = []


def rank_local_choices(tokens: int, local_experts: int, ep: int, device: str = "cuda"):
    """Rank 0's view of uniformly random distinct top-4 choices over ``local_experts * ep``
    experts: its own experts keep their ids, the other ranks' become -1 (dropped)."""
    import torch

    ids = torch.rand(tokens, local_experts * ep, device=device).argsort(dim=1)[:, :TOP_K].to(torch.int32)
    return torch.where(ids < local_experts, ids, torch.full_like(ids, -1))


class MoeCase:
    """Random weights and routing for one expert shape; ``run(tokens, config)`` is one MoE call."""

    def __init__(self, experts: int, intermediate: int, hidden: int, alpha: float, limit: float, shared_fused: bool = False,
                 ep: int = 1):
        import torch
        from sglang.srt.layers.moe.moe_runner import MoeRunnerConfig

        self.torch = torch
        generator = torch.Generator(device="cuda").manual_seed(0)
        self.w13 = torch.randn(experts, 2 * intermediate, hidden, device="cuda", dtype=torch.bfloat16, generator=generator) * 0.02
        self.w2 = torch.randn(experts, hidden, intermediate, device="cuda", dtype=torch.bfloat16, generator=generator) * 0.02
        self.experts, self.hidden = experts, hidden
        #: upstream's layout: the last expert is the shared one, chosen by every token (top-k + 1)
        self.shared_fused = shared_fused
        self.top_k = TOP_K + int(shared_fused)
        #: expert-parallel ranks: routing is over ``ep`` times this rank's routed experts
        self.ep = ep
        self.runner = MoeRunnerConfig(
            num_experts=experts, num_local_experts=experts, hidden_size=hidden, intermediate_size_per_partition=intermediate,
            top_k=self.top_k, params_dtype=torch.bfloat16, activation="silu", is_gated=True, inplace=False,
            gemm1_alpha=alpha, gemm1_clamp_limit=limit, gate_up_interleaved=False,
        )
        self.inputs = {}

    def batch(self, tokens: int):
        if tokens not in self.inputs:
            torch = self.torch
            x = torch.randn(tokens, self.hidden, device="cuda", dtype=torch.bfloat16)
            routed = self.experts - int(self.shared_fused)
            ids = rank_local_choices(tokens, routed, self.ep)
            if self.shared_fused:
                ids = torch.cat([ids, torch.full((tokens, 1), routed, device="cuda", dtype=torch.int32)], dim=1)
            weights = torch.rand(tokens, self.top_k, device="cuda", dtype=torch.float32)
            self.inputs[tokens] = (x, ids, weights / weights.sum(dim=1, keepdim=True))
        return self.inputs[tokens]

    def run(self, tokens: int, config: dict | None):
        from sglang.srt.layers.moe.fused_moe_triton import override_config
        from sglang.srt.layers.moe.moe_runner.triton_utils import fused_experts
        from sglang.srt.layers.moe.topk import StandardTopKOutput

        x, ids, weights = self.batch(tokens)
        topk = StandardTopKOutput(topk_weights=weights, topk_ids=ids, router_logits=None)
        with override_config(config):
            return fused_experts(x, self.w13, self.w2, topk, self.runner)

    def time_us(self, tokens: int, config: dict | None, reps: int) -> float:
        """Mean GPU time of one call (the server replays decode and small prefills as graphs too,
        and eager timing would measure launch overhead)."""
        return graph_us(lambda: self.run(tokens, config), [()], reps, replays=3)


def graph_us(call, sets: list[tuple], reps: int, replays: int = 5) -> float:
    """Mean GPU time of one ``call(*set)``, from CUDA-graph replays of ``reps`` calls cycling
    ``sets`` (two warm-up calls first: compilation and autotuning stay out of the capture)."""
    import torch

    for i in range(2):
        call(*sets[i % len(sets)])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            call(*sets[i % len(sets)])
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    del graph
    return 1e3 * start.elapsed_time(end) / (replays * reps)


def default_config(tokens: int, case: MoeCase) -> dict:
    from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config import get_default_config

    return get_default_config(tokens, case.experts, case.w2.shape[2], case.hidden, case.top_k, None, False)


#: the compile workers' intermediate size
SMALL_INTERMEDIATE = 256


def small_case(model_dir: str, alpha: float, limit: float, shared_fused: bool, ep: int) -> MoeCase:
    """In a compile worker: a published single rank and a case on small tensors of the same
    argument classes as the real shape (Triton specialises on those, not on the sizes)."""
    import torch

    publish_single_rank(model_dir)
    torch.set_grad_enabled(False)
    return MoeCase(experts=128 // ep + int(shared_fused), intermediate=SMALL_INTERMEDIATE, hidden=512, alpha=alpha, limit=limit,
                   shared_fused=shared_fused, ep=ep)


def try_each(calls) -> tuple[int, str]:
    """Run each ``(label, call)``; a tile too large for shared memory fails here and is skipped
    when timing too. Returns how many failed and the first error."""
    import torch

    failed, first_error = 0, ""
    for label, call in calls:
        try:
            call()
        except Exception as error:
            failed += 1
            first_error = first_error or f"{label}: {type(error).__name__}: {error}"[:500]
    torch.cuda.synchronize()
    return failed, first_error


def compile_share(args) -> tuple[int, str]:
    """Worker: run each (tokens, config) of its share once on a small case, filling the shared
    Triton cache."""
    *case_args, share = args
    small = small_case(*case_args)
    return try_each((f"M={tokens} {config}", functools.partial(small.run, tokens, config)) for tokens, config in share)


def install_report(path: str, root: str) -> str:
    """Write the table a report carries to its install path under ``root`` (the repository); the
    report is what comes back from the device, the table file (named with '=' and ',') is not."""
    with open(path, encoding="utf-8") as handle:
        report = json.load(handle)
    if "table" not in report or "installed_as" not in report:
        raise SystemExit(f"{path}: no 'table' / 'installed_as' (a report written before the tuner carried its table)")
    root = os.path.abspath(root)
    target = os.path.abspath(os.path.join(root, report["installed_as"]))
    if os.path.commonpath([target, root]) != root:
        raise SystemExit(f"{path}: installed_as {report['installed_as']!r} leaves the repository")
    os.makedirs(os.path.dirname(target), exist_ok=True)
    with open(target, "w", encoding="utf-8") as handle:
        json.dump(report["table"], handle, indent=1)
    return target


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="folder for the table and its report (required unless --install-report)")
    parser.add_argument("--install-report", nargs="+", metavar="REPORT",
                        help="no tuning: install the tables that these reports carry (no GPU needed)")
    parser.add_argument("--install", action="store_true", help="also write the table into sglang_m3/models/moe_kernel_configs/")
    parser.add_argument("--upstream", action="store_true", help="tune upstream M3's shape (shared expert fused: E=129, top-5) in SGLang's table layout")
    parser.add_argument("--shared-slot", action="store_true",
                        help="tune ours' decode shape with the shared expert in the fused layer (E=129, top-5; batches up to FUSED_SHARED_MAX_ROWS)")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel ranks: tune one rank's 128/ep local experts")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks without expert parallelism: tune one rank's intermediate slice")
    parser.add_argument("--tma", action="store_true", help="also time every tile with USE_TMA (Hopper tensor descriptors for the weights)")
    parser.add_argument("--workers", type=int, default=12, help="processes that compile the candidates")
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args(argv)
    if args.install_report:
        for path in args.install_report:
            print(f"installed {install_report(path, os.path.join(os.path.dirname(os.path.abspath(__file__)), '..'))}")
        return 0
    if not args.out:
        parser.error("--out is required to tune")

    import torch
    import triton
    from midsize_m3 import midsize_text_config, write_midsize_checkpoint

    from sglang_m3.models.moe_kernel_configs import CONFIG_DIR, table_name

    model = midsize_text_config(1, 3)
    if model["num_local_experts"] % args.ep:
        parser.error(f"--ep {args.ep} does not divide the {model['num_local_experts']} experts")
    if args.tp > 1 and args.ep > 1:
        parser.error("--tp and --ep are exclusive: under expert parallelism each rank holds whole experts")
    if model["intermediate_size"] % args.tp:
        parser.error(f"--tp {args.tp} does not divide the intermediate size {model['intermediate_size']}")
    if args.shared_slot and (args.upstream or args.ep > 1):
        parser.error("--shared-slot is ours' shape without expert parallelism (--upstream fuses its shared expert itself)")
    shared_fused = (args.upstream or args.shared_slot) and args.ep == 1  # neither fuses it under expert parallelism
    tokens_tuned = TOKENS
    if args.shared_slot:
        from sglang_m3.models.fused_moe import FUSED_SHARED_MAX_ROWS

        tokens_tuned = tuple(tokens for tokens in TOKENS if tokens <= FUSED_SHARED_MAX_ROWS)
    experts = model["num_local_experts"] // args.ep + int(shared_fused)
    intermediate, hidden = model["intermediate_size"] // args.tp, model["hidden_size"]
    alpha, limit = model["swiglu_alpha"], model["swiglu_limit"]
    model_dir = write_midsize_checkpoint(tempfile.mkdtemp(prefix="m3-tune-"), 1, 3)

    started = time.perf_counter()
    work = [(tokens, config) for tokens in tokens_tuned for config in candidates(tokens, args.tma)]
    shares = [work[i :: args.workers] for i in range(args.workers)]
    with ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("spawn")) as pool:
        outcomes = list(pool.map(compile_share, [(model_dir, alpha, limit, shared_fused, args.ep, share) for share in shares]))
    failed = sum(count for count, _ in outcomes)
    errors = [error for _, error in outcomes if error]
    print(f"compiled {len(work)} (tokens, config) pairs in {time.perf_counter() - started:.0f} s ({failed} failed)", flush=True)
    if errors:
        print(f"  first failure: {errors[0]}", flush=True)
    if failed == len(work):
        raise RuntimeError(f"no candidate ran: {errors[0]}")

    publish_single_rank(model_dir)
    torch.set_grad_enabled(False)
    case = MoeCase(experts, intermediate, hidden, alpha, limit, shared_fused=shared_fused, ep=args.ep)
    table, report = {}, []
    for tokens in tokens_tuned:
        baseline = default_config(tokens, case)
        timings = [(case.time_us(tokens, baseline, args.reps), baseline, "sglang default")]
        for config in candidates(tokens, args.tma):
            try:
                timings.append((case.time_us(tokens, config, args.reps), config, "candidate"))
            except Exception as error:  # out of resources for this tile
                print(f"  M={tokens} {config}: {type(error).__name__}", flush=True)
        best_us, best, _ = min(timings, key=lambda row: row[0])
        table[str(tokens)] = best
        report.append({"tokens": tokens, "default_us": timings[0][0], "best_us": best_us, "best": best})
        print(f"M={tokens:5d}: default {timings[0][0]:9.1f} us, best {best_us:9.1f} us ({timings[0][0] / best_us:.2f}x) {best}", flush=True)

    os.makedirs(args.out, exist_ok=True)
    if args.upstream:
        from sglang.srt.layers.moe.moe_runner.triton_utils.fused_moe_triton_config import get_config_file_name

        name = os.path.join("configs", f"triton_{triton.__version__.replace('.', '_')}", get_config_file_name(experts, intermediate, None))
        installed = os.path.join(UPSTREAM_CONFIG_DIR, name)
    else:
        name = table_name(experts, intermediate, hidden, torch.cuda.get_device_name(), triton.__version__)
        installed = os.path.join(CONFIG_DIR, name)
    # $OUT keeps a flat copy (the device hands back files at most two folders down)
    targets = [os.path.join(args.out, os.path.basename(name))] + ([installed] if args.install else [])
    for path in targets:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(table, handle, indent=1)
    report_name = f"tune_fused_moe{'_upstream' if args.upstream else ''}{'_shared_slot' if args.shared_slot else ''}{f'_ep{args.ep}' if args.ep > 1 else ''}{f'_tp{args.tp}' if args.tp > 1 else ''}_report.json"
    from provenance import commit
    with open(os.path.join(args.out, report_name), "w", encoding="utf-8") as handle:
        json.dump({"gpu": torch.cuda.get_device_name(), "commit": commit(), "triton": triton.__version__, "shape": [experts, intermediate, hidden],
                   "top_k": case.top_k, "shared_fused": shared_fused, "ep": args.ep, "tp": args.tp, "seconds": time.perf_counter() - started, "rows": report,
                   # the table again under its install path: the device hands back no file whose name has '=' or ','
                   "installed_as": os.path.relpath(installed, os.path.join(os.path.dirname(__file__), "..")), "table": table}, handle, indent=1)
    print(f"wrote {', '.join(targets)} in {time.perf_counter() - started:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
