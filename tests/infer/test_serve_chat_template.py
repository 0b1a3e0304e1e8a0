"""`dsv3 serve` and `dsv3 chat` prompt with the checkpoint's own chat template (or --chat-template FILE), as
transformers' apply_chat_template renders and encodes it."""

import contextlib
import re
import shutil
import time

import httpx
import pytest
from transformers import AutoTokenizer

from dsv3.cli import main
from dsv3.testing.http import serve_in_threads

from .conftest import tiny_model

TEMPLATE = ("{{ bos_token }}{% for m in messages %}[{{ m.role | upper }}] {{ m.content }}{{ eos_token }}{% endfor %}"
            "{% if add_generation_prompt %}[ASSISTANT]{% endif %}")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def checkpoint(hf_tokenizer_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("templated")
    tiny_model(vocab=400).save_pretrained(folder)
    for path in hf_tokenizer_dir(TEMPLATE, name="templated-tok").iterdir():
        shutil.copy(path, folder / path.name)
    return folder


@contextlib.contextmanager
def served(monkeypatch, capsys, args):
    """`dsv3 serve ARGS` on a free port, its uvicorn loop in a thread; yields the base URL."""
    servers = serve_in_threads(monkeypatch)
    assert main(["serve", *args, "--port", "0", "--quiet", "--threads", "1"]) == 0
    port = re.search(r"listening on http://127\.0\.0\.1:(\d+)/v1", capsys.readouterr().err).group(1)
    try:
        deadline = time.time() + 20
        while not servers[0][0].started and time.time() < deadline:
            time.sleep(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        servers[0][0].should_exit = True
        servers[0][1].join(timeout=20)


def prompt_tokens(url: str) -> int:
    r = httpx.post(url + "/v1/chat/completions", timeout=30,
                   json={"messages": MESSAGES, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens"]


def test_serve_prompts_with_the_checkpoints_template(checkpoint, monkeypatch, capsys):
    want = AutoTokenizer.from_pretrained(checkpoint).apply_chat_template(MESSAGES, add_generation_prompt=True)
    with served(monkeypatch, capsys, ["--model", str(checkpoint)]) as url:
        assert prompt_tokens(url) == len(want["input_ids"])


def test_serve_chat_template_file_replaces_it(checkpoint, tmp_path, monkeypatch, capsys):
    mine = tmp_path / "mine.jinja"
    mine.write_text("{% for m in messages %}{{ m.content }} {% endfor %}")
    hf = AutoTokenizer.from_pretrained(checkpoint)
    want = hf.apply_chat_template(MESSAGES, chat_template=mine.read_text(), add_generation_prompt=True)
    assert len(want["input_ids"]) != len(hf.apply_chat_template(MESSAGES, add_generation_prompt=True)["input_ids"])
    with served(monkeypatch, capsys, ["--model", str(checkpoint), "--chat-template", str(mine)]) as url:
        assert prompt_tokens(url) == len(want["input_ids"])


@pytest.mark.parametrize("command", ["serve", "chat"])
def test_a_bad_chat_template_file_is_one_clear_error(checkpoint, tmp_path, command, capsys):
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for m in messages %}")
    for path, message in ((broken, "chat template line 1"), (tmp_path / "missing.jinja", "file not found")):
        assert main([command, "--model", str(checkpoint), "--chat-template", str(path)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error:") and message in err and err.count("\n") == 1 and "Traceback" not in err
