"""`dsv3 draft-vocab`: rank a checkpoint's tokens by frequency for ``--draft-vocab K`` (see
``dsv3.infer.draft_vocab``)."""

from __future__ import annotations

import sys

import typer

from dsv3.errors import DSV3Error

app = typer.Typer(add_completion=False, help="Rank a checkpoint's tokens by frequency for --draft-vocab K.")

SHOWN_K = (256, 512, 1024, 2048, 4096, 8192, 16384, 32768)


@app.command()
def draft_vocab(
    model: str = typer.Option(..., "--model", metavar="PATH",
                              help="Checkpoint folder, or a training run folder (its latest checkpoint)."),
    data: list[str] = typer.Option([], "--data", metavar="SPEC",
                                   help="Files, folders or globs to count (repeatable; default: the Python "
                                        "standard library, what dsv3 train learns from)."),
) -> None:
    """Count the tokens of a corpus with the checkpoint's tokenizer and write every token id of the model's
    vocabulary, most frequent first, to MODEL/draft_vocab.json (read by --draft-vocab K)."""
    from dsv3.config import ModelConfig
    from dsv3.data.corpus import load_corpus
    from dsv3.infer.draft_vocab import count_tokens, coverage, ranked, write
    from dsv3.infer.loading import load_tokenizer
    from dsv3.run_dir import resolve_checkpoint

    folder = resolve_checkpoint(model)
    vocab_size = ModelConfig.from_json(folder).vocab_size
    tokenizer = load_tokenizer(folder, needed_for="draft-vocab")
    corpus = load_corpus(data or None)
    docs = corpus.train + corpus.val
    counts = count_tokens(tokenizer, (d.text for d in docs), vocab_size)
    if not int(counts.sum()):
        raise DSV3Error(f"the corpus ({corpus.description}) holds no tokens to count")
    ids = ranked(counts)
    path = write(folder, ids, counts, corpus.description)
    print(f"wrote {path}: {vocab_size} token ids ranked by {int(counts.sum()):,} tokens of {len(docs)} documents "
          f"({corpus.description})", file=sys.stderr)
    for k in [k for k in SHOWN_K if k < vocab_size] + [vocab_size]:
        print(f"  --draft-vocab {k:>6}: {coverage(counts, ids, k):6.1%} of the counted tokens", file=sys.stderr)
