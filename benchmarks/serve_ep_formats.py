"""Expert-parallel serving with each wire format against one process, on the same weights (CPU, gloo).

A tiny V3-shaped model (MLA, 16 routed experts, an MTP layer; random weights scaled so that logits are not
flat) is served by 4 processes through the serving lockstep (every rank decodes its share of the prompts
through the server's own `RankWorker`); per (dispatch, combine) wire format it reports how many greedy
completions are identical to one process's, how many tokens match before the first divergence, how many
teacher-forced positions have the same argmax, and the largest logit difference.

    .venv/bin/python benchmarks/serve_ep_formats.py --json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

FORMATS = [("native", "native"), ("bf16", "bf16"), ("fp8", "bf16"), ("fp8", "logfmt10")]


def build_checkpoint(folder: str) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "infer"))
    from conftest import tiny_model

    tiny_model(layers=3).save_pretrained(folder)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from dsv3.testing.serve_scenarios import compare_formats

    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(3, 14, (args.prompts,), generator=g).tolist()
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in lengths]
    with tempfile.TemporaryDirectory() as folder:
        build_checkpoint(folder)
        rows = compare_formats(folder, prompts, args.new_tokens, FORMATS, world=args.world, timeout_s=300)
    if args.json:
        print(json.dumps({"world": args.world, "prompts": args.prompts, "new_tokens": args.new_tokens,
                          "formats": rows}))
        return
    for r in rows:
        print(f"dispatch {r['dispatch']:6} combine {r['combine']:8}: {r['identical_completions']}/{r['completions']} "
              f"completions identical, {r['tokens_before_divergence']}/{r['tokens']} tokens before divergence, "
              f"argmax {r['argmax_agree']}/{r['positions']}, max |logit diff| {r['max_logit_diff']:.2e} "
              f"(logits up to {r['max_abs_logit']:.2f})")


if __name__ == "__main__":
    main()
