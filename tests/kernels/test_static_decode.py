"""The static-shape decode step (gpt-fast's approach, for torch.compile and CUDA graphs) standing alone, over a
plain cache it owns (one page per row), against the module path: the same logits step by step, with a masked
slot, and one graph for every step once compiled. Over an engine's pool of pages: tests/kernels/test_graph_decode.py."""

import pytest
import torch

from dsv3.config import preset
from dsv3.errors import DSV3Error
from dsv3.infer.engine import Engine, Request
from dsv3.kernels.static_decode import StaticDecode, greedy
from dsv3.model import Transformer

CFG = preset("nano").replace(num_hidden_layers=2)  # one dense layer, one MoE layer


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Transformer(CFG).eval()


@pytest.mark.parametrize("path", ["ops", "modules"])
def test_each_step_equals_the_module_path_with_a_masked_slot(model, path):
    """Row 1 has a slot its queries must not see (a pad or a rejected draft's hole); over the CPU ops and over
    the model's modules (the CUDA code: each row's slots gathered from its page)."""
    B, P, steps = 2, 6, 5
    prompt = torch.randint(0, CFG.vocab_size, (B, P))
    static = StaticDecode(model, B, 16)
    if path == "modules":
        static.plans = None
    reference = model.new_cache(B, 16)
    valid = torch.zeros(B, 16, dtype=torch.bool)
    valid[:, :P] = True
    with torch.no_grad():
        got = static.prefill(prompt)
        want = model(prompt, cache=reference)[:, -1]
        valid[1, 2] = False  # from now on, row 1 does not see slot 2
        for t in range(P, P + steps):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            token = want.argmax(-1)[:, None]
            valid[:, t] = True
            slot = torch.tensor(t)
            got = static(token, slot.expand(B)[:, None], slot, valid)
            want = model(token, positions=slot.expand(B)[:, None], cache=reference, start_pos=t,
                         mask=valid[:, None, : t + 1])[:, -1]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(static.kv[:, :, : P + steps], reference.kv[:, :, : P + steps], rtol=1e-5, atol=1e-6)


def test_greedy_equals_the_engine(model):
    prompts = torch.randint(0, CFG.vocab_size, (2, 7))
    engine = Engine(model, fast=False, eos_token_ids=frozenset())
    want = [r.token_ids for r in engine.generate([Request(p, 10) for p in prompts.tolist()])]
    static = StaticDecode(model, 2, 32)
    assert greedy(static, static, prompts, 10).tolist() == want


def test_unsupported_layouts_are_refused_clearly(model):
    handle = model.main_layers[1].mlp.register_forward_hook(lambda *a: None)
    try:
        with pytest.raises(DSV3Error, match="layer 1 has forward hooks"):
            StaticDecode(model, 1, 8)
    finally:
        handle.remove()
    from dsv3.infer.fp8_weights import to_fp8_weights

    torch.manual_seed(0)
    fp8 = to_fp8_weights(Transformer(CFG).to(torch.bfloat16).eval())
    with pytest.raises(DSV3Error, match="plain GroupedExperts"):
        StaticDecode(fp8, 1, 8)


def test_compiled_step_is_one_graph_for_every_step(model):
    """fullgraph=True makes a graph break an error; after the first step no step may compile again (a
    Python int position or a data-dependent shape would), which CUDA-graph replay depends on."""
    import torch._dynamo

    torch._dynamo.reset()
    prompts = torch.randint(0, CFG.vocab_size, (2, 5))
    static = StaticDecode(model, 2, 24)
    eager = greedy(static, static, prompts, 8)
    step = static.compiled()
    static.kv.zero_(), static.pe.zero_()
    first = greedy(step, static, prompts, 2)  # compiles once
    with torch._dynamo.config.patch(error_on_recompile=True):  # (monkeypatch's undo deletes a config entry)
        assert torch.equal(greedy(step, static, prompts, 8), eager)
    assert torch.equal(first, eager[:, :2])


def test_the_compiled_cpu_step_is_a_graph_of_the_kernel_ops_with_the_module_paths_greedy_tokens(model):
    """On the CPU the static step runs over torch.ops.dsv3.* (kernels/ops.py): compiled with fullgraph=True, its
    one graph calls every kind of op (the C kernels or their references run inside them), and its greedy
    tokens are the engine's module path's, three prompts together."""
    import torch._dynamo

    torch._dynamo.reset()
    graphs = []

    def recording(gm, example_inputs):
        graphs.append({str(node.target).removesuffix(".default") for node in gm.graph.nodes
                       if node.op == "call_function"})
        return gm.forward

    prompts = torch.randint(0, CFG.vocab_size, (3, 6))
    engine = Engine(model, fast=False, eos_token_ids=frozenset())
    want = [r.token_ids for r in engine.generate([Request(p, 10) for p in prompts.tolist()])]
    static = StaticDecode(model, 3, 32)
    assert static.plans is not None
    step = torch.compile(static, fullgraph=True, dynamic=False, backend=recording)
    assert greedy(step, static, prompts, 10).tolist() == want
    assert len(graphs) == 1
    ops = {"dsv3.linear", "dsv3.rms_norm", "dsv3.route", "dsv3.swiglu_experts", "dsv3.mla_decode"}
    assert ops <= graphs[0], ops - graphs[0]


def test_the_compiled_cpu_step_of_a_bf16_model_is_one_graph_with_the_eager_steps_tokens(model):
    """A bf16 model's router is read in fp32 (a copy kept between steps, keyed on the tensors' addresses: Python
    state no graph can hold): compiled, the conversion is in the graph, which stays one graph, and its greedy
    tokens are those of the same step run eagerly."""
    import torch._dynamo

    torch._dynamo.reset()
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    bf16 = Transformer(CFG).eval()
    bf16.load_state_dict(model.state_dict())
    bf16 = bf16.to(torch.bfloat16)
    prompts = torch.randint(0, CFG.vocab_size, (2, 6))
    static = StaticDecode(bf16, 2, 32)
    assert static.plans is not None
    eager = greedy(static, static, prompts, 8)
    static.kv.zero_(), static.pe.zero_()
    step = torch.compile(static, fullgraph=True, dynamic=False, backend=recording)
    assert torch.equal(greedy(step, static, prompts, 8), eager)
    assert len(graphs) == 1


@pytest.mark.parametrize("rows", [1, 3, 16])
def test_grouped_experts_equal_the_reference_for_any_routing(rows):
    """The grouped path (pairs sorted by expert, one grouped GEMM) against float64 arithmetic, beside the gathered
    path it replaces, in bf16: rows that share experts, experts no row chose, and every row on the same experts;
    compiled with fullgraph=True too (no shape may depend on the routing)."""
    from dsv3.kernels.static_decode import grouped_mm_runs
    from dsv3.model.kernels import gathered_swiglu, grouped_swiglu

    g = torch.Generator().manual_seed(rows)
    E, I, D, K = 16, 64, 128, 4
    w = [torch.randn(E, I, D, generator=g) / 8, torch.randn(E, I, D, generator=g) / 8,
         torch.randn(E, D, I, generator=g) / 8]
    x = torch.randn(rows, D, generator=g)
    gates = torch.rand(rows, K, generator=g)
    shared = torch.arange(K).expand(rows, K)  # every row on experts 0-3: one group of all rows, 12 empty ones
    spread = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(rows)])
    bf = [t.bfloat16() for t in (x, *w)]
    assert grouped_mm_runs(bf[1], bf[3]) and not grouped_mm_runs(w[0], w[2])
    compiled = torch.compile(grouped_swiglu, fullgraph=True, dynamic=False, backend="eager")
    for idx in (shared, spread):
        want = gathered_swiglu(x.double(), idx, gates.double(), *(t.double() for t in w))
        error = lambda got, want=want: float((got.double() - want).norm() / want.norm())  # noqa: E731
        got = grouped_swiglu(bf[0], idx, gates, *bf[1:])
        assert got.dtype == torch.bfloat16 and got.shape == (rows, D)
        assert error(got) < 1e-2
        assert error(got) < 1.5 * error(gathered_swiglu(bf[0], idx, gates, *bf[1:])) + 1e-3
        torch.testing.assert_close(compiled(bf[0], idx, gates, *bf[1:]), got)


def test_a_bf16_step_on_the_modules_runs_the_grouped_experts_in_one_graph(model):
    """In bf16 the static step's routed experts are the grouped GEMM (what a GPU from compute capability 9.0 runs
    in its CUDA graph): compiled with fullgraph=True it follows the model's module path step by step, and no step
    after the first compiles again."""
    import torch._dynamo

    torch._dynamo.reset()
    graphs = []

    def recording(gm, example_inputs):
        graphs.append([str(node.target) for node in gm.graph.nodes if node.op == "call_function"])
        return gm.forward

    bf16 = Transformer(CFG).eval()
    bf16.load_state_dict(model.state_dict())
    bf16 = bf16.to(torch.bfloat16)
    B, P, steps = 2, 5, 4
    prompt = torch.randint(0, CFG.vocab_size, (B, P))
    static = StaticDecode(bf16, B, 16)
    static.plans = None  # the model's modules: the code a GPU runs
    step = torch.compile(static, fullgraph=True, dynamic=False, backend=recording)
    reference = bf16.new_cache(B, 16)
    valid = torch.zeros(B, 16, dtype=torch.bool)
    valid[:, :P] = True
    with torch.no_grad():
        static.prefill(prompt)
        want = bf16(prompt, cache=reference)[:, -1]
        for t in range(P, P + steps):
            token = want.argmax(-1)[:, None]
            valid[:, t] = True
            slot = torch.tensor(t)
            with torch._dynamo.config.patch(error_on_recompile=t > P):
                got = step(token, slot.expand(B)[:, None], slot, valid)
            want = bf16(token, positions=slot.expand(B)[:, None], cache=reference, start_pos=t)[:, -1]
            assert float((got.float() - want.float()).norm() / want.float().norm()) < 2e-2
    assert len(graphs) == 1
    assert sum("_grouped_mm" in target for target in graphs[0]) == 3  # one MoE layer: gate, up, down


def test_a_grouped_gemm_that_errs_or_is_wrong_leaves_the_step_on_the_gathered_experts(monkeypatch):
    """The probe a CUDA device must pass before the static step takes the grouped GEMM (run here on the CPU, whose
    grouped GEMM passes it): a build whose ``torch._grouped_mm`` raises, or gives other numbers, fails it."""
    from dsv3.kernels import static_decode as kernels

    cpu = torch.device("cpu")
    monkeypatch.setattr(kernels, "_PROBED", {})
    assert kernels._grouped_mm_probe(cpu)
    real = torch._grouped_mm

    def raising(*args, **kwargs):
        raise RuntimeError("no kernel image is available for execution on the device")

    for broken in (raising, lambda *args, **kwargs: torch.zeros_like(real(*args, **kwargs))):
        monkeypatch.setattr(kernels, "_PROBED", {})
        monkeypatch.setattr(torch, "_grouped_mm", broken)
        assert not kernels._grouped_mm_probe(cpu)
