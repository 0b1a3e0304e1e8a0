"""`torchrun --nproc-per-node 4 -m dsv3 serve --ep 4`: four gloo processes, experts spread over them, attention
data-parallel, rank 0 the HTTP front end; driven by the `openai` client over real HTTP and compared with the
single-process server on the same weights. The last test on that group kills a worker rank: the front end
must answer 503 with an OpenAI-shaped JSON error, at once, rather than hang. Then the lossy wire formats,
and `--prefill-ranks 2` (disaggregation) with EPLB."""

import json
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

import httpx
import jsonschema
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from deepseek_tokens import deepseek_tokenizer  # noqa: E402

from conftest import tiny_model, tiny_tokenizer  # noqa: E402
from dsv3.infer.cluster.serve import GROUP_TIMEOUT_S  # noqa: E402
from dsv3.infer.engine import Engine  # noqa: E402
from dsv3.infer.server import create_app  # noqa: E402
from dsv3.testing.http import serving  # noqa: E402
from dsv3.testing.launch import free_port  # noqa: E402

openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")

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
    """A serving group's rank processes (or torchrun over them), its URL and its log."""

    def __init__(self, procs: list[subprocess.Popen]):
        self.procs, self.lines, self.url = procs, [], None
        for p in procs:
            threading.Thread(target=self._read, args=(p,), daemon=True).start()

    def _read(self, proc: subprocess.Popen) -> None:
        for line in proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def wait_ready(self) -> str:
        deadline = time.time() + START_TIMEOUT_S
        while time.time() < deadline:
            for line in list(self.lines):
                found = re.search(r"listening on (http://\S+)/v1", line)
                if found:
                    self.url = found.group(1)
                    return self.url
            if any(p.poll() is not None for p in self.procs):
                break
            time.sleep(0.2)
        raise AssertionError("the serving group did not start:\n" + "\n".join(self.lines[-40:]))

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)


def serve_args(checkpoint: Path, nproc: int, flags: tuple[str, ...]) -> list[str]:
    return ["-m", "dsv3", "serve", "--model", str(checkpoint), "--port", "0", "--quiet", "--max-batch", "4",
            "--ep", str(nproc), *flags]


@contextmanager
def serve_group(checkpoint: Path, nproc: int, *flags: str, torchrun: bool = True):
    """`torchrun --nproc-per-node N -m dsv3 serve --ep N ...`, or (``torchrun=False``) the N rank processes
    started directly with the environment torchrun gives them, as a cluster manager would start them: then
    a rank that dies leaves the others running (torchrun's agent would stop them all)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    spawn = dict(stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, start_new_session=True)
    args = serve_args(checkpoint, nproc, flags)
    if torchrun:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
        procs = [subprocess.Popen(cmd + args, env=env, **spawn)]
    else:
        master = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(nproc)}
        procs = [subprocess.Popen([sys.executable, *args], env={**env, **master, "RANK": str(r), "LOCAL_RANK": str(r)},
                                  **spawn) for r in range(nproc)]
    group = Group(procs)
    try:
        group.wait_ready()
        yield group
    finally:
        group.stop()


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
    with serve_group(checkpoint, 4, torchrun=False) as group:
        yield group


def test_ep4_greedy_completions_of_concurrent_requests_equal_one_process(ep4, reference):
    assert ask_all(ep4.url) == reference
    state = httpx.get(ep4.url + "/cluster").json()
    assert state["ranks"] == 4 and state["status"] == "ok" and state["in_flight"] == [0, 0, 0, 0]
    assert all(n >= 1 for n in state["assigned"]), state  # attention data-parallel: every rank decoded some
    assert sum(state["assigned"]) == len(PROMPTS)
    banner = "\n".join(ep4.lines)
    assert "4 of 16 routed experts per rank and layer, dispatch fp32, combine fp32" in banner


def test_ep4_streams_and_a_bad_request_harms_no_one(ep4, reference):
    """A streamed chat, a request refused (400), and one whose client goes away mid-stream, all while the
    concurrent greedy requests run: those still get the single-process answers."""
    c = client(ep4.url)
    name = c.models.list().data[0].id

    def bad() -> int:
        r = httpx.post(ep4.url + "/v1/completions", json={"model": name, "prompt": [10**6], "max_tokens": 3})
        return r.status_code

    def gone() -> None:
        with httpx.stream("POST", ep4.url + "/v1/completions", timeout=60,
                          json={"model": name, "prompt": "the cat", "max_tokens": 500, "stream": True}) as r:
            next(r.iter_lines())  # one chunk, then the client hangs up

    def streamed() -> str:
        chunks = c.chat.completions.create(model=name, messages=[{"role": "user", "content": "hello cat"}],
                                           max_tokens=8, temperature=0, stream=True)
        return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)

    with ThreadPoolExecutor(4) as pool:
        jobs = [pool.submit(f) for f in (bad, gone, streamed)]
        assert ask_all(ep4.url) == reference
        assert jobs[0].result() == 400
        jobs[1].result()
        text = jobs[2].result()
    plain = c.chat.completions.create(model=name, messages=[{"role": "user", "content": "hello cat"}], max_tokens=8,
                                      temperature=0)
    assert text == plain.choices[0].message.content
    deadline = time.time() + 30
    while httpx.get(ep4.url + "/cluster").json()["in_flight"] != [0, 0, 0, 0]:  # the cancelled one leaves
        assert time.time() < deadline, "a cancelled request stayed in its rank's batch"
        time.sleep(0.1)


def _metrics(url: str) -> dict:
    from prometheus_text import parse

    return parse(httpx.get(url + "/metrics").text)


def _expert_tokens(samples: dict) -> dict[tuple[int, int, int], float]:
    """{(rank, layer, expert): routed tokens} from /metrics."""
    out = {}
    for (name, labels), v in samples.items():
        if name == "dsv3_expert_tokens_total":
            d = dict(labels)
            out[int(d["rank"]), int(d["layer"]), int(d["expert"])] = v
    return out


def test_ep4_metrics_count_requests_and_the_expert_load_of_every_rank(ep4, checkpoint):
    """/metrics on a group's front end: the requests and their latencies, and every rank's expert load (the
    tokens its routers sent to each expert, gathered from the ranks at a step boundary)."""
    from prometheus_text import total

    import dsv3

    cfg = dsv3.load_pretrained(checkpoint).config
    moe_layers = cfg.num_hidden_layers - cfg.first_k_dense_replace + cfg.num_nextn_predict_layers
    before, assigned = _metrics(ep4.url), httpx.get(ep4.url + "/cluster").json()["assigned"]
    ask_all(ep4.url)
    deadline = time.time() + 30
    while httpx.get(ep4.url + "/cluster").json()["in_flight"] != [0, 0, 0, 0]:
        assert time.time() < deadline
        time.sleep(0.05)
    _metrics(ep4.url)  # asks the ranks for their counts: the next step (an idle group steps every 50 ms) has them
    time.sleep(1.0)
    after = _metrics(ep4.url)
    given = [a - b for a, b in zip(httpx.get(ep4.url + "/cluster").json()["assigned"], assigned, strict=True)]
    done = total(after, "dsv3_requests_total") - total(before, "dsv3_requests_total")
    assert done == len(PROMPTS)
    ttft = "dsv3_time_to_first_token_seconds_count"
    assert total(after, ttft) - total(before, ttft) == len(PROMPTS)
    old, new = _expert_tokens(before), _expert_tokens(after)
    assert set(new) == {(r, layer, e) for r in range(4) for layer in range(moe_layers) for e in range(16)}
    prompt_tokens = sum(len(ids) for ids in _prompt_ids(checkpoint))
    routed = 0
    for rank in range(4):
        per_layer = [sum(new[rank, layer, e] - old.get((rank, layer, e), 0) for e in range(16))
                     for layer in range(moe_layers)]
        assert per_layer[-1] == 0  # the MTP layer: no speculation here
        main = per_layer[:-1]
        assert len(set(main)) == 1 and main[0] % cfg.num_experts_per_tok == 0, per_layer  # every token, every layer
        assert (main[0] > 0) == (given[rank] > 0), (rank, per_layer, given)
        routed += main[0]
        rank_total = total(after, "dsv3_rank_expert_tokens_total", rank=rank)
        assert rank_total == sum(new[rank, layer, e] for layer in range(moe_layers) for e in range(16))
    assert routed >= cfg.num_experts_per_tok * prompt_tokens


def test_ep4_killing_a_worker_rank_answers_503_not_a_hang(ep4):
    """Runs last: it takes the group down. A request in flight and every later one end with HTTP 503 and
    OpenAI's error body within seconds; /health says so too."""
    name = client(ep4.url).models.list().data[0].id
    body = {"model": name, "prompt": "the cat", "max_tokens": 900}
    with ThreadPoolExecutor(1) as pool:
        inflight = pool.submit(httpx.post, ep4.url + "/v1/completions", json=body, timeout=60)
        deadline = time.time() + 30
        while httpx.get(ep4.url + "/cluster").json()["in_flight"] == [0, 0, 0, 0]:
            assert time.time() < deadline
            time.sleep(0.05)
        ep4.procs[2].kill()
        t0 = time.time()
        first = inflight.result()
    later = httpx.post(ep4.url + "/v1/completions", json=body, timeout=60)
    elapsed = time.time() - t0
    for r in (first, later):
        assert r.status_code == 503, r.text
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "service_unavailable"
        assert "lost a rank" in error["message"]
    assert elapsed < 30
    assert httpx.get(ep4.url + "/health").status_code == 503
    for rank in (1, 3):  # each worker rank left says why it stopped (rank 0 does not speak for them); one
        # waiting in a collective on a live rank 0 learns of the loss only when the group's timeout ends it
        ep4.procs[rank].wait(timeout=GROUP_TIMEOUT_S + 60)
        assert any(line.startswith(f"error: rank {rank}: the serving group lost a rank") for line in ep4.lines), \
            "\n".join(ep4.lines[-20:])


def test_fp8_dispatch_and_logfmt10_combine_agree_with_one_process_to_their_precision(checkpoint):
    """Lossy wire formats, measured on 2 gloo processes (teacher-forced logits and greedy completions; the
    full table is benchmarks/serve_ep_formats.py): FP8 (E4M3, 1x128 tiles) moves logits by a few percent of
    their range on this model, so nearly every argmax survives (the native formats are exact: the HTTP tests
above)."""
    from dsv3.testing.serve_scenarios import compare_formats

    prompts = [[5, 17, 33, 2, 90], [120, 7, 7, 64], [250, 1, 3, 9, 27, 81, 243], [42, 42]]
    (lossy,) = compare_formats(str(checkpoint), prompts, 8, [("fp8", "logfmt10")], world=2, timeout_s=240)
    assert 0 < lossy["max_logit_diff"] < 0.15 * lossy["max_abs_logit"]  # lossy, and not broken
    assert lossy["argmax_agree"] >= 0.9 * lossy["positions"]
    assert lossy["identical_completions"] >= 2


@pytest.fixture(scope="module")
def reference_mtp(checkpoint):
    """The single-process server with MTP speculation (greedy: the same tokens as without)."""
    import dsv3
    from dsv3.infer.loading import load_tokenizer

    engine = Engine(dsv3.load_pretrained(checkpoint), load_tokenizer(checkpoint), speculative=True)
    with serving(create_app(engine, model_name="ckpt", max_batch=4)) as url:
        return ask_all(url)


def test_prefill_ranks_2_of_4_with_eplb_equal_one_process_and_move_the_latent_cache(checkpoint, reference_mtp):
    """`torchrun --nproc-per-node 4 -m dsv3 serve --ep 4 --prefill-ranks 2 --speculative mtp`: ranks 0-1
    prefill (EP2), ranks 2-3 decode (EP2). Every prefilled request's c_kv and k_pe (main layers and the MTP
    layer) move to a decode rank; the bytes moved per token are the latent cache's own. Both sides hold 4
    redundant expert slots and rebalance them (EPLB) every 2 busy steps, requests in flight."""
    import dsv3

    cfg = dsv3.load_pretrained(checkpoint).config
    per_token = (cfg.num_hidden_layers + 1) * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4  # fp32, MTP included
    flags = ("--prefill-ranks", "2", "--speculative", "mtp", "--redundant-experts", "4", "--eplb-every", "2")
    with serve_group(checkpoint, 4, *flags) as group:
        assert ask_all(group.url) == reference_mtp
        state = httpx.get(group.url + "/cluster").json()
    assert state["prefill_ranks"] == [0, 1] and state["decode_ranks"] == [2, 3]
    assert sum(state["assigned"][:2]) == len(PROMPTS) and sum(state["assigned"][2:]) == len(PROMPTS)
    assert min(state["assigned"][2:]) >= 1  # both decode ranks decoded
    assert state["kv_tokens_moved"] == sum(len(t) for t in _prompt_ids(checkpoint))
    assert state["kv_bytes_per_token_moved"] == per_token
    assert f"{per_token:,} bytes per token" in "\n".join(group.lines)
    eplb = state["eplb"]  # experts rebalanced (4 replicas moved to the hot ones) while requests were in flight
    assert eplb["rebalances"] >= 1 and eplb["imbalance_after"] <= eplb["imbalance_before"]
    assert "10 expert slots per rank and layer (16 experts + 4 replicas" in "\n".join(group.lines)


def _prompt_ids(checkpoint: Path) -> list[list[int]]:
    from dsv3.infer.loading import load_tokenizer

    tok = load_tokenizer(checkpoint)
    return [tok.encode(p).ids for p in PROMPTS]



MTP_PROMPTS = [[4, 5, 6, 7], [20, 21, 3], [99, 5, 5, 5, 8], [7, 140, 2]]
POINT = {"type": "object", "additionalProperties": False, "required": ["x", "tag", "names"],
         "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99}, "tag": {"enum": ["a", "b"]},
                        "names": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2}}}
WEATHER = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
           "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_point", "parameters": POINT}}]


@pytest.fixture(scope="module")
def deepseek_checkpoint(tmp_path_factory):
    """A tiny model (with an MTP layer) whose tokenizer has DeepSeek's special tokens: it can write tool calls."""
    folder = tmp_path_factory.mktemp("ep_tools") / "tiny"
    tiny_model(300).save_pretrained(folder)
    deepseek_tokenizer().save(str(folder / "tokenizer.json"))
    return folder


@pytest.fixture(scope="module", params=[(), ("--prefill-ranks", "1")], ids=["ep2", "ep2-prefill-ranks-1"])
def ep2_mtp(deepseek_checkpoint, request):
    """`serve --ep 2 --speculative mtp`, and the same with rank 1 decoding the rows rank 0 prefilled."""
    with serve_group(deepseek_checkpoint, 2, "--speculative", "mtp", *request.param) as group:
        yield group


def test_ep2_metrics_count_mtp_drafts_and_queue_time_as_one_process_does(ep2_mtp, deepseek_checkpoint):
    """/metrics' MTP counters grow by the sum of what the engine counts for the same greedy requests,
    although the ranks' engines decoded them (their counts travel back with their events), and the
    queue-time histogram counts every request."""
    from prometheus_text import total

    import dsv3
    from dsv3.infer.engine import Request
    from dsv3.infer.loading import load_tokenizer

    direct = Engine(dsv3.load_pretrained(deepseek_checkpoint), load_tokenizer(deepseek_checkpoint),
                    speculative=True)
    drafted = accepted = 0
    for prompt in MTP_PROMPTS:
        direct.generate([Request(prompt, 12, ignore_eos=True)])
        drafted, accepted = drafted + direct.last_stats.drafted, accepted + direct.last_stats.accepted

    def ask(prompt: list[int]) -> None:
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        httpx.post(ep2_mtp.url + "/v1/completions", json=body, timeout=120).raise_for_status()

    before, assigned = _metrics(ep2_mtp.url), httpx.get(ep2_mtp.url + "/cluster").json()["assigned"]
    with ThreadPoolExecutor(len(MTP_PROMPTS)) as pool:
        list(pool.map(ask, MTP_PROMPTS))
    after, state = _metrics(ep2_mtp.url), httpx.get(ep2_mtp.url + "/cluster").json()

    def grown(name: str) -> float:
        return total(after, name) - total(before, name)

    assert state["assigned"][1] > assigned[1]  # rank 1 decoded some of them: its counts crossed to rank 0
    assert drafted > 0
    assert grown("dsv3_spec_decode_draft_tokens_total") == drafted
    assert grown("dsv3_spec_decode_accepted_tokens_total") == accepted
    assert grown("dsv3_request_queue_time_seconds_count") == len(MTP_PROMPTS)


def test_ep2_constrained_output_gives_valid_json_and_valid_tool_calls(ep2_mtp):
    """A json_schema request and a named tool_choice, concurrent and at temperature 1, are held to their
    grammars on the rank that decodes them (compiled there from the grammar's text; after a move, following
    the tokens generated so far)."""
    fmt = {"type": "json_schema", "json_schema": {"name": "point", "schema": POINT, "strict": True}}
    named = {"type": "function", "function": {"name": "get_weather"}}
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    c = client(ep2_mtp.url)

    def as_json(seed: int):
        return c.chat.completions.create(model="tiny", messages=ask, response_format=fmt, temperature=1.0,
                                         max_tokens=160, seed=seed).choices[0]

    def as_call(seed: int):
        return c.chat.completions.create(model="tiny", messages=ask, tools=TOOLS, tool_choice=named,
                                         temperature=1.0, max_tokens=160, seed=seed).choices[0]

    assigned = httpx.get(ep2_mtp.url + "/cluster").json()["assigned"]
    with ThreadPoolExecutor(4) as pool:
        jsons, calls = pool.map(as_json, range(4)), pool.map(as_call, range(4))
        jsons, calls = list(jsons), list(calls)
    state = httpx.get(ep2_mtp.url + "/cluster").json()
    assert state["assigned"][1] > assigned[1], state  # rank 1 decoded some: its own matchers held them
    for choice in jsons:
        assert choice.finish_reason == "stop", choice
        jsonschema.validate(json.loads(choice.message.content), POINT)
    for choice in calls:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
