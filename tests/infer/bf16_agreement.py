"""How often bf16 decoding agrees with the module path across random tiny models: the measurement behind the
bf16 checks of test_decode_fast.py (decisive routing, greedy tokens up to near-ties).

    .venv/bin/python tests/infer/bf16_agreement.py --models 20

For each seed, a tiny bf16 model (conftest.tiny_model), with its routers as they are and made decisive
(conftest.decisive_routing); for each way the kernels compute bf16 x bf16 (fp32 FMAs, and AVX512-BF16 dot
products where the CPU has them), the fast engine's greedy tokens for test_decode_fast's prompts (batch 1 and
the ragged batch) against the module engine's. Counts: exact equality; the near-tie check
(test_decode_fast.greedy_up_to_ties) passing on the fast tokens and on the module engine's own; and the check
failing on the fast tokens with every token moved by one (it must). Not a test: a random model's near-ties
make exact equality a matter of luck, which is what it shows.
"""

import argparse
import sys
from pathlib import Path

import torch

from dsv3.infer.engine import Engine
from dsv3.kernels import decode_kernels as dk

sys.path.insert(0, str(Path(__file__).parent))
from test_decode_fast import PROMPTS, generate, greedy_up_to_ties  # noqa: E402

from conftest import decisive_routing, tiny_model  # noqa: E402


def tokens(engine: Engine) -> list:
    return [generate(engine, [PROMPTS[0]]), generate(engine, PROMPTS)]


def near_ties(model, outputs) -> bool:
    return greedy_up_to_ties(model, [PROMPTS[0]], outputs[0]) and greedy_up_to_ties(model, PROMPTS, outputs[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=int, default=20, help="random seeds")
    args = ap.parse_args()
    if args.models < 1:
        ap.error("--models must be at least 1")
    paths = ["fp32 FMAs"] + (["bf16 dots"] if dk.bf16_dots() else [])
    on = dk.bf16_dots()
    counts = {}
    try:
        for routing in ("as initialised", "decisive"):
            for seed in range(args.models):
                model = tiny_model(seed=seed).to(torch.bfloat16)
                if routing == "decisive":
                    decisive_routing(model)
                want = tokens(Engine(model, fast=False))
                counts.setdefault((routing, "module path"), [0, 0, 0, 0])[1] += near_ties(model, want)
                for path in paths:
                    dk.bf16_dots(path == "bf16 dots")
                    got = tokens(Engine(model))
                    moved = [[[(t + 1) % model.config.vocab_size for t in out] for out in part] for part in got]
                    c = counts.setdefault((routing, path), [0, 0, 0, 0])
                    c[0] += got == want
                    c[1] += near_ties(model, got)
                    c[2] += not near_ties(model, moved)
    finally:
        dk.bf16_dots(on)
    n = args.models
    print(f"{n} random tiny bf16 models; greedy tokens of the fast engine against the module engine's")
    print(f"{'routing':<15} {'kernels':<12} {'exact':>7} {'near-ties':>10} {'moved rejected':>15}")
    for (routing, path), (exact, ties, rejected, _) in counts.items():
        if path == "module path":
            print(f"{routing:<15} {path:<12} {'-':>7} {f'{ties}/{n}':>10} {'-':>15}")
        else:
            print(f"{routing:<15} {path:<12} {f'{exact}/{n}':>7} {f'{ties}/{n}':>10} {f'{rejected}/{n}':>15}")


if __name__ == "__main__":
    main()
