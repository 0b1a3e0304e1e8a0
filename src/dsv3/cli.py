"""The `dsv3` command: a thin dispatcher over one sub-app per layer.

Each subcommand lives in the layer it serves (``dsv3.network.cli``, ``dsv3.analysis.cli``, ...) and is
imported only when asked for, so `dsv3 net ...` never pays for importing what `dsv3 train` needs.
Bad input raised as :class:`DSV3Error` ends as one ``error: ...`` line on stderr and exit status 2 (under
a launcher, one line for the whole run: `dsv3.errors.report`).
"""

from __future__ import annotations

import importlib
import sys
import textwrap

from dsv3.errors import DSV3Error, report, speaks_for_the_run

# command -> (module path of a Typer app or a main(argv) callable, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("dsv3.train.cli:app", "Train a V3-architecture model (MLA, DeepSeekMoE, MTP) on a text corpus."),
    "generate": ("dsv3.infer.cli:generate_app", "Generate text from a checkpoint (latent-cache decode, MTP)."),
    "chat": ("dsv3.infer.cli:chat_app", "Chat with a checkpoint in the terminal."),
    "serve": ("dsv3.infer.cli:serve_app", "Serve a checkpoint over an OpenAI-compatible HTTP API."),
    "draft-vocab": ("dsv3.infer.draft_vocab_cli:app", "Rank a checkpoint's tokens by frequency for --draft-vocab."),
    "convert": ("dsv3.checkpoint_cli:app", "Convert a checkpoint --to bf16|fp8|int8|int4, or export a run --to hf."),
    "analyze": ("dsv3.analysis.cli:analyze_app", "Memory, FLOPs and speed bounds of any model on any hardware."),
    "paper": ("dsv3.analysis.cli:paper_app", "The paper's tables side by side with our numbers."),
    "plan": ("dsv3.analysis.plan_cli:app", "Plan a cluster to train or serve: memory, step time, throughput."),
    "study": ("dsv3.studies.cli:app", "Numerical studies: FP8 accumulation, FP8 training, LogFMT."),
    "net": ("dsv3.network.cli:app", "Network: build a topology, its cost; simulate and sweep traffic on it."),
    "bench": ("dsv3.bench_cli:app", "Benchmarks: expert-parallel (ep), pipeline bubble, decode speed, serve load."),
    "launch": ("dsv3.launch:app", "Run a command on N processes, as torchrun does (--nproc N)."),
}


def _usage(columns: int = 80) -> str:
    """The top-level help, each command's line folded to ``columns`` under its own description."""
    width = max(len(name) for name in COMMANDS)
    indent = " " * (width + 4)
    lines = ["usage: dsv3 COMMAND [ARGS]...", "", "DeepSeek-V3 as one readable PyTorch codebase.", "", "commands:"]
    lines += [textwrap.fill(help_, columns, initial_indent=f"  {name:<{width}}  ", subsequent_indent=indent)
              for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run `dsv3 COMMAND --help` for a command's options, `dsv3 --version` for the",
              "version."]
    return "\n".join(lines)


def _version() -> str:
    """The installed distribution's version (pyproject.toml's, via the package metadata)."""
    from importlib.metadata import version

    return f"dsv3 {version('dsv3')}"


def _load(target: str):
    module_name, attr = target.split(":")
    return getattr(importlib.import_module(module_name), attr)


def click_command(name: str):
    """The click command behind `dsv3 NAME`, built from its typer app: what the tests walk to check option
    names and to parse the docs' command lines without running them."""
    import typer

    return typer.main.get_command(_load(COMMANDS[name][0]))


def leaf_commands():
    """Every runnable command as (words after `dsv3`, its click command): `("plan", "train")`, ..."""
    def walk(command, path):
        children = getattr(command, "commands", None)
        if not children:
            yield path, command
            return
        for child_name, child in children.items():
            yield from walk(child, (*path, child_name))

    for name in COMMANDS:
        yield from walk(click_command(name), (name,))


def _click_outcome(exc: Exception) -> int | None:
    """The exit status for click-style control exceptions (duck-typed: typer 0.29 vendors click,
    so its classes are not click's), or None for a real error."""
    name = type(exc).__name__
    if name == "Exit" and hasattr(exc, "exit_code"):
        return exc.exit_code
    if name == "Abort":
        print("aborted", file=sys.stderr)
        return 1
    if hasattr(exc, "show") and isinstance(getattr(exc, "exit_code", None), int):
        exc.show()
        return exc.exit_code
    return None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if argv[0] == "--version":
        print(_version())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"error: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    try:
        app = _load(COMMANDS[name][0])
        result = app(args=rest, prog_name=f"dsv3 {name}", standalone_mode=False)
    except DSV3Error as exc:
        report(exc)
        return 2
    except KeyboardInterrupt:
        if speaks_for_the_run():
            print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # usage errors of click or of typer's vendored copy of it
        code = _click_outcome(exc)
        if code is None:
            raise
        return code
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
