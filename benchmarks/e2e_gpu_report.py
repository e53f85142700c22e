"""Merges the per-server results of ``e2e_gpu.py`` into the committed JSON, markdown and plot.

    python benchmarks/e2e_gpu_report.py RESULT_DIR [RESULT_DIR ...] [--note TEXT] [--results benchmarks/results]
        [--paired e2e_gpu_<gpu>_paired_tp<T>_ep<E>.json ...] [--notes e2e_gpu_<gpu>_notes.md]

Each ``RESULT_DIR`` holds ``e2e_gpu_<impl>_tp<T>_ep<E>.json`` files (one per server) and the
``standin_ops_<impl>.txt`` lists the harness wrote; where two folders hold the same server
(implementation, TP, EP), the later folder's wins, and every server keeps its own commit in
``servers``. ``--note`` records how the runs were made (e.g. servers from different device runs). The merged file
``e2e_gpu_<gpu>.json`` has one row per measurement with ``ours`` and ``upstream`` side by side;
a measurement only one server produced keeps ``null`` for the other.

``--paired`` adds the results of ``e2e_gpu_paired.py`` (both servers alive at once, ABBA) as their
own table, under ``paired`` in the JSON: they are a different workload from the rows (256 output
tokens, medians over rounds), so they never replace a row. ``--notes`` appends a markdown file of
notes on the runs (kept beside the results), so regenerating the table keeps them.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys
import tempfile
from functools import cache

from sglang_m3.inspect.decode_floor import peak_bandwidth


def gpu_key(name: str) -> str:
    match = re.search(r"(H100|H200|B200|A100)", name, re.IGNORECASE)
    return match.group(1).lower() if match else re.sub(r"\W+", "_", name).lower()


def load_servers(result_dirs: list[str]) -> list[dict]:
    servers = {}
    for result_dir in result_dirs:
        for path in sorted(glob.glob(os.path.join(result_dir, "e2e_gpu_*_tp*_ep*.json"))):
            with open(path, encoding="utf-8") as handle:
                server = json.load(handle)
            servers[(server["impl"], server["tp"], server["ep"])] = server
    if not servers:
        raise SystemExit(f"no e2e_gpu_<impl>_tp<T>_ep<E>.json under {', '.join(result_dirs)}")
    return sorted(servers.values(), key=lambda s: (s["tp"], s["ep"], s["impl"]))


def standin_ops(result_dirs: list[str]) -> dict[str, list[str]]:
    """Per implementation, every stand-in op that ran in any of the merged runs (their rows are
    merged too, so the list must cover each of them)."""
    ops: dict[str, set[str]] = {}
    for path in (p for d in result_dirs for p in sorted(glob.glob(os.path.join(d, "standin_ops_*.txt")))):
        impl = os.path.basename(path)[len("standin_ops_"):-len(".txt")]
        with open(path, encoding="utf-8") as handle:
            # each line: "<pid> <op>" (one line per op and process)
            ops.setdefault(impl, set()).update(line.strip().split(" ", 1)[-1] for line in handle if line.strip())
    return {impl: sorted(names) for impl, names in ops.items()}


def lone_request_runs(server: dict) -> dict:
    """``{"c1_runs": {"tpot_ms": [...], "host_loop_ms": [...]}}`` from the server's concurrency-1
    TPOT row where the benchmark recorded each lone request beside its host probe (older runs
    did not), else nothing."""
    for row in server["rows"]:
        if row["metric"] == "tpot_ms" and row["concurrency"] == 1 and row.get("host_loop_ms"):
            return {"c1_runs": {"tpot_ms": row["runs"], "host_loop_ms": row["host_loop_ms"]}}
    return {}


def merge(servers: list[dict], ops: dict[str, list[str]], note: str = "") -> dict:
    key = lambda row: (row["metric"], row["prompt_tokens"], row["concurrency"], row["tp"], row["ep"])  # noqa: E731
    rows: dict[tuple, dict] = {}
    for server in servers:
        for row in server["rows"]:
            merged = rows.setdefault(key(row), {**{k: row[k] for k in ("metric", "prompt_tokens", "concurrency", "tp", "ep")}, "ours": None, "upstream": None})
            merged[server["impl"]] = row["value"]
    ours = [s for s in servers if s["impl"] == "ours"]
    first = (ours or servers)[0]
    return {
        "gpu": first["gpu"],
        "commit": first["commit"],
        "note": note,
        "cuda_graphs": all(s["cuda_graphs"] for s in servers) and {s["impl"] for s in servers} == {"ours", "upstream"},
        "model": first["model"],
        "servers": [
            {**{k: s[k] for k in ("impl", "tp", "ep", "startup_s", "kv_tokens", "peak_gpu_memory_gb", "cuda_graphs", "quick", "commit")},
             "complete": s.get("complete", True),  # False: the run was cut short; its rows are what it measured
             **({"switches": s["switches"]} if s.get("switches") else {}),  # the SGLANG_M3_* / M3_HARNESS_* it ran under
             **({"host": s["host"]} if s.get("host") else {}),  # the host's speed and load before it started
             **({"reconstructed": s["reconstructed"]} if s.get("reconstructed") else {}),  # how a lost result file was rebuilt
             **lone_request_runs(s)}
            for s in servers
        ],
        "standin_ops": ops,
        "rows": sorted(rows.values(), key=lambda r: (r["tp"], r["ep"], r["metric"], r["prompt_tokens"], r["concurrency"])),
        "byte_minimum": byte_minimum(first["model"], first["gpu"], rows.values()),
    }


def byte_minimum(model: dict, gpu: str, rows) -> list[dict]:
    """For each concurrency-1 TPOT row: the step's byte minimum on ``gpu`` (the busiest rank's
    bf16 decode floor of ``sglang-m3 inspect`` at the prompt's length: the 256 output tokens add
    under 0.1% of the bytes) and each server's TPOT over it. Empty for a GPU whose bandwidth is not
    known."""
    rate = peak_bandwidth(gpu)
    entries = []
    for row in rows:
        if rate is None or row["metric"] != "tpot_ms" or row["concurrency"] != 1:
            continue
        step_bytes = decode_floor_bytes(json.dumps(model, sort_keys=True), row["tp"], row["ep"], row["prompt_tokens"])
        minimum = 1e3 * step_bytes / rate
        entries.append({
            **{k: row[k] for k in ("tp", "ep", "prompt_tokens", "concurrency")},
            "bytes_per_gpu": step_bytes, "minimum_ms": minimum,
            **{f"{impl}_over_minimum": row[impl] / minimum for impl in ("ours", "upstream") if row[impl]},
        })
    return sorted(entries, key=lambda e: (e["tp"], e["ep"]))


@cache
def decode_floor_bytes(model_json: str, tp: int, ep: int, context: int) -> int:
    """The busiest rank's bf16 decode floor of the served config (``model_json``, its config.json
    text), from the project's model classes built on the meta device for that layout."""
    from sglang_m3.inspect.report import inspect_config

    with tempfile.TemporaryDirectory(prefix="e2e-report-config-") as directory:
        with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as handle:
            handle.write(model_json)
        return inspect_config(directory, tp, ep, context=context)["per_rank"]["decode_floor"]["bf16"]["total"]


def load_paired(paths: list[str]) -> list[dict]:
    """One entry per (paired run, measurement): decode TPOT per concurrency and, where the run
    paired them, TTFT per prompt length; each with the pair's labels, medians, ratio and rounds won."""
    entries = []
    for path in paths:
        with open(path, encoding="utf-8") as handle:
            run = json.load(handle)
        common = {"file": os.path.basename(path), "commit": run["commit"], "tp": run["tp"], "ep": run["ep"],
                  "complete": run.get("complete", True)}  # False: cut short, the rounds both servers completed
        measured = [("tpot_ms", 2048, int(c), summary) for c, summary in run["concurrency"].items()]
        # a group's mean TTFT (2K prompts sent together), paired since the twelfth session's runs
        measured += [("ttft_ms", 2048, int(c), summary["group_ttft"]) for c, summary in run["concurrency"].items() if "group_ttft" in summary]
        measured += [("ttft_ms", int(tokens), 1, summary) for tokens, summary in run.get("ttft_prompt_tokens", {}).items()]
        for metric, prompt_tokens, concurrency, summary in measured:
            (first, first_ms), (second, second_ms) = summary[f"median_{metric}"].items()
            entries.append({
                **common, "metric": metric, "prompt_tokens": prompt_tokens, "concurrency": concurrency,
                "rounds": len(summary[metric][first]), "first": first, "second": second, "first_ms": first_ms, "second_ms": second_ms,
                "speedup_of_medians": summary["speedup_of_medians"], "rounds_first_faster": summary["rounds_ours_faster"],
                **({"first_prompt_ms": summary["first_ttft_ms"]} if "first_ttft_ms" in summary else {}),
            })
    return entries


def paired_markdown(entries: list[dict]) -> list[str]:
    lines = [
        "", "## Paired runs (`e2e_gpu_paired.py`: both servers alive on the same GPUs, requests alternating ABBA)", "",
        "Medians over the rounds; TPOT of 2K-token prompts with 256 output tokens; TTFT of lone prompts, after each "
        "server's first prompt of that length (in the last column, A / B).", "",
        "| commit | tp | ep | metric | prompt tokens | concurrency | A | B | A median ms | B median ms | B / A | rounds A faster | first prompt ms | file |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        cold = " / ".join(f"{ms:.0f}" for ms in e["first_prompt_ms"].values()) if "first_prompt_ms" in e else "-"
        lines.append(
            f"| {e['commit']} | {e['tp']} | {e['ep']} | {e['metric']} | {e['prompt_tokens']} | {e['concurrency']} | {e['first']} | {e['second']} | "
            f"{e['first_ms']:.2f} | {e['second_ms']:.2f} | {e['speedup_of_medians']:.2f}x | {e['rounds_first_faster']} of {e['rounds']} | {cold} | "
            f"{e['file']}{'' if e['complete'] else ' (cut short)'} |"
        )
    return lines


def byte_minimum_markdown(entries: list[dict]) -> list[str]:
    lines = [
        "", "Byte minimum of a concurrency-1 decode step (`sglang-m3 inspect`'s decode floor: the weights and cache "
        "the busiest GPU must read per token, with the chosen experts under expert parallelism spread as evenly as "
        "they can be, over its peak HBM bandwidth), against each server's TPOT:", "",
        "| tp | ep | prompt tokens | GB per GPU | minimum ms | ours / minimum | upstream / minimum |", "|---|---|---|---|---|---|---|",
    ]
    for e in entries:
        lines.append(
            f"| {e['tp']} | {e['ep']} | {e['prompt_tokens']} | {e['bytes_per_gpu'] / 1e9:.2f} | {e['minimum_ms']:.3f} | "
            f"{fmt_optional(e.get('ours_over_minimum'), '{:.2f}x')} | {fmt_optional(e.get('upstream_over_minimum'), '{:.2f}x')} |"
        )
    return lines


def ratio(row: dict) -> float | None:
    """How many times better ours is (lower is better for times, higher for throughput)."""
    ours, upstream = row["ours"], row["upstream"]
    if not ours or not upstream:
        return None
    return ours / upstream if row["metric"] == "output_tok_s" else upstream / ours


def fmt_optional(value, form: str) -> str:
    """``form`` applied to ``value``, or "-" where the value is unknown."""
    return "-" if value is None else form.format(value)


def commits_label(result: dict) -> str:
    """"commit X", or, where the servers ran at several commits, each with the TP/EP it served."""
    by_commit: dict[str, list[str]] = {}
    for server in result.get("servers", []):
        shape = f"TP{server['tp']}" + (f" + EP{server['ep']}" if server["ep"] > 1 else "")
        shapes = by_commit.setdefault(server["commit"], [])
        if shape not in shapes:
            shapes.append(shape)
    if len(by_commit) <= 1:
        return f"commit {result['commit']}"
    return "commits " + ", ".join(f"{commit} ({' / '.join(shapes)})" for commit, shapes in by_commit.items())


def markdown(result: dict, notes: str = "") -> str:
    fmt = lambda v: fmt_optional(v, "{:,.2f}")  # noqa: E731
    lines = [
        f"# End-to-end serving on {result['gpu']} ({commits_label(result)})",
        "",
        "Mid-size M3 at real widths (`benchmarks/midsize_m3.py`, random weights), served by SGLang 0.5.23 "
        "in the GPU harness with the same flags: **ours** = the sglang-m3 plugin, **upstream** = SGLang's own M3. "
        "Speed-up > 1 means ours is better (times: upstream/ours; throughput: ours/upstream).",
        "",
        *([result["note"], ""] if result.get("note") else []),
        "| metric | prompt tokens | concurrency | tp | ep | ours | upstream | speed-up |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        r = ratio(row)
        lines.append(
            f"| {row['metric']} | {row['prompt_tokens']} | {row['concurrency']} | {row['tp']} | {row['ep']} | "
            f"{fmt(row['ours'])} | {fmt(row['upstream'])} | {'-' if r is None else f'{r:.2f}x'} |"
        )
    lines += [
        "", "| server | commit | tp | ep | start-up s | KV tokens | peak GPU GB | CUDA graphs | complete |", "|---|---|---|---|---|---|---|---|---|"
    ]
    for s in result["servers"]:
        lines.append(
            f"| {s['impl']} | {s['commit']} | {s['tp']} | {s['ep']} | {s['startup_s']:.0f} | {s['kv_tokens']:,} | "
            f"{fmt_optional(s['peak_gpu_memory_gb'], '{:.1f}')} | {s['cuda_graphs']} | {'yes' if s['complete'] else 'no (cut short)'} |"
        )
    sections = (
        ("", "reconstructed", lambda value: value),
        ("Switches the servers ran under:", "switches", lambda value: ", ".join(f"`{k}={v}`" for k, v in value.items())),
        ("Hosts before each server started (`benchmarks/host_probe.py`; a slower probe, a slower scheduler):", "host",
         lambda value: f"{value['cpu']}, {value['cpus']} CPUs, load {value['load_avg_1m']:.2f}, Python probe {value['python_loop_ms']:.1f} ms"),
        ("Concurrency 1, each lone request's TPOT in the order they ran, with the host probe taken just before it:", "c1_runs",
         lambda value: ", ".join(f"{tpot:.2f} ms (probe {loop_ms:.0f} ms)" for tpot, loop_ms in zip(value["tpot_ms"], value["host_loop_ms"]))),
    )
    for heading, field, describe in sections:
        described = [f"- {s['impl']} tp{s['tp']} ep{s['ep']}: {describe(s[field])}" for s in result["servers"] if s.get(field)]
        lines += ["", *([heading, ""] if heading else []), *described] if described else []
    if result.get("byte_minimum"):
        lines += byte_minimum_markdown(result["byte_minimum"])
    lines += ["", "Ops that ran through the harness's `sgl_kernel` stand-ins (not SGLang's compiled kernels), in any of the merged runs:", ""]
    for impl, names in result["standin_ops"].items():
        lines.append(f"- {impl}: {', '.join(names) if names else 'none'}")
    if result.get("paired"):
        lines += paired_markdown(result["paired"])
    return "\n".join(lines) + "\n" + (f"\n{notes.rstrip()}\n" if notes else "")


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["rows"] if ratio(r) is not None]
    labels = [f"{r['metric']}\n{r['prompt_tokens'] // 1024}K c{r['concurrency']}" + (f" tp{r['tp']}ep{r['ep']}" if r["tp"] > 1 else "") for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(rows)), 4))
    ax.bar(range(len(rows)), [ratio(r) for r in rows], color="tab:blue")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("speed-up of sglang-m3 over upstream M3")
    ax.set_title(f"{result['gpu']}, {commits_label(result)}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("result_dirs", nargs="+")
    parser.add_argument("--note", default="", help="how the runs were made, recorded in the JSON and the markdown")
    parser.add_argument("--results", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--paired", nargs="+", default=[], help="e2e_gpu_paired.py results to add as their own table")
    parser.add_argument("--notes", help="markdown file of notes on the runs, appended to the markdown")
    args = parser.parse_args(argv)
    notes = ""
    if args.notes:
        with open(args.notes, encoding="utf-8") as handle:
            notes = handle.read()
    result = merge(load_servers(args.result_dirs), standin_ops(args.result_dirs), args.note)
    if args.paired:
        result["paired"] = load_paired(args.paired)
    stem = os.path.join(args.results, f"e2e_gpu_{gpu_key(result['gpu'])}")
    with open(stem + ".json", "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=2)
    with open(stem + ".md", "w", encoding="utf-8") as handle:
        handle.write(markdown(result, notes))
    plot(result, stem + ".png")
    print(markdown(result, notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
