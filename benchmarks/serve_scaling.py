"""Throughput and latency versus concurrency for each serving layout, measured with `dsv3 bench serve`'s
client against real server processes: one process (`dsv3 serve`), `--ep 4` (4 processes under torchrun,
experts spread, attention data-parallel) and `--ep 4 --prefill-ranks 2` (prefill on ranks 0-1, decode on
ranks 2-3).

A random-weight preset checkpoint is saved to a temporary folder (speed does not depend on the weights), or
``--model`` is served. Every layout is started at once, each in its own process group, and the measurements
interleave: each round visits every (concurrency, layout) pair, the layouts in a rotated order, so that a
busy machine slows every layout alike (the idle groups still tick: a few percent of a core each). Each
point sends ``--requests`` prompts of ``--prompt-len`` random token ids (no shared prefix), asks for exactly
``--new-tokens`` tokens, at most C at a time. Every process is stopped on exit, Ctrl-C and failure included.

    .venv/bin/python benchmarks/serve_scaling.py            # about 10 minutes on 2 busy cores

writes docs/figures/serve_concurrency.json and .png (docs/inference.md shows the figure) and prints the table
(earlier runs: benchmarks/results/serve_scaling.json).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from dsv3.errors import DSV3Error
from dsv3.option_lists import parse_list

ROOT = Path(__file__).resolve().parents[1]
FIGURE = ROOT / "docs" / "figures" / "serve_concurrency.png"
METRICS = (("request_throughput", None), ("output_tokens_per_s", None), ("ttft_ms", "p50"), ("ttft_ms", "p99"),
           ("tpot_ms", "p50"), ("tpot_ms", "p99"))


@dataclass(frozen=True)
class Layout:
    """A serving layout: ``ep`` processes (0: one plain `dsv3 serve`), the first ``prefill`` of them prefill."""

    ep: int = 0
    prefill: int = 0

    @property
    def name(self) -> str:
        return "1" if not self.ep else f"ep{self.ep}" + (f"-prefill{self.prefill}" if self.prefill else "")

    @property
    def label(self) -> str:
        if not self.ep:
            return "1 process"
        return f"--ep {self.ep}" + (f" --prefill-ranks {self.prefill}" if self.prefill else "")

    @property
    def processes(self) -> int:
        return self.ep or 1


def parse_layout(text: str) -> Layout:
    """'1', 'epN' or 'epN-prefillP' (0 < P < N)."""
    if text.strip() == "1":
        return Layout()
    found = re.fullmatch(r"ep(\d+)(?:-prefill(\d+))?", text.strip())
    if not found:
        raise DSV3Error(f"--layouts: {text!r} is not 1, epN or epN-prefillP")
    ep, prefill = int(found.group(1)), int(found.group(2) or 0)
    if ep < 1:
        raise DSV3Error(f"--layouts: {text!r}: N must be >= 1")
    if found.group(2) is not None and not 0 < prefill < ep:
        raise DSV3Error(f"--layouts: {text!r}: P must be between 1 and N - 1")
    return Layout(ep, prefill)


def parse_ints(text: str, flag: str) -> list[int]:
    """A comma-separated list of distinct positive integers, sorted."""
    values = parse_list(text, flag, int)
    if min(values) < 1:
        raise DSV3Error(f"{flag} must list integers >= 1, got {text!r}")
    return sorted(values)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The options, checked: a bad value raises DSV3Error (one line) before any process starts."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="checkpoint folder to serve (default: a random-weight --preset)")
    ap.add_argument("--preset", default="nano", help="random-weight model without --model (default: nano)")
    ap.add_argument("--layouts", default="1,ep4,ep4-prefill2", help="comma-separated: 1, epN, epN-prefillP")
    ap.add_argument("--concurrency", default="1,2,4,8", help="comma-separated levels (default: 1,2,4,8)")
    ap.add_argument("--requests", type=int, default=16, help="requests per point (default: 16)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", dest="gen_len", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds; the median is kept (default: 2)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per server process (default: 1)")
    ap.add_argument("--max-batch", type=int, default=8, help="requests per rank's batch (default: 8)")
    ap.add_argument("--start-timeout", type=float, default=600.0, help="seconds for every group to come up")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    ap.add_argument("--figure", type=Path, default=FIGURE, help=f"PNG to write (default: {FIGURE.relative_to(ROOT)})")
    ap.add_argument("--json-out", type=Path, default=None, help="JSON to write (default: the figure's, .json)")
    ap.add_argument("--json", action="store_true", help="print the JSON instead of the table")
    args = ap.parse_args(argv)
    args.layouts = [parse_layout(t) for t in args.layouts.split(",") if t.strip()]
    if not args.layouts or len({lay.name for lay in args.layouts}) != len(args.layouts):
        raise DSV3Error("--layouts must name at least one layout, each once")
    args.concurrency = parse_ints(args.concurrency, "--concurrency")
    for flag in ("requests", "prompt_len", "gen_len", "rounds", "threads", "max_batch"):
        if getattr(args, flag) < 1:
            raise DSV3Error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not (args.start_timeout > 0 and args.timeout > 0):
        raise DSV3Error("--start-timeout and --timeout must be > 0")
    if args.model is not None and not Path(args.model).is_dir():
        raise DSV3Error(f"--model {args.model}: no such folder")
    if args.model is None:
        from dsv3.config import preset

        preset(args.preset)  # an unknown name fails here, before any process starts
    if args.json_out is None:
        args.json_out = args.figure.with_suffix(".json")
    for path in (args.figure, args.json_out):
        if not path.parent.is_dir():
            raise DSV3Error(f"{path}: its folder does not exist")
    return args


# ---- server processes ------------------------------------------------------------------------------
def server_command(layout: Layout, model: str, threads: int, max_batch: int) -> list[str]:
    """The command line of a layout's server (port 0: the server picks a free one and prints it)."""
    serve = ["-m", "dsv3", "serve", "--model", model, "--port", "0", "--quiet", "--threads", str(threads),
             "--max-batch", str(max_batch)]
    if not layout.ep:
        return [sys.executable, *serve]
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(layout.ep)]
    return run + serve + ["--ep", str(layout.ep)] + (["--prefill-ranks", str(layout.prefill)] if layout.prefill else [])


class Server:
    """One layout's server process group (its own session: stopping it reaches torchrun's ranks too)."""

    def __init__(self, layout: Layout, command: list[str], log: Path, threads: int):
        self.layout, self.log, self.url = layout, log, None
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        with open(log, "w") as err:
            self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err, env=env,
                                         start_new_session=True)

    def poll_ready(self) -> bool:
        """True once it listens and /health answers 200; raises when it exited."""
        if self.url is None:
            found = re.search(r"listening on (http://\S+?)/v1", self.log.read_text(errors="replace"))
            if found:
                self.url = found.group(1)
        if self.url is None:
            if self.proc.poll() is not None:
                raise DSV3Error(f"{self.layout.label}: the server exited ({self.proc.returncode}): {self.tail()}")
            return False
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as resp:
                return resp.status == 200
        except OSError:
            return False

    def tail(self) -> str:
        lines = self.log.read_text(errors="replace").strip().splitlines()
        return " | ".join(lines[-3:]) or "(no output)"

    def stop(self) -> None:
        """SIGTERM to the whole process group, SIGKILL after 30 s."""
        if self.proc.poll() is None:
            _signal_group(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        _signal_group(self.proc.pid, signal.SIGKILL)  # ranks torchrun left behind, if any
        if self.proc.poll() is None:
            self.proc.wait(timeout=30)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


@contextmanager
def servers(layouts: list[Layout], model: str, args: argparse.Namespace, logs: Path):
    """Every layout's server, started together and ready; all stopped on the way out, whatever happens."""
    with ExitStack() as stack:
        started = []
        for layout in layouts:
            command = server_command(layout, model, args.threads, args.max_batch)
            server = Server(layout, command, logs / f"{layout.name}.log", args.threads)
            stack.callback(server.stop)
            started.append(server)
        deadline = time.time() + args.start_timeout
        waiting = list(started)
        while waiting:
            waiting = [s for s in waiting if not s.poll_ready()]
            if waiting and time.time() > deadline:
                raise DSV3Error(f"{waiting[0].layout.label}: not ready in {args.start_timeout:.0f} s: "
                                f"{waiting[0].tail()}")
            time.sleep(0.5)
        yield started


def _terminate_on_sigterm() -> None:
    """SIGTERM (a CI timeout, `kill`) unwinds like Ctrl-C, so that the servers are stopped."""
    def handler(signum, frame):
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, handler)


# ---- measuring ---------------------------------------------------------------------------------------
def measure(started: list[Server], args: argparse.Namespace) -> list[dict]:
    """Rounds of every (concurrency, layout) point, layouts rotated per round; one row per point and round."""
    from dsv3.infer.bench_serve import make_prompts, model_card, run, stream_completion

    cards = {}
    for server in started:
        card = model_card(server.url)
        if args.prompt_len + args.gen_len > card.get("max_model_len", 1 << 30):
            raise DSV3Error(f"--prompt-len + --new-tokens exceeds the model's context ({card['max_model_len']})")
        warm = stream_completion(server.url, card["id"], [1, 2, 3, 4], 2, args.timeout)
        if not warm.ok:
            raise DSV3Error(f"{server.layout.label}: cannot serve a test request: {warm.error}")
        cards[server.layout.name] = card
    rows = []
    for r in range(args.rounds):
        for i, c in enumerate(args.concurrency):
            shift = (r + i) % len(started)
            for server in started[shift:] + started[:shift]:
                card = cards[server.layout.name]
                seed = 1000 * r + c  # the same prompts for every layout at a point; fresh ones per point
                prompts = make_prompts(args.requests, args.prompt_len, 0, card["vocab_size"], seed)
                out = run(server.url, card["id"], prompts, args.gen_len, c, args.timeout)
                rows.append({"layout": server.layout.name, "label": server.layout.label, "round": r,
                             "concurrency": c, **out})
                print(f"round {r} {server.layout.label:>28} C={c}: {_brief(out)}", file=sys.stderr, flush=True)
    return rows


def _brief(out: dict) -> str:
    return (f"{out['completed']} ok {out['errors']} failed, {out['output_tokens_per_s']:.1f} tok/s, "
            f"TTFT p50 {_fmt(out['ttft_ms']['p50'])} ms, TPOT p50 {_fmt(out['tpot_ms']['p50'])} ms")


def _fmt(x: float | None, spec: str = ",.0f") -> str:
    return "-" if x is None else format(x, spec)


def summarize(rows: list[dict], layouts: list[Layout], levels: list[int]) -> list[dict]:
    """One point per (layout, concurrency): the median over rounds of each figure, errors summed."""
    points = []
    for layout in layouts:
        for c in levels:
            mine = [r for r in rows if r["layout"] == layout.name and r["concurrency"] == c]
            point = {"layout": layout.name, "label": layout.label, "processes": layout.processes,
                     "concurrency": c, "rounds": len(mine), "errors": sum(r["errors"] for r in mine),
                     "completed": sum(r["completed"] for r in mine)}
            for key, sub in METRICS:
                values = [r[key] if sub is None else r[key][sub] for r in mine]
                values = [v for v in values if v is not None]
                point[key if sub is None else f"{key.removesuffix('_ms')}_{sub}_ms"] = (
                    statistics.median(values) if values else None)
            points.append(point)
    return points


def table(points: list[dict]) -> list[str]:
    """The Markdown table of the points."""
    lines = ["| layout | C | req/s | output tok/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | failed |",
             "|---|---|---|---|---|---|---|"]
    for p in points:
        ttft = f"{_fmt(p['ttft_p50_ms'])} / {_fmt(p['ttft_p99_ms'])}"
        tpot = f"{_fmt(p['tpot_p50_ms'])} / {_fmt(p['tpot_p99_ms'])}"
        lines.append(f"| `{p['label']}` | {p['concurrency']} | {_fmt(p['request_throughput'], '.2f')} | "
                     f"{_fmt(p['output_tokens_per_s'], ',.1f')} | {ttft} | {tpot} | {p['errors']} |")
    return lines


def draw(points: list[dict], path: Path, title: str) -> None:
    """One PNG, three panels over concurrency: output tokens/s, TTFT and TPOT (p50 solid, p99 dashed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import ticker

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    panels = (("output_tokens_per_s", None, "output tokens/s", "Throughput"),
              ("ttft_p50_ms", "ttft_p99_ms", "ms", "Time to first token"),
              ("tpot_p50_ms", "tpot_p99_ms", "ms", "Time per output token"))
    labels = list(dict.fromkeys(p["label"] for p in points))
    levels = sorted({p["concurrency"] for p in points})
    for ax, (key, p99, unit, name) in zip(axes, panels, strict=True):
        for n, label in enumerate(labels):
            mine = [p for p in points if p["label"] == label]
            color = f"C{n}"
            ax.plot([p["concurrency"] for p in mine], [p[key] for p in mine], "o-", color=color, label=label)
            if p99:
                ax.plot([p["concurrency"] for p in mine], [p[p99] for p in mine], "s--", color=color, alpha=0.6,
                        label=f"{label} (p99)")
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(unit + (" (log scale)" if p99 else ""))
        ax.set_title(name + (" (p50 solid, p99 dashed)" if p99 else ""))
        if p99:  # a p99 outlier on a busy machine must not flatten the rest
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(ticker.LogLocator(subs=(1, 2, 5)))
            ax.yaxis.set_major_formatter(ticker.FuncFormatter(lambda y, _: f"{y:,.0f}"))
            ax.yaxis.set_minor_formatter(ticker.NullFormatter())
        else:
            ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend(loc="best")
    fig.suptitle(title)
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)


def write_json(data: dict, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def benchmark(args: argparse.Namespace) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            import torch

            from dsv3.config import preset
            from dsv3.model import Transformer

            torch.manual_seed(0)
            model = str(Path(tmp) / args.preset)
            Transformer(preset(args.preset)).save_pretrained(model)
        t0 = time.time()
        with servers(args.layouts, model, args, Path(tmp)) as started:
            print(f"every layout ready in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
            rows = measure(started, args)
    points = summarize(rows, args.layouts, args.concurrency)
    return {"model": args.model or f"{args.preset} (random weights)", "prompt_len": args.prompt_len,
            "gen_len": args.gen_len, "requests_per_point": args.requests, "rounds": args.rounds,
            "threads_per_process": args.threads, "max_batch_per_rank": args.max_batch, "cpus": os.cpu_count(),
            "points": points, "runs": rows}


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        _terminate_on_sigterm()
        result = benchmark(args)
        write_json(result, args.json_out)
        title = (f"dsv3 bench serve on {result['model']}: {args.prompt_len}-token prompts, {args.gen_len} generated, "
                 f"{args.threads} thread(s) per process, {os.cpu_count()} CPUs")
        draw(result["points"], args.figure, title)
    except DSV3Error as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted; every server process was stopped", file=sys.stderr)
        return 130
    print(json.dumps(result) if args.json else "\n".join(table(result["points"])))
    print(f"wrote {args.json_out} and {args.figure}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
