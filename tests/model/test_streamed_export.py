"""The end-of-run HF export of a sharded training checkpoint is streamed: it writes what `save_pretrained` of
the whole model writes, tensor for tensor, while holding about one shard (no process holds the whole model)."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dsv3 import load_pretrained
from dsv3.checkpoint import INDEX_NAME, SINGLE_NAME, export_sharded
from dsv3.config import ModelConfig
from dsv3.errors import DSV3Error
from dsv3.model import Transformer
from dsv3.parallel.checkpoint import save_state, whole_model

CFG = ModelConfig(vocab_size=64, hidden_size=48, intermediate_size=64, moe_intermediate_size=16,
                  num_hidden_layers=2, num_attention_heads=2, q_lora_rank=None, kv_lora_rank=16,
                  qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, n_routed_experts=4,
                  num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
                  num_nextn_predict_layers=1, rope_scaling=None).validate()


def _training_checkpoint(folder: Path, cfg: ModelConfig, seed: int = 0) -> Path:
    """A one-process DCP checkpoint of a random model, as the trainer writes it (keys of the whole model)."""
    torch.manual_seed(seed)
    model = Transformer(cfg)
    with torch.no_grad():
        for t in model.parameters():
            t.normal_(0, 0.1)
    save_state(folder / "dcp", model, None)
    return folder / "dcp"


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_streamed_export_writes_what_the_whole_model_export_writes(tmp_path):
    dcp = _training_checkpoint(tmp_path, CFG)
    whole_model(dcp, CFG).save_pretrained(tmp_path / "whole")
    export_sharded(dcp, CFG, tmp_path / "streamed")
    assert (tmp_path / "streamed" / SINGLE_NAME).read_bytes() == (tmp_path / "whole" / SINGLE_NAME).read_bytes()
    assert (tmp_path / "streamed" / "config.json").read_text() == (tmp_path / "whole" / "config.json").read_text()


def test_streamed_export_in_shards_equals_the_whole_model_tensor_for_tensor(tmp_path):
    dcp = _training_checkpoint(tmp_path, CFG)
    whole_model(dcp, CFG).save_pretrained(tmp_path / "whole", max_shard_bytes=20_000)
    export_sharded(dcp, CFG, tmp_path / "streamed", max_shard_bytes=20_000)
    whole, streamed = _tensors(tmp_path / "whole"), _tensors(tmp_path / "streamed")
    assert list(streamed) == list(whole) and len(list((tmp_path / "streamed").glob("*.safetensors"))) > 2
    for name, t in whole.items():
        assert streamed[name].dtype == t.dtype and torch.equal(streamed[name], t), name
    assert "model.layers.2.embed_tokens.weight" in streamed  # the MTP layer's copies, as DeepSeek ships them
    assert json.loads((tmp_path / "streamed" / INDEX_NAME).read_text()) == \
        json.loads((tmp_path / "whole" / INDEX_NAME).read_text())
    ids = torch.tensor([[1, 5, 9, 13, 2]])
    with torch.no_grad():
        assert torch.equal(load_pretrained(tmp_path / "streamed")(ids), whole_model(dcp, CFG).eval()(ids))


def test_a_checkpoint_of_another_shape_is_refused_by_name(tmp_path):
    dcp = _training_checkpoint(tmp_path, CFG)
    with pytest.raises(DSV3Error, match="does not match its config.json: mis-shaped model.embed_tokens.weight"):
        export_sharded(dcp, CFG.replace(vocab_size=80), tmp_path / "out")
    assert not (tmp_path / "out").exists()


BIG = CFG.replace(hidden_size=256, moe_intermediate_size=256, n_routed_experts=64, num_hidden_layers=4,
                  num_nextn_predict_layers=0, vocab_size=512)
EXPORT = textwrap.dedent("""
    import sys, torch
    import torch.distributed.checkpoint
    from pathlib import Path
    from dsv3.checkpoint import export_sharded
    from dsv3.config import ModelConfig
    from dsv3.model import Transformer

    def vm(field):
        return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(field + ":"))

    cfg = ModelConfig.from_json(Path(sys.argv[1]) / "config.json")
    with torch.device("meta"):
        Transformer(cfg)  # the imports and a meta build: the baseline, not the export
    before = vm("VmRSS")
    export_sharded(Path(sys.argv[1]) / "dcp", cfg, Path(sys.argv[2]), max_shard_bytes=int(sys.argv[3]))
    print(vm("VmHWM") - before)
""")


@pytest.fixture
def big_checkpoint(tmp_path_factory) -> tuple[Path, int]:
    """A training checkpoint folder (config.json, dcp/) of about 150 MB, and its bytes."""
    folder = tmp_path_factory.mktemp("big")
    _training_checkpoint(folder, BIG)
    BIG.save_json(folder / "config.json")
    model_bytes = sum(f.stat().st_size for f in (folder / "dcp").glob("*.distcp"))
    assert model_bytes > 120e6
    return folder, model_bytes


def _export_growth(src: Path, dst: Path, shard_bytes: int) -> int:
    """How much the peak resident memory of a process exporting ``src`` grows (VmHWM above the baseline)."""
    out = subprocess.run([sys.executable, "-c", EXPORT, str(src), str(dst), str(shard_bytes)],
                         capture_output=True, text=True, timeout=300, check=True)
    return int(out.stdout.split()[-1])


def test_streamed_export_holds_about_one_shard_not_the_model(big_checkpoint, tmp_path):
    """Measured: the exporting process's peak resident memory grows by a few shards' worth, well below the
    model's size (the whole-model export, `whole_model(...).save_pretrained`, grew by twice the model's
    size here: 313 MB for a 156 MB checkpoint)."""
    src, model_bytes = big_checkpoint
    grown = _export_growth(src, tmp_path / "hf", 4 * 2**20)
    assert grown < 0.3 * model_bytes, (grown, model_bytes)
    assert len(list((tmp_path / "hf").glob("*.safetensors"))) > 10

