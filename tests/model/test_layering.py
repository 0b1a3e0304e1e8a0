"""Dependencies run one way (`lint-imports` checks the layers, pyproject.toml's [tool.importlinter]; this file
what it cannot): the model's one lazy import of a higher layer stays lazy; the FP8 weight-block format and the
router's fp32 rule live in one place; test harnesses live in dsv3.testing, not in the library's parallel
package."""

import importlib.util
import subprocess
import sys

import pytest
import torch

from dsv3 import checkpoint
from dsv3.model import Transformer
from dsv3.model.moe import stays_fp32
from dsv3.precision import fp8
from dsv3.testing.ep_scenarios import tiny_config


def test_the_model_s_one_import_of_a_higher_layer_stays_lazy():
    """`lint-imports` (pyproject.toml) checks which layer imports which, but not when: its one allowed
    exception, Transformer.save_pretrained handing the model to dsv3.checkpoint, must import it only when
    called. In a fresh interpreter, `import dsv3.model` loads the model and no checkpoint, parallel, train,
    infer or testing module (the server's and plots' libraries: tests/test_imports.py)."""
    code = "import sys\nimport dsv3.model\nprint(' '.join(m for m in sys.modules if m.startswith('dsv3')))\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    loaded = set(out.split())
    higher = ("dsv3.checkpoint", "dsv3.parallel", "dsv3.train", "dsv3.infer", "dsv3.testing")
    assert "dsv3.model.transformer" in loaded and not [m for m in loaded if m.startswith(higher)]


def test_init_buffers_completes_a_model_loaded_on_the_meta_device():
    torch.manual_seed(0)
    source = Transformer(tiny_config(2)).train()
    with torch.device("meta"):
        copy = Transformer(tiny_config(2))
    copy.load_state_dict(source.state_dict(), strict=True, assign=True)
    copy.init_buffers("cpu")
    copy.train()
    assert not any(b.is_meta for b in copy.buffers())
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    assert torch.equal(copy.loss(ids, ids).loss, source.loss(ids, ids).loss)
    assert all(torch.equal(a.expert_load, b.expert_load) for a, b in zip(copy.moe_layers(), source.moe_layers(),
                                                                          strict=True))


def test_the_checkpoint_fp8_block_format_is_the_precision_module_s():
    assert checkpoint.quantize_fp8_blocks is fp8.quantize_weight_blocks
    assert checkpoint.dequantize_fp8_blocks is fp8.dequantize_weight_blocks
    w = torch.randn(3, 200, 130, generator=torch.Generator().manual_seed(0))
    w[1, :128, :128] = 0  # an all-zero block: DeepSeek's scale floor
    q, scale_inv = fp8.quantize_weight_blocks(w)  # stacked experts, block by block
    assert scale_inv.shape == (3, 2, 2) and float(scale_inv[1, 0, 0]) == pytest.approx(1e-12)
    for e in range(3):
        q_e, s_e = fp8.quantize_weight_blocks(w[e])
        assert torch.equal(q_e.view(torch.uint8), q[e].view(torch.uint8)) and torch.equal(s_e, scale_inv[e])
    deq = fp8.dequantize_weight_blocks(q, scale_inv)
    assert float((deq - w).norm() / w.norm()) < 0.05  # E4M3: 3 mantissa bits


def test_the_router_alone_stays_fp32(tmp_path):
    assert stays_fp32("model.layers.3.mlp.gate.weight")
    assert stays_fp32("model.layers.3.mlp.gate.e_score_correction_bias")
    assert not stays_fp32("model.layers.3.mlp.experts.0.gate_proj.weight")
    torch.manual_seed(0)
    Transformer(tiny_config(2)).save_pretrained(tmp_path / "ckpt", dtype=torch.bfloat16)
    model = checkpoint.load_pretrained(tmp_path / "ckpt")
    dtypes = {name: t.dtype for name, t in model.state_dict().items()}
    assert {d for n, d in dtypes.items() if stays_fp32(n)} == {torch.float32}
    assert {d for n, d in dtypes.items() if not stays_fp32(n)} == {torch.bfloat16}


def test_test_harnesses_live_in_dsv3_testing():
    assert importlib.util.find_spec("dsv3.parallel.scenarios") is None
    assert importlib.util.find_spec("dsv3.parallel.launch") is None
    assert importlib.util.find_spec("dsv3.testing.launch") is not None
    assert importlib.util.find_spec("dsv3.testing.ep_scenarios") is not None
