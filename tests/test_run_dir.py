"""`--model RUN_DIR`: a training run folder resolves to its latest checkpoint, with the layout
`dsv3 train` writes (dsv3.train.checkpoints), and anything else is one clear error."""

import os

import pytest

from dsv3.errors import DSV3Error
from dsv3.run_dir import resolve_checkpoint


def checkpoint(folder):
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    return folder


def test_a_checkpoint_folder_is_itself(tmp_path):
    assert resolve_checkpoint(checkpoint(tmp_path / "ckpt")) == tmp_path / "ckpt"


def test_a_run_folder_gives_its_latest_checkpoint(tmp_path):
    run = tmp_path / "run"
    checkpoint(run / "checkpoints" / "step-000100")
    checkpoint(run / "checkpoints" / "step-000200")
    os.symlink("checkpoints/step-000100", run / "latest")  # latest is what training says, not the largest
    assert resolve_checkpoint(run).resolve() == (run / "checkpoints" / "step-000100").resolve()
    (run / "latest").unlink()
    os.symlink("checkpoints/step-000300", run / "latest")  # dangling: the newest complete step instead
    checkpoint(run / "checkpoints" / ".step-000300.tmp-1")  # a staging folder is never complete
    assert resolve_checkpoint(run) == run / "checkpoints" / "step-000200"


def test_the_real_training_layout(tmp_path, tiny_train_config):
    from dsv3.model import Transformer
    from dsv3.train.checkpoints import save_checkpoint

    model = Transformer(tiny_train_config)
    for step in (1, 2):
        save_checkpoint(tmp_path, step, model, {}, {}, lambda folder: None, keep_last=2)
    assert resolve_checkpoint(tmp_path).resolve() == (tmp_path / "checkpoints" / "step-000002").resolve()


@pytest.mark.parametrize("make, message", [
    (lambda p: (p / "checkpoints").mkdir(parents=True), "holds no checkpoint yet"),
    (lambda p: p.mkdir() or (p / "run.json").write_text("{}"), "holds no checkpoint yet"),
    (lambda p: p.mkdir(), "has no config.json"),
    (lambda p: p.write_text("x"), "is a file"),
    (lambda p: None, "not found"),
])
def test_anything_else_is_one_clear_error(tmp_path, make, message):
    make(tmp_path / "x")
    with pytest.raises(DSV3Error, match=message):
        resolve_checkpoint(tmp_path / "x")


def test_load_pretrained_and_convert_take_a_training_run_folder(tmp_path, tiny_train_config):
    import torch

    from dsv3 import load_pretrained
    from dsv3.convert import convert_checkpoint
    from dsv3.model import Transformer
    from dsv3.train.checkpoints import save_checkpoint

    torch.manual_seed(0)
    model = Transformer(tiny_train_config).eval()
    save_checkpoint(tmp_path / "run", 1, model, {}, {}, lambda folder: None, keep_last=2)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        assert torch.equal(load_pretrained(tmp_path / "run")(ids), model(ids))
    convert_checkpoint(tmp_path / "run", tmp_path / "bf16", "bf16")
    assert (tmp_path / "bf16" / "config.json").is_file()
