"""A plain sampler to look at what a checkpoint learned: greedy or temperature/top-k, full-sequence
forward per token (no cache; `dsv3 generate` is the fast path). Also ``python -m dsv3.train.sample``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer

from dsv3.data.tokenizer import EOS_TOKEN
from dsv3.errors import DSV3Error


@torch.no_grad()
def sample_text(
    model,
    tokenizer: Tokenizer,
    prompt: str,
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int = 40,
    seed: int = 0,
    eos_id: int | None = None,
) -> str:
    """The prompt's continuation (without the prompt). temperature 0 is greedy; stops at end-of-document."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    eos = tokenizer.token_to_id(EOS_TOKEN) if eos_id is None else eos_id
    ids = tokenizer.encode(prompt, add_special_tokens=False).ids or [eos]
    tokens = torch.tensor([ids], device=device)
    limit = model.config.max_position_embeddings
    generator = torch.Generator(device="cpu").manual_seed(seed)
    new: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(tokens[:, -limit:])[0, -1].float().cpu()  # [vocab]
        logits[tokenizer.get_vocab_size() :] = float("-inf")  # ids the tokenizer never produces
        nxt = _choose(logits, temperature, top_k, generator)
        if nxt == eos:
            break
        new.append(nxt)
        tokens = torch.cat([tokens, torch.tensor([[nxt]], device=device)], dim=1)
    model.train(was_training)
    return tokenizer.decode(new)


def _choose(logits: torch.Tensor, temperature: float, top_k: int, generator: torch.Generator) -> int:
    if temperature <= 0:
        return int(logits.argmax())
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits / temperature, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dsv3.train.sample", description=__doc__)
    parser.add_argument("checkpoint", help="a checkpoint folder holding tokenizer.json (e.g. RUN_DIR/latest)")
    parser.add_argument("--prompt", default="def")
    parser.add_argument("--max-new-tokens", type=int, default=120)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-k", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    from dsv3 import load_pretrained

    try:
        path = Path(args.checkpoint)
        if not (path / "tokenizer.json").exists():
            raise DSV3Error(f"{path} has no tokenizer.json")
        model = load_pretrained(path, dtype=torch.float32)
        tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        text = sample_text(
            model, tokenizer, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.seed
        )
    except DSV3Error as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(args.prompt + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
