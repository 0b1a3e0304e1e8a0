"""`torchrun --nproc-per-node 4 -m dsv3 serve --ep 4`: four gloo processes, experts spread over them, attention
data-parallel, rank 0 the HTTP front end; driven by the `openai` client over real HTTP and compared with the
single-process server on the same weights. The last test kills a worker rank: the front end must answer
503 with an OpenAI-shaped JSON error, at once, rather than hang."""

import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_infer_server import serving  # noqa: E402

from conftest import tiny_model, tiny_tokenizer  # noqa: E402
from dsv3.infer.engine import Engine  # noqa: E402
from dsv3.infer.server import create_app  # noqa: E402

openai = pytest.importorskip("openai")

START_TIMEOUT_S = 240  # four processes importing torch on a loaded 2-core machine
PROMPTS = ["the cat sat", "hello world, hello", "a dog ran in the park", "numbers 1 2 3", "User: hi",
           "the mat", "park dog cat", "hello model"]
MAX_TOKENS = [12, 7, 10, 16, 5, 9, 14, 11]  # different lengths: rows leave the batches at different steps


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny MLA + MoE model (16 routed experts, an MTP layer) with a tokenizer, saved as a checkpoint."""
    folder = tmp_path_factory.mktemp("ep_ckpt")
    tiny_model(layers=3).save_pretrained(folder)
    tiny_tokenizer().save(str(folder / "tokenizer.json"))
    return folder


class Group:
    """A `torchrun -m dsv3 serve` process tree: its URL, its rank processes and its log."""

    def __init__(self, proc: subprocess.Popen):
        self.proc, self.lines, self.url = proc, [], None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def wait_ready(self) -> str:
        deadline = time.time() + START_TIMEOUT_S
        while time.time() < deadline:
            for line in list(self.lines):
                found = re.search(r"listening on (http://\S+)/v1", line)
                if found:
                    self.url = found.group(1)
                    return self.url
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        raise AssertionError("the serving group did not start:\n" + "\n".join(self.lines[-40:]))

    def rank_pid(self, rank: int) -> int:
        """The pid of the process torchrun started for ``rank`` (read from its environment)."""
        for child in _children(self.proc.pid):
            env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
            if f"RANK={rank}".encode() in env:
                return child
        raise AssertionError(f"no process for rank {rank}")


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


@contextmanager
def serve_group(checkpoint: Path, nproc: int, *flags: str):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "-m",
           "dsv3", "serve", "--model", str(checkpoint), "--port", "0", "--quiet", "--max-batch", "4",
           "--ep", str(nproc), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env,
                            start_new_session=True)
    group = Group(proc)
    try:
        group.wait_ready()
        yield group
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


def client(url: str):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def ask_all(url: str) -> list[str]:
    """Every prompt at once (greedy completions), each from its own thread: concurrent requests."""
    c = client(url)
    name = c.models.list().data[0].id

    def one(i: int) -> str:
        reply = c.completions.create(model=name, prompt=PROMPTS[i], max_tokens=MAX_TOKENS[i], temperature=0)
        return reply.choices[0].text

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        return list(pool.map(one, range(len(PROMPTS))))


@pytest.fixture(scope="module")
def reference(checkpoint):
    """The single-process server's greedy completions of the same concurrent requests."""
    import dsv3
    from dsv3.infer.loading import load_tokenizer

    engine = Engine(dsv3.load_pretrained(checkpoint), load_tokenizer(checkpoint))
    with serving(create_app(engine, model_name="ckpt", max_batch=4)) as url:
        return ask_all(url)


@pytest.fixture(scope="module")
def ep4(checkpoint):
    with serve_group(checkpoint, 4) as group:
        yield group
