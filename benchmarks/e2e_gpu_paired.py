"""Decode of ours and upstream's M3 paired on the same GPUs: both servers live at once.

``e2e_gpu.py`` serves the two implementations one after the other, so its concurrency-1 row
compares two stretches of the machine's life. At concurrency 1 a graphed decode step of the
mid-size model is as long as the scheduler's host work per step (about 2.4 ms on the H100 for both
servers), and that host work ran at different speeds from one device call to the next: the same
server decoded lone requests at 2.38 ms in one call and at 2.65-3.03 ms in another, upstream's at
2.40 in one call and 2.52-2.65 in another (``results/e2e_gpu_h100.md``). Here both servers run
side by side (same flags, the KV pool capped by ``--max-total-tokens`` so two fit), each warmed
up, and groups of 2K-prompt requests (one request at concurrency 1, sixteen sent at once at 16)
alternate between them in ABBA order, so every pair of groups shares the machine's state of that
moment. Reported per concurrency: every group's mean TPOT, the median per server and the ratio of
medians, and the same for every group's mean TTFT (``group_ttft``; at concurrency 16 the e2e
benchmark's "TTFT of 16 2K prompts at once" row, paired). ``--tp 2 --ep 2`` pairs two TP2 + EP2 servers on two GPUs (about 23 GB of weights per
GPU each, so the pair fits two H100s; at TP1 the pair needs an H200). ``--against KEY=VALUE``
pairs ours with ours under that environment variable instead of upstream (an A/B of one of the
plugin's switches, e.g. ``SGLANG_M3_MOE_OVERLAP=0``).

``--draft chain3`` (or ``tree8``, ``chain7``, ``adaptive``) pairs ours with an EAGLE3 draft
against ours without one: the speculative benchmark's lm-head-copy draft and settings
(``speculative_gpu``), prompts from the draft's vocabulary for both servers, each server's greedy
output of the speculative benchmark's identity prompts compared, and each drafted server's
acceptance length measured (``accept_len`` by label; files written before 2026-11-29's seventh
session hold the first server's alone, a number). Its speed-up is the
TPOT without the draft over the TPOT with it, taken in the same minutes: the speculative
benchmark's servers run one after another, and its concurrency-1 ratio moved from 1.53x to 1.87x
between three device calls of one session on the H200 (``results/speculative_gpu_h200.md``).
With ``--against KEY=VALUE`` too, both servers have the draft and the second runs under the
variable: ``--draft chain3 --against SGLANG_M3_DENSE_VERIFY=sglang`` times the dense layers' verify
on SGLang's backend against the MSA kernels, the default (speed-up above 1: the default was faster).

``--ttft-tokens 32768 131072`` pairs time to first token the same way, one prompt of that length
at a time: each server's first prompt of the length is kept apart (``first_ttft_ms``: what a
server compiles or plans on first sight of the length, which a user's first such prompt pays),
then ``--rounds`` ABBA pairs.

A run cut short (a timeout's SIGTERM, a server that fails) still stops both servers and writes the
rounds both completed, under ``"complete": false`` (the report marks its rows "cut short"): a
device call's limit cut one such run after two of five rounds, and all of it was lost.

    scripts/gpu/run.sh exec python benchmarks/e2e_gpu_paired.py --out $OUT [--rounds 8] [--tp 2 --ep 2] [--concurrency 1 16] [--ttft-tokens 32768] [--against KEY=VALUE] [--draft chain3]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import signal
import statistics
import sys
import tempfile
import threading
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(__file__))
from host_probe import host_probe  # noqa: E402
from e2e_gpu import THROUGHPUT_OUTPUT, THROUGHPUT_PROMPT, gpu_name, plugin_switches, start_server, stop_server, warm_up  # noqa: E402
from provenance import commit  # noqa: E402
from midsize_m3 import midsize_text_config, write_midsize_checkpoint  # noqa: E402
from serving_client import random_prompt, run_group, stream_generate  # noqa: E402
from speculative_gpu import DRAFT_VOCAB, DRAFTS, IDENTITY_LENGTHS, IDENTITY_TOKENS, hot_prompt, speculative_args  # noqa: E402
from spec_requests import accept_length, generate, generate_concurrently  # noqa: E402  (on the path speculative_gpu sets)

#: KV slots per server: two pools fit on one H100 beside both models, and a 2K request needs few
KV_TOKENS_PER_SERVER = 262144


@dataclass(frozen=True)
class Contender:
    """One of the two servers: its label in the results, its implementation, extra environment and flags."""

    label: str
    impl: str
    env: dict = field(default_factory=dict)
    server_args: tuple[str, ...] = ()


#: the default pair; the first contender is always ours (``speedup_of_medians`` is second / first)
OURS_VS_UPSTREAM = (Contender("ours", "ours"), Contender("upstream", "upstream"))


def switch(against: str) -> tuple[str, str, str]:
    """``KEY=VALUE`` as ``(key, value, label part)``; the label part is also a file-name part."""
    key, sep, value = against.partition("=")
    if not sep or not key:
        raise ValueError(f"--against takes KEY=VALUE, got {against!r}")
    return key, value, "".join(ch if ch.isalnum() else "_" for ch in f"{key}_{value}")


def contenders(against: str | None) -> tuple[Contender, Contender]:
    """Ours against upstream, or (``against`` = ``KEY=VALUE``) ours against ours under that variable."""
    if against is None:
        return OURS_VS_UPSTREAM
    key, value, label = switch(against)
    return Contender("ours", "ours"), Contender(f"ours_{label}", "ours", {key: value})


def draft_contenders(draft: str, draft_dir: str, against: str | None = None) -> tuple[Contender, Contender]:
    """Ours with the EAGLE3 copy draft in ``draft``'s shape first (the speed-up is over it), ours
    without second; with ``against`` (``KEY=VALUE``), both with the draft and the second under
    that variable: an A/B of a switch of speculative serving (``SGLANG_M3_DENSE_VERIFY=sglang``)."""
    if draft not in DRAFTS or draft == "none":
        raise ValueError(f"--draft takes one of {[name for name in DRAFTS if name != 'none']}, got {draft!r}")
    drafted = Contender(draft, "ours", server_args=speculative_args(draft, draft_dir))
    if against is None:
        return drafted, Contender("none", "ours")
    key, value, label = switch(against)
    return drafted, Contender(f"{draft}_{label}", "ours", {key: value}, drafted.server_args)


def start_both(model_dir: str, out_dir: str, tp: int = 1, ep: int = 1, pair: tuple[Contender, ...] = OURS_VS_UPSTREAM) -> dict[str, tuple]:
    """Both servers started (start-up is not measured here), keyed by label; raises if either fails.

    On one GPU at once. Under tensor parallelism one after the other: each rank's start compares
    its GPU's free memory with the other ranks' (SGLang's ``_check_tp_memory_balance``), and the
    other server loading its weights at the same time made that check fail on the H200s
    ("memory capacity is unbalanced", 2026-11-30)."""
    started: dict[str, tuple] = {}
    errors: dict[str, BaseException] = {}

    def start(contender: Contender) -> None:
        try:
            started[contender.label] = start_server(
                contender.impl, model_dir, out_dir, tp, ep, label=f"paired-{contender.label}",
                extra_args=("--max-total-tokens", str(KV_TOKENS_PER_SERVER), *contender.server_args), env=contender.env,
            )
        except BaseException as error:  # reported below, after the other start ends
            errors[contender.label] = error

    if tp > 1:
        for contender in pair:
            if not errors:
                start(contender)
    else:
        threads = [threading.Thread(target=start, args=(contender,)) for contender in pair]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    if errors:
        for process, *_ in started.values():
            stop_server(process)
        raise RuntimeError(f"server start failed: {errors}")
    return started


def throughput_prompt(seed: int) -> list[int]:
    return random_prompt(THROUGHPUT_PROMPT, seed)


def per_label(urls: dict[str, str]) -> dict[str, list[float]]:
    return {label: [] for label in urls}


def paired_rounds(
    urls: dict[str, str], rounds: int, seed, concurrency: int = 1, make_prompt=throughput_prompt,
    tpot_ms: dict[str, list[float]] | None = None, ttft_ms: dict[str, list[float]] | None = None,
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """``rounds`` pairs of request groups in ABBA order over the two servers of ``urls`` (label ->
    URL, in pair order); each request gets its own prompt, ``make_prompt(seed)`` (by default a
    random one of the throughput length). Returns each group's mean TPOT and mean TTFT in ms per
    label (a group's TTFT at concurrency 16 is the e2e benchmark's "TTFT c16" row, paired),
    appended group by group to ``tpot_ms`` and ``ttft_ms`` where given, so that a run cut short
    keeps the groups it measured."""
    labels = list(urls)
    tpot_ms = per_label(urls) if tpot_ms is None else tpot_ms
    ttft_ms = per_label(urls) if ttft_ms is None else ttft_ms
    for round_index in range(rounds):
        order = labels if round_index % 2 == 0 else labels[::-1]
        for label in order:
            prompts = [make_prompt(next(seed)) for _ in range(concurrency)]
            group = run_group(urls[label], prompts, THROUGHPUT_OUTPUT)
            tpot_ms[label].append(group.mean_tpot_ms)
            ttft_ms[label].append(group.mean_ttft_ms)
        print(f"  c{concurrency} round {round_index}: " + ", ".join(
            f"{label} {tpot_ms[label][-1]:.2f} ms (ttft {ttft_ms[label][-1]:.1f})" for label in labels), flush=True)
    return tpot_ms, ttft_ms


def paired_ttft_rounds(
    urls: dict[str, str], rounds: int, seed, tokens: int,
    first: dict[str, float] | None = None, ttfts: dict[str, list[float]] | None = None,
) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Each server's first TTFT of a ``tokens``-token prompt (kept apart), then ``rounds`` pairs of
    lone prompts in ABBA order; returns (first TTFT, every later TTFT) in ms per label, filled in
    as measured into ``first`` and ``ttfts`` where given (see :func:`paired_rounds`)."""
    labels = list(urls)
    first = {} if first is None else first
    ttfts = per_label(urls) if ttfts is None else ttfts

    def ttft_ms(label: str) -> float:
        return 1e3 * stream_generate(urls[label], random_prompt(tokens, next(seed)), 1).ttft_s

    for label in labels:
        first[label] = ttft_ms(label)
    print(f"  {tokens}-token first ttft: " + ", ".join(f"{label} {first[label]:.1f} ms" for label in labels), flush=True)
    for round_index in range(rounds):
        for label in labels if round_index % 2 == 0 else labels[::-1]:
            ttfts[label].append(ttft_ms(label))
        print(f"  {tokens}-token round {round_index}: " + ", ".join(f"{label} {ttfts[label][-1]:.1f} ms" for label in labels), flush=True)
    return first, ttfts


def draft_checks(urls: dict[str, str], drafted: list[str]) -> dict:
    """Greedy output of the speculative benchmark's identity prompts on both servers (identical when
    the draft changes no token), and each drafted server's acceptance length over the same four
    concurrent requests, by label: in an A/B of a switch both servers draft, and the switch may
    change what they accept."""
    outputs = {label: {str(length): generate(url, hot_prompt(length, 7 + length, DRAFT_VOCAB), IDENTITY_TOKENS)["output_ids"]
                       for length in IDENTITY_LENGTHS}
               for label, url in urls.items()}
    first = drafted[0]
    reference = next(outputs[label] for label in urls if label != first)
    prompts = [hot_prompt(THROUGHPUT_PROMPT, 10**6 + i, DRAFT_VOCAB) for i in range(4)]
    accept = {label: accept_length(generate_concurrently(urls[label], prompts, 64)) for label in drafted}
    return {"greedy_identical": outputs[first] == reference, "accept_len": accept}


def summary(values: dict[str, list[float]], metric: str = "tpot_ms") -> dict:
    """Medians, their ratio (second over first, i.e. over ours: above 1 is ours faster) and the
    rounds ours won, for a lower-is-better ``metric``, over the rounds both servers completed."""
    (first, ours), (second, other) = values.items()
    ours, other = ours[:len(other)], other[:len(ours)]
    values = {first: ours, second: other}
    medians = {first: statistics.median(ours), second: statistics.median(other)}
    return {
        metric: values, f"median_{metric}": medians,
        "speedup_of_medians": medians[second] / medians[first],
        "rounds_ours_faster": sum(o < u for o, u in zip(ours, other)),
    }


def print_summary(what: str, s: dict, metric: str, form: str, rounds: int) -> None:
    """One line per :func:`summary` of ``metric``: each label's median, the speed-up, the rounds won."""
    print(f"{what}: " + ", ".join(f"{label} {form.format(value)} ms" for label, value in s[f"median_{metric}"].items()) + ", "
          f"speed-up {s['speedup_of_medians']:.3f}x; ours faster in {s['rounds_ours_faster']} of {rounds} rounds", flush=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for the result and the server logs")
    parser.add_argument("--rounds", type=int, default=8, help="ABBA pairs of request groups per concurrency")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel size of both servers")
    parser.add_argument("--ep", type=int, default=1, help="expert-parallel size of both servers (inside the TP group)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1], help="requests per group (default: 1)")
    parser.add_argument("--against", metavar="KEY=VALUE",
                        help="pair ours with ours under this environment variable, not upstream (with --draft: both drafted)")
    parser.add_argument("--draft", choices=[name for name in DRAFTS if name != "none"],
                        help="pair ours with the speculative benchmark's EAGLE3 copy draft in this shape against ours without")
    parser.add_argument("--ttft-tokens", type=int, nargs="*", default=[], help="prompt lengths whose TTFT is paired too (after decode)")
    args = parser.parse_args(argv)
    try:
        pair = contenders(args.against)
    except ValueError as error:
        parser.error(str(error))
    os.makedirs(args.out, exist_ok=True)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(f"stopped by signal {signum}"))
    model_dir = write_midsize_checkpoint(tempfile.mkdtemp(prefix="m3-midsize-"), 1, 3)
    make_prompt, checks = throughput_prompt, {}
    if args.draft:
        from midsize_draft import write_copy_draft

        draft_dir = write_copy_draft(tempfile.mkdtemp(prefix="m3-midsize-draft-"), midsize_text_config(1, 3), DRAFT_VOCAB)
        pair = draft_contenders(args.draft, draft_dir, args.against)
        make_prompt = functools.partial(hot_prompt, THROUGHPUT_PROMPT, draft_vocab=DRAFT_VOCAB)
    host = host_probe()  # before the servers start: the host's own speed and load
    servers = start_both(model_dir, args.out, args.tp, args.ep, pair)
    urls = {contender.label: servers[contender.label][1] for contender in pair}
    groups = {c: (per_label(urls), per_label(urls)) for c in args.concurrency}  # TPOT, TTFT per group
    lengths = {tokens: ({}, per_label(urls)) for tokens in args.ttft_tokens}  # first TTFT, later TTFTs
    complete = False
    try:
        seed = iter(range(10**6))
        for url in urls.values():
            warm_up(url, seed)
        if args.draft:
            checks.update(draft_checks(urls, [contender.label for contender in pair if contender.server_args]))
            print(f"draft checks: {checks}", flush=True)
        for c, (tpot, ttft) in groups.items():
            paired_rounds(urls, args.rounds, seed, c, make_prompt, tpot, ttft)
        for tokens, (first, ttfts) in lengths.items():
            paired_ttft_rounds(urls, args.rounds, seed, tokens, first, ttfts)
        complete = True
    finally:
        for process, *_ in servers.values():
            stop_server(process)
        # written whether the run ended or was cut (a timeout's SIGTERM, a server's failure): the
        # rounds both servers completed are kept, under "complete": false when cut
        path, by_concurrency, by_length = write_result(args, pair, host, checks, groups, lengths, complete)
    for c, s in by_concurrency.items():
        print_summary(f"c{c} median tpot", s, "tpot_ms", "{:.3f}", args.rounds)
        print_summary(f"c{c} median group ttft", s["group_ttft"], "ttft_ms", "{:.1f}", args.rounds)
    for tokens, s in by_length.items():
        print_summary(f"{tokens}-token median ttft", s, "ttft_ms", "{:.1f}", args.rounds)
    print(f"wrote {path}", flush=True)
    return 0


def measured(values: dict[str, list[float]]) -> bool:
    """Whether both servers completed at least one round."""
    return all(values.values())


def write_result(args, pair, host: dict, checks: dict, groups: dict, lengths: dict, complete: bool) -> tuple[str, dict, dict]:
    """The result file of what was measured: a concurrency or prompt length with no round that both
    servers completed is left out. Returns its path and the summaries by concurrency and length."""
    by_concurrency = {c: {**summary(tpot), "group_ttft": summary(ttft, "ttft_ms")} for c, (tpot, ttft) in groups.items() if measured(tpot)}
    by_length = {tokens: {"first_ttft_ms": first, **summary(ttfts, "ttft_ms")} for tokens, (first, ttfts) in lengths.items() if measured(ttfts)}
    result = {
        "gpu": gpu_name(), "commit": commit(), "switches": plugin_switches(), "host": host, "model": midsize_text_config(1, 3),
        "tp": args.tp, "ep": args.ep, "complete": complete,
        "what": f"mean TPOT of groups of {THROUGHPUT_PROMPT}-token-prompt requests with {THROUGHPUT_OUTPUT} output tokens, "
                f"both servers alive on the same GPUs, ABBA order, {args.rounds} rounds per concurrency"
                + (f"; TTFT of lone prompts of each length in ttft_prompt_tokens, {args.rounds} ABBA rounds after each server's first"
                   if by_length else "")
                + ("" if complete else "; cut short: the rounds both servers completed"),
        "max_total_tokens": KV_TOKENS_PER_SERVER,
        "pair": [{"label": c.label, "impl": c.impl, "env": c.env, "server_args": list(c.server_args)} for c in pair],
        **({"draft": args.draft, "draft_vocab": DRAFT_VOCAB, **checks} if args.draft else {}),
        "concurrency": {str(c): s for c, s in by_concurrency.items()},
        "ttft_prompt_tokens": {str(tokens): s for tokens, s in by_length.items()},
    }
    suffix = f"_{args.draft}_vs_{pair[1].label}" if args.draft else "" if args.against is None else f"_vs_{pair[1].label}"
    path = os.path.join(args.out, f"e2e_gpu_paired_tp{args.tp}_ep{args.ep}{suffix}.json")
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(result, handle, indent=2)
    return path, by_concurrency, by_length


if __name__ == "__main__":
    sys.exit(main())
