"""`parallelize(model, layout)` in one process: the all-ones layout trains exactly like the bare model (the
trainer's only path), a simulated combine format reaches the local dispatchers, the layouts that do not
cannot run are refused with one clear error.
(DDP and EP layouts run on gloo processes in tests/train and tests/parallel/test_ep_training.py.)"""

import copy

import pytest
import torch

from dsv3.errors import DSV3Error
from dsv3.layout import Layout
from dsv3.model import LocalDispatcher, Transformer
from dsv3.parallel.parallelize import Parallelized, parallelize
from dsv3.testing.ep_scenarios import tiny_config


def tiny_model(seed=0) -> Transformer:
    cfg = tiny_config(2)
    torch.manual_seed(seed)
    return Transformer(cfg).train()


def test_one_process_is_the_all_ones_layout_and_trains_like_the_bare_model():
    model, bare = tiny_model(), tiny_model()
    parallel = parallelize(model)
    assert type(parallel) is Parallelized and parallel.layout == Layout() and parallel.full_model() is model
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    for _ in range(2):  # micro-batch accumulation: no_sync is a plain context here
        with parallel.no_sync():
            loss, parts = parallel(ids, ids)
        loss.backward()
        bare.loss(ids, ids).loss.backward()
        assert float(parts[0]) == float(loss.detach())
    norm = parallel.sync_and_clip(0.5)
    bare_norm = torch.nn.utils.clip_grad_norm_(bare.parameters(), 0.5)
    assert norm == float(bare_norm)
    for p, q in zip(model.parameters(), bare.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    parallel.reduce_expert_loads()
    assert all(torch.equal(a.expert_load, b.expert_load) for a, b in zip(model.moe_layers(), bare.moe_layers(),
                                                                          strict=True))
    assert parallel.parameter_count() == sum(p.numel() for p in bare.parameters())
    assert parallel.windows_for_eval([0, 1, 2]) == [0, 1, 2]


def test_a_combine_format_without_ep_is_simulated_by_the_local_dispatchers():
    model = tiny_model()
    reference = copy.deepcopy(model)
    parallelize(model, Layout(combine="logfmt8"))
    assert {d.combine_format for d in model.modules() if isinstance(d, LocalDispatcher)} == {"logfmt8"}
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    assert not torch.equal(model(ids), reference(ids))  # rounded for real


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        (Layout(pp=2), "needs pp x dp = 2 processes, but 1 are running"),
        (Layout(pp=2, ep=2), "--ep 2 must divide the number of data-parallel processes of each pipeline stage"),
        (Layout(pp=2, dp_shard="zero1"), "--dp-shard zero1 shards each stage over its data-parallel replicas"),
        (Layout(pp=2, dp=2, dp_shard="fsdp"), "needs pp x dp = 4 processes, but 1 are running"),  # it exists
        (Layout(tp=2), "tensor parallelism (tp=2) is modelled by `dsv3 plan` only"),
        (Layout(pp=2, schedule="gpipe"), "--pp-schedule must be one of"),
        (Layout(dp_shard="zero1"), "--dp-shard zero1 shards over the data-parallel processes but only one"),
        (Layout(dp_shard="zero3"), "--dp-shard must be one of none, zero1, fsdp"),
        (Layout(dp=4), "needs pp x dp = 4 processes, but 1 are running"),
        (Layout(ep=4), "--ep 4 must divide the number of data-parallel processes (1)"),
        (Layout(combine="fp4"), "--moe-output-format must be one of"),
        (Layout(ep=0), "ep must be at least 1"),
    ],
)
def test_layouts_that_cannot_run_are_refused(layout, message):
    with pytest.raises(DSV3Error, match=message.replace("(", r"\(").replace(")", r"\)")):
        parallelize(tiny_model(), layout)


def test_ep_layout_checks_before_any_process_group_is_needed():
    assert Layout(dp=4, ep=2, gpus_per_node=2).check(4).ep == 2  # EP over part of the dp ranks
    with pytest.raises(DSV3Error, match="--ep 3 must divide the number of data-parallel processes"):
        Layout(dp=4, ep=3, gpus_per_node=1).check(4)
    with pytest.raises(DSV3Error, match="--gpus-per-node 3 must divide"):
        Layout(dp=4, ep=4, gpus_per_node=3).check(4)
    with pytest.raises(DSV3Error, match="EP wire formats"):
        Layout(dp=4, ep=4, gpus_per_node=2, dispatch="fp16").check(4)
    assert Layout(dp=4, ep=4, gpus_per_node=2, dispatch="fp8").ep_combine == "bf16"


def test_collective_layouts_give_every_rank_as_many_eval_windows():
    """EP and FSDP forwards are collectives: a rank without a window would hang the others (EP cut the list
    to ``max(world, ...)`` windows, which with fewer windows than ranks left some ranks none)."""
    from dsv3.parallel.parallelize import equal_share

    assert equal_share(list(range(9)), 4) == list(range(8))
    assert equal_share([0], 4) == [0, 0, 0, 0]
    assert equal_share([0, 1, 2], 4) == [0, 1, 2] * 4
    assert equal_share([], 4) == []
    ep = Parallelized.__new__(Parallelized)  # only the window rule: no process group needed
    ep.world, ep.layout, ep.pipe = 4, Layout(dp=4, ep=4), None
    assert ep.windows_for_eval([7]) == [7, 7, 7, 7]
    # a pipeline evaluates through its stages, one pass per data-parallel replica: as many on each replica
    ep.layout, ep.pipe = Layout(pp=2, dp=2, ep=2), object()
    assert ep.windows_for_eval([7]) == [7, 7]


def test_a_layout_fitted_to_another_world_keeps_what_still_fits():
    """`Layout.fitted`: what a resume without layout flags takes when the saved layout does not fit."""
    pp2_ep2 = Layout(pp=2, dp=2, ep=2, gpus_per_node=2, schedule="dualpipev", microbatches=4)
    assert pp2_ep2.fitted(8, n_experts=8) == Layout(pp=2, dp=4, ep=2, gpus_per_node=2, schedule="dualpipev",
                                                    microbatches=4)  # stages kept, more replicas
    assert pp2_ep2.fitted(1, n_experts=8) == Layout()  # one process: nothing left to split
    assert pp2_ep2.fitted(3, n_experts=8) == Layout(dp=3)  # 2 stages do not divide 3; ep2 does not divide 3
    ep4_fsdp = Layout(dp=4, ep=4, dp_shard="fsdp", gpus_per_node=2)
    assert ep4_fsdp.fitted(2, n_experts=8) == Layout(dp=2, ep=2, dp_shard="fsdp", gpus_per_node=2)
    assert ep4_fsdp.fitted(6, n_experts=8) == Layout(dp=6, ep=2, dp_shard="fsdp", gpus_per_node=2)
    assert Layout(dp=4, ep=4, gpus_per_node=1).fitted(6, n_experts=9) == Layout(dp=6, ep=3)  # 3 | 9 and 3 | 6
    for world in range(1, 9):
        assert pp2_ep2.fitted(world, 8).check(world).world == world
