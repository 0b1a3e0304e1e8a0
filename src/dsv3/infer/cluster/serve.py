"""`torchrun --nproc-per-node N -m dsv3 serve --ep N`: the OpenAI-compatible server over N processes.

Every rank loads the checkpoint, keeps 1/N of every MoE layer's routed experts (the rest is replicated),
and decodes its own share of the requests (attention data-parallel); rank 0 also runs the HTTP front end.
Setup is checked on every rank and agreed on before serving starts, so that a bad flag, an unreadable
checkpoint or a port in use ends every process with the same one-line error instead of leaving the others
waiting for a peer that is gone.
"""

from __future__ import annotations

import datetime
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from dsv3.config import ModelConfig
from dsv3.errors import DSV3Error, RankError

GROUP_TIMEOUT_S = 60.0  # a collective that waits longer than this (a rank hung) takes the group down


@dataclass(frozen=True)
class GroupOptions:
    """The serve flags that shape the group."""

    ep: int
    prefill_ranks: int = 0
    dispatch: str = "native"
    combine: str = "native"
    redundant_experts: int = 0
    eplb_every: int = 0
    micro_batches: int = 1  # 2: dual micro-batch decode (the decode group's, with --prefill-ranks)
    prefix_cache_bytes: str = "1G"  # each prefill rank's prefix cache ("0": none)
    prefix_block_tokens: int = 16
    prefix_cache_dir: str | None = None  # one folder, shared by the prefill ranks


def check_options(opts: GroupOptions, weights: str = "native") -> None:
    """Flag values that are wrong whatever the processes (checked before any process group exists)."""
    from dsv3.parallel.wire import COMBINE_FORMATS, DISPATCH_FORMATS

    if opts.ep < 1:
        raise DSV3Error(f"--ep must be >= 1, got {opts.ep}")
    if opts.dispatch not in ("native", *DISPATCH_FORMATS):
        raise DSV3Error(f"--dispatch must be one of native, {', '.join(DISPATCH_FORMATS)}; got {opts.dispatch!r}")
    if opts.combine not in ("native", *COMBINE_FORMATS):
        raise DSV3Error(f"--combine must be one of native, {', '.join(COMBINE_FORMATS)}; got {opts.combine!r}")
    if opts.redundant_experts < 0 or opts.eplb_every < 0:
        raise DSV3Error("--redundant-experts and --eplb-every must be >= 0")
    if weights in ("int8", "int4"):  # the expert-parallel layer knows plain and FP8 experts only
        raise DSV3Error(f"--weights {weights} runs in one process; --ep N takes --weights native or fp8")
    if opts.eplb_every and weights == "fp8":  # moving weights at run time knows plain parameters only
        raise DSV3Error("--eplb-every cannot rebalance resident FP8 experts (--weights fp8); use --weights native")
    if opts.micro_batches not in (1, 2):
        raise DSV3Error(f"--micro-batches must be 1 or 2, got {opts.micro_batches}")
    if opts.prefill_ranks < 0 or (opts.prefill_ranks and not 0 < opts.prefill_ranks < opts.ep):
        raise DSV3Error(f"--prefill-ranks must be between 1 and --ep - 1 ({opts.ep - 1}), got {opts.prefill_ranks}")


def init_group(ep: int) -> tuple[int, int]:
    """Join the torchrun group (gloo); (rank, world). Needs exactly ``ep`` processes."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise DSV3Error(f"--ep {ep} runs one process per rank: start it with dsv3 launch --nproc {ep} serve ...")
    world = int(os.environ["WORLD_SIZE"])
    if world != ep:
        raise DSV3Error(f"--ep {ep} needs exactly {ep} processes, {world} were started")
    if os.environ.get("MASTER_ADDR") in ("127.0.0.1", "localhost"):  # one machine: gloo on the loopback
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S))
    return dist.get_rank(), world


def agree(setup: Callable[[], object]) -> object:
    """Run ``setup`` on every rank; when it fails on any, every rank raises that rank's error."""
    result, error = None, None
    try:
        result = setup()
    except DSV3Error as exc:
        error = str(exc)
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    if error is not None:
        raise DSV3Error(error)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        raise DSV3Error(f"rank {failed[0][0]}: {failed[0][1]}")
    return result


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def serve_group(opts: GroupOptions, model: str, host: str, port: int, max_batch: int, engine_args: dict,
                quiet: bool = False, api_key: str | None = None) -> None:
    """Load, spread the experts, and serve: rank 0 runs the HTTP front end, the other ranks follow it."""
    check_options(opts, engine_args.get("weights", "native"))
    rank, world = init_group(opts.ep)
    try:
        _serve(opts, rank, world, model, host, port, max_batch, engine_args, quiet, api_key)
    finally:
        dist.destroy_process_group()


def _serve(opts: GroupOptions, rank: int, world: int, model: str, host: str, port: int, max_batch: int,
           engine_args: dict, quiet: bool, api_key: str | None = None) -> None:
    from dsv3.infer.cli import build_engine, listen
    from dsv3.infer.cluster.frontend import worker_loop
    from dsv3.infer.cluster.lockstep import make_lockstep, use_micro_batches
    from dsv3.infer.heap import loaded_heap_frozen
    from dsv3.run_dir import resolve_checkpoint

    folder = resolve_checkpoint(model)
    cfg = ModelConfig.from_json(folder / "config.json")
    experts = rank_experts(opts, world, rank, cfg)
    engine = agree(lambda: build_engine(str(folder), experts=experts, **engine_args))
    attach_prefix_caches(opts, engine, rank)
    from dsv3.infer.cli import _describe

    summary = _describe(engine, whole_parameter_count(cfg))
    lockstep = agree(lambda: make_lockstep(engine.model, partitions(opts, world), opts.dispatch, opts.combine,
                                                opts.redundant_experts))
    use_micro_batches(engine, lockstep, opts.micro_batches if rank >= opts.prefill_ranks else 1)
    worker = make_worker(opts, engine, lockstep, rank)
    sock = agree(lambda: listen(host, port) if rank == 0 else None)
    if rank != 0:
        try:
            with loaded_heap_frozen():
                worker_loop(worker)
        except Exception as exc:  # a peer gone or hung: one line from each rank, not a traceback
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise RankError(f"rank {rank}: the serving group lost a rank, stopping ({reason})") from None
        return
    _front_end(opts, engine, worker, world, sock, model, folder, max_batch, quiet, summary, api_key)


def _front_end(opts: GroupOptions, engine, worker, world: int, sock, model: str, folder, max_batch: int,
               quiet: bool, summary: str, api_key: str | None = None) -> None:
    import uvicorn

    from dsv3.infer.cli import _model_name
    from dsv3.infer.cluster.app import install_unavailable
    from dsv3.infer.cluster.frontend import ClusterScheduler
    from dsv3.infer.heap import loaded_heap_frozen
    from dsv3.infer.server import create_app

    P = opts.prefill_ranks
    sides = dict(prefill=list(range(P)), decode=list(range(P, world))) if P else {}
    scheduler = ClusterScheduler(engine, worker, world, max_batch, eplb_every=opts.eplb_every, **sides)
    name = _model_name(model)
    app = create_app(engine, model_name=name, max_batch=max_batch, access_log=None if quiet else log,
                     scheduler=scheduler, api_key=api_key)
    install_unavailable(app, scheduler)
    bound_host, bound_port = sock.getsockname()[:2]
    where = f"[{bound_host}]" if ":" in bound_host else bound_host
    log(f"dsv3 serve: model {name!r} from {folder} ({summary})")
    log(f"expert parallel over {world} processes: {describe_group(opts, engine)}")
    if P:
        from dsv3.infer.cluster.disagg import cache_bytes_per_token

        log(f"prefill on ranks 0-{P - 1} (EP{P}), decode on ranks {P}-{world - 1} (EP{world - P}); each prefill "
            f"moves its latent cache to a decode rank: {cache_bytes_per_token(engine):,} bytes per token")
    log(f"listening on http://{where}:{bound_port}/v1 (OpenAI API); Ctrl-C stops")
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    with loaded_heap_frozen():
        server.run(sockets=[sock])


def attach_prefix_caches(opts: GroupOptions, engine, rank: int) -> None:
    """The prefix cache of a single process on every rank that prefills (all, or the first
    ``--prefill-ranks``; decode ranks never prefill). The ranks then agree on one fingerprint of the whole
    group's weights (``PrefixCache.join_group``), so that they name blocks alike and share the on-disk tier."""
    from dsv3.infer.cli import attach_prefix_cache

    prefills = not opts.prefill_ranks or rank < opts.prefill_ranks
    agree(lambda: attach_prefix_cache(engine, opts.prefix_cache_bytes, opts.prefix_block_tokens,
                                      opts.prefix_cache_dir) if prefills else None)
    cache = engine.prefix_cache
    fingerprints = [None] * dist.get_world_size()
    dist.all_gather_object(fingerprints, cache.fingerprint if cache is not None else None)
    if cache is not None:
        cache.join_group([f for f in fingerprints if f is not None])


def describe_group(opts: GroupOptions, engine) -> str:
    """One line: experts per rank and wire formats."""
    from dsv3.infer.cluster.lockstep import ep_formats

    moe = next(m for m in engine.model.modules() if hasattr(m, "dispatcher") and hasattr(m.dispatcher, "inner"))
    d = moe.dispatcher.inner
    dispatch, combine = ep_formats(d)
    slots = d.expert_ids.numel()
    replicas = d.placement.phy2log.numel() - d.n_experts
    held = f"{slots} expert slots per rank and layer ({d.n_experts} experts + {replicas} replicas" + (
        f", EPLB every {opts.eplb_every} busy steps)" if opts.eplb_every else ")") if replicas else \
        f"{slots} of {d.n_experts} routed experts per rank and layer"
    dual = ", dual micro-batch decode" if opts.micro_batches == 2 else ""
    return f"{held}, dispatch {dispatch}, combine {combine}, attention data-parallel{dual}"


def rank_experts(opts: GroupOptions, world: int, rank: int, cfg: ModelConfig) -> list[int] | None:
    """The routed experts this rank will hold in its EP group (the group's placement, `group_placement`),
    so that it reads only those from the checkpoint; None for a model without routed experts."""
    from dsv3.infer.cluster.lockstep import group_placement

    if not cfg.n_routed_experts:
        return None
    members = next(group for group in partitions(opts, world) if rank in group)
    placement = group_placement(cfg.n_routed_experts, len(members), opts.redundant_experts)
    return [int(e) for e in placement.rank_experts(members.index(rank)).tolist()]


def whole_parameter_count(cfg: ModelConfig) -> int:
    """The whole model's parameters (built on the meta device: no memory), which no rank holds."""
    import torch

    from dsv3.model.transformer import Transformer

    with torch.device("meta"):
        return sum(p.numel() for p in Transformer(cfg).parameters())


def partitions(opts: GroupOptions, world: int) -> list[list[int]]:
    """The EP groups: all ranks, or the prefill ranks and the decode ranks."""
    P = opts.prefill_ranks
    return [list(range(P)), list(range(P, world))] if P else [list(range(world))]


def make_worker(opts: GroupOptions, engine, lockstep, rank: int):
    """This rank's worker: both prefill and decode, or one side of a disaggregated group."""
    from dsv3.infer.cluster.disagg import DecodeWorker, PrefillWorker
    from dsv3.infer.cluster.rank import RankWorker

    if not opts.prefill_ranks:
        return RankWorker(engine, lockstep, rank)
    return (PrefillWorker if rank < opts.prefill_ranks else DecodeWorker)(engine, lockstep, rank)
