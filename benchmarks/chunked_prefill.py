"""What a long prompt does to the streams that are decoding, with and without chunked prefill, through a
real `dsv3 serve` process (`--max-prefill-tokens N`; 0 prefills whole prompts; `N/P` adds
`--prefill-threads P`: the prompt is prefilled on P threads of its own beside the decode steps).

A random-weight checkpoint (the ``small`` shape with ``--layers`` layers, no MTP layer, bf16, a context of
8,192 positions) is saved to a temporary folder. For each of ``--configs`` a server is started; ``--streams``
requests stream their replies (short prompts, every token's arrival timed); after ``--warmup-s`` seconds a
``--long-prompt``-token prompt arrives. Its time to first token (TTFT) is timed, and the streams' time per
output token (TPOT: the gap between two tokens of a stream) is summed up in two windows: before it arrived
(the undisturbed decode) and from its arrival to its first token (while it is prefilled). The streams are
closed ``--tail-s`` seconds after that first token.

    .venv/bin/python benchmarks/chunked_prefill.py --json > /tmp/chunked.json

writes docs/figures/chunked_prefill.png (TPOT and TTFT over time, one panel per server; docs/inference.md
shows it) and prints the table, or the JSON for benchmarks/record_result.py
(benchmarks/results/chunked_prefill.json).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from dsv3.config import preset
from dsv3.infer.bench_serve import make_prompts, model_card, percentile, stream_completion
from dsv3.io import save_figure
from dsv3.model import Transformer
from dsv3.option_lists import parse_list
from serve_prefix_cache import server_command, start_server, write_word_tokenizer

ROOT = Path(__file__).resolve().parents[1]
FIGURE = ROOT / "docs" / "figures" / "chunked_prefill.png"
STREAM_TOKENS = 4000  # more than the streams live for (they are closed --tail-s after the long prompt's first token)


def save_checkpoint(folder: Path, layers: int) -> None:
    """The random checkpoint, with a word per token (``write_word_tokenizer``): the server streams a chunk per
    token only when the token has text."""
    torch.manual_seed(0)
    cfg = dataclasses.replace(preset("small"), num_hidden_layers=layers, num_nextn_predict_layers=0,
                              torch_dtype="bfloat16", max_position_embeddings=8192)
    Transformer(cfg).to(torch.bfloat16).save_pretrained(folder)
    write_word_tokenizer(folder, cfg.vocab_size)


def one_run(url: str, args) -> dict:
    """The streams, the long prompt arriving among them, and every token's arrival time (seconds after it)."""
    card = model_card(url)
    vocab, model = card["vocab_size"], card["id"]
    short = make_prompts(args.streams, 16, 0, vocab, seed=1)
    long_prompt = make_prompts(1, args.long_prompt, 0, vocab, seed=2)[0]
    arrivals: list[list[float]] = [[] for _ in short]
    errors: list[str] = []
    stop_at = [float("inf")]

    def stream(i: int) -> None:
        def on_token(now: float) -> bool:
            arrivals[i].append(now)
            return now < stop_at[0]

        out = stream_completion(url, model, short[i], STREAM_TOKENS, 600, on_token)
        if not out.ok:
            errors.append(out.error)

    threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(len(short))]
    for t in threads:
        t.start()
    while not all(arrivals):
        if errors:
            raise SystemExit(f"a stream failed: {errors[0]}")
        time.sleep(0.01)
    time.sleep(args.warmup_s)
    sent = time.perf_counter()
    long_tokens: list[float] = []
    out = stream_completion(url, model, long_prompt, 4, 600, lambda now: long_tokens.append(now) or True)
    if not out.ok:
        raise SystemExit(f"the long prompt failed: {out.error}")
    first = long_tokens[0]
    stop_at[0] = first + args.tail_s
    for t in threads:
        t.join(timeout=600)
    gaps = [(b - sent, 1000 * (b - a)) for times in arrivals for a, b in zip(times, times[1:], strict=False)]
    return {"ttft_ms": 1000 * (first - sent), "gaps": gaps}


def summary(run: dict) -> dict:
    """TPOT before the long prompt arrived, and of the gaps that overlap its prefill (arrival to first token).
    The p99 before it arrived is the host's own spread of undisturbed steps: the floor under the p99 during.
    The goal's ratio (p99 during over the median before) is the product of two: how far the streams' typical
    step was held above its median before (``median_during_over_median_before``, what the riders' pace aims at)
    and the spread of the steps while the prompt is prefilled (``p99_during_over_median_during``)."""
    before = [ms for end, ms in run["gaps"] if end < 0]
    during = [ms for end, ms in run["gaps"] if end > 0 and end - ms / 1000 < run["ttft_ms"] / 1000]  # overlaps it
    median = statistics.median(before)
    p99 = percentile(during, 99) or median
    median_during = statistics.median(during) if during else median
    return {"ttft_ms": run["ttft_ms"], "tpot_ms_median_before": median, "tpot_ms_p99_during": p99,
            "tpot_ms_max_during": max(during, default=median), "p99_during_over_median": p99 / median,
            "p99_before_over_median": (percentile(before, 99) or median) / median,
            "tpot_ms_median_during": median_during, "median_during_over_median_before": median_during / median,
            "p99_during_over_median_during": p99 / median_during, "tokens_during": len(during)}


def server_flags(config: str) -> tuple[str, ...]:
    """``dsv3 serve`` flags of a ``--configs`` entry: ``N`` or ``N/P`` (``--max-prefill-tokens N``, and
    ``--prefill-threads P``)."""
    n, _, p = config.partition("/")
    return ("--max-prefill-tokens", n) + (("--prefill-threads", p) if p else ())


def describe(config: str) -> str:
    """A panel's title: the server's flags and what they do."""
    flags = server_flags(config)
    if "--prefill-threads" in flags:
        return f"{' '.join(flags)}\n(prefilled beside the decode steps)"
    return f"{' '.join(flags)} ({'whole prompts' if flags[1] == '0' else 'chunks riding the decode steps'})"


def plot(runs: dict[str, dict], path: Path, long_prompt: int, streams: int) -> None:
    """One panel per server configuration: every gap between two tokens of a stream as a segment over
    the time it lasted, the long prompt's prefill (arrival to first token: its TTFT) shaded, and 3x the
    median TPOT before it arrived (the goal); one legend under the panels, so that it hides no data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(runs), figsize=(5.2 * len(runs), 4.6), sharey=True, squeeze=False)
    for ax, (n, run) in zip(axes[0], runs.items(), strict=True):
        s = summary(run)
        end, ms = (list(x) for x in zip(*run["gaps"], strict=True))
        ax.hlines(ms, [e - m / 1000 for e, m in zip(end, ms, strict=True)], end, color="tab:blue", linewidth=2,
                  label=f"TPOT of the {streams} decoding streams (each gap between two tokens, over its time)")
        ax.axvspan(0, s["ttft_ms"] / 1000, color="tab:orange", alpha=0.15,
                   label=f"the {long_prompt:,}-token prompt's prefill, from its arrival to its first token (TTFT)")
        ax.axvline(s["ttft_ms"] / 1000, color="tab:orange", linewidth=1.5)
        ax.axhline(3 * s["tpot_ms_median_before"], color="tab:red", linestyle="--", linewidth=1,
                   label="3x the streams' median TPOT before the prompt arrived (the goal for the p99)")
        ax.set_yscale("log")
        ax.set_title(f"{describe(n)}\nTTFT {s['ttft_ms'] / 1000:.2f} s; TPOT p99 while "
                     f"prefilled: {s['p99_during_over_median']:.1f}x the median", fontsize=10)
        ax.set_xlabel(f"seconds since the {long_prompt:,}-token prompt arrived")
        ax.grid(alpha=0.3, which="both")
        ax.set_ylim(bottom=1)  # two tokens read at once make a gap of microseconds: off the plot
    axes[0][0].set_ylabel("time per output token (ms, log scale)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=1, fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.16, 1, 1))
    save_figure(fig, path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="0,256,256/1",
                    help="servers, comma-separated: N for --max-prefill-tokens N, N/P adds --prefill-threads P "
                         "(default: 0,256,256/1)")
    ap.add_argument("--layers", type=int, default=4, help="layers of the small shape (default: 4)")
    ap.add_argument("--streams", type=int, default=4)
    ap.add_argument("--long-prompt", type=int, default=4000)
    ap.add_argument("--warmup-s", type=float, default=1.0)
    ap.add_argument("--tail-s", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=1, help="the server's torch threads")
    ap.add_argument("--figure", type=Path, default=FIGURE)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    configs = parse_list(args.configs, "--configs", str)
    for config in configs:
        if not all(part.isdigit() for part in config.split("/", 1)):
            raise SystemExit(f"--configs takes N or N/P (whole numbers), got {config!r}")
    runs, load = {}, os.getloadavg()[0]  # the machine is shared: say how busy it was
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "model"
        save_checkpoint(folder, args.layers)
        for n in configs:
            proc, url = start_server(server_command(folder, args.threads, flags=server_flags(n)),
                                     args.threads, Path(tmp) / f"serve-{n.replace('/', '-')}.log")
            try:
                runs[n] = one_run(url, args)
            finally:
                proc.terminate()
                proc.wait(timeout=60)
    plot(runs, args.figure, args.long_prompt, args.streams)
    result = {"config": {k: v for k, v in vars(args).items() if k not in ("json", "figure")},
              "load_average_1min_before": load,
              "runs": {n: summary(run) for n, run in runs.items()}}
    if args.json:
        print(json.dumps(result, indent=2))
        return
    print("TPOT (ms) of the streams, before the long prompt and while it is prefilled")
    print("p99/p50 = held x spread (held: p50 during / p50 before; spread: p99 / p50 during)")
    print(f"{'server':>13} {'TTFT ms':>8} {'p50 before':>10} {'p99 during':>10} {'p99/p50':>7} {'held':>5} "
          f"{'spread':>6} {'spread before':>13}")
    for n, s in result["runs"].items():
        print(f"{n:>13} {s['ttft_ms']:>8,.0f} {s['tpot_ms_median_before']:>10.1f} {s['tpot_ms_p99_during']:>10.1f} "
              f"{s['p99_during_over_median']:>7.1f} {s['median_during_over_median_before']:>5.2f} "
              f"{s['p99_during_over_median_during']:>6.2f} {s['p99_before_over_median']:>13.2f}")


if __name__ == "__main__":
    main()
