"""Command-line options that generate, chat, serve and `bench decode` share (one declaration each)."""

from __future__ import annotations

import typer

DTYPE = typer.Option("auto", "--dtype", metavar="NAME", show_default=False,
                     help="Compute dtype: auto (as stored), fp32 or bf16 (default: auto).")
WEIGHTS = typer.Option("native", "--weights", metavar="NAME", show_default=False,
                       help="native; fp8: projections kept as FP8 blocks; int8 or int4: routed and shared "
                       "experts kept as integer groups of 32 (default: native).")
CACHE_DTYPE = typer.Option("auto", "--cache-dtype", metavar="NAME", show_default=False,
                           help="Latent cache dtype: auto (the compute dtype), fp32, bf16 or fp8 (default: auto).")
SPECULATIVE = typer.Option("none", "--speculative", metavar="NAME", show_default=False,
                           help="mtp: draft with the MTP layer; none: plain decoding (default: none).")
THREADS = typer.Option(0, "--threads", metavar="N", show_default=False,
                       help="torch CPU threads (default 0: torch's choice; 1 is often fastest for a small model "
                            "on a busy machine).")
DRAFT_VOCAB = typer.Option(0, "--draft-vocab", metavar="K", show_default=False,
                           help="With --speculative mtp: draft over the K most frequent tokens only (ranked in "
                                "MODEL/draft_vocab.json by dsv3 draft-vocab); 0: the whole vocabulary (default).")
CHAT_TEMPLATE = typer.Option(None, "--chat-template", metavar="FILE", show_default=False,
                             help="Jinja chat template to use instead of the checkpoint's (default: its "
                                  "chat_template, else DeepSeek-V3's or plain text).")
