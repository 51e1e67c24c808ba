"""The memory calculator, preflight's fit check, cost, init and verify-model for the dpo, reward and PPO jobs.

Each figure is checked against arithmetic done by hand on the shape: a reference adds exactly the weights' bytes,
precompute_reference and LoRA remove it, pairs double the activations, a value head and a score head add a
Linear(hidden, 1) trained in full.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from prime_train.config.loader import load_config
from prime_train.config.schema import Config
from prime_train.validator.memory import estimate, inputs_from_config, inputs_from_flags
from prime_train.validator.memory_inputs import GIB, MemoryInputError

CONFIGS = Path(__file__).parent / "data" / "model_configs"
LLAMA31_8B = json.loads((CONFIGS / "Llama-3.1-8B" / "config.json").read_text())
LLAMA31_8B_PARAMS = 8_030_261_248
QWEN25_7B = json.loads((CONFIGS / "Qwen2.5-7B-Instruct" / "config.json").read_text())
QWEN25_7B_PARAMS = 7_615_616_512

# the tiny default (engine/model.py's random-initialised llama): hidden 128, 2 layers, 4 heads of 32, MLP 512, vocab
# 320, tied embeddings: 320·128 + 2 · (4·128² + 3·128·512 + 2·128) + 128
TINY_PARAMS = 320 * 128 + 2 * (4 * 128 * 128 + 3 * 128 * 512 + 2 * 128) + 128
TINY_TOKENS = 16 * 128  # micro_batch_size 16 × seq_len 128


def _tiny(job: str = "sft", **sections: dict) -> Config:
    return Config.model_validate({"run": {"job": job}, **sections})


def _parts(report) -> dict[str, int]:
    return {p.name: p.bytes for p in report.trainer.parts}


def _tiny_report(job: str = "sft", **sections: dict):
    return estimate(inputs_from_config(_tiny(job, **sections), gpus=[]))


# ---------------------------------------------------------------- the breakdown, by hand


def test_dpo_adds_the_reference_weights_and_doubles_the_sequences_of_the_tiny_default():
    assert TINY_PARAMS == 565_888
    sft, dpo = _parts(_tiny_report("sft")), _parts(_tiny_report("dpo"))
    # bf16 on one GPU: fp32 weights (4 B) under autocast; the reference is a copy of them
    assert sft["weights"] == dpo["weights"] == TINY_PARAMS * 4
    assert "reference weights" not in sft and dpo["reference weights"] == TINY_PARAMS * 4
    # 16 pairs are 32 sequences: every activation twice the SFT micro-batch's
    assert dpo["activations"] == 2 * sft["activations"]
    # DPO takes each token's log-prob chunk by chunk as SFT's loss is (the tiny default is the native model): the
    # same chunk and lm_head gradient, and the hidden states' gradient of twice the tokens (128 wide, bf16)
    assert dpo["logits and loss"] == sft["logits and loss"] + TINY_TOKENS * 128 * 2
    same = ("gradients", "optimizer states", "bf16 weight copy", "runtime")
    assert all(sft[k] == dpo[k] for k in same)

    precomputed = _parts(_tiny_report("dpo", dpo={"precompute_reference": True}))
    assert "reference weights" not in precomputed
    assert sum(precomputed.values()) == sum(dpo.values()) - TINY_PARAMS * 4
    lora = _tiny_report("dpo", lora={"rank": 8})
    assert "reference weights" not in _parts(lora)  # the base with the adapters off is the reference
    assert any("no reference model held (LoRA" in n for n in lora.notes)


def test_reward_model_has_a_score_head_no_logits_and_pairs():
    sft, reward = _parts(_tiny_report("sft")), _parts(_tiny_report("reward"))
    assert reward["weights"] == TINY_PARAMS * 4  # tied: the embedding table stays, there is no lm_head to drop
    assert reward["score head"] == 128 * (4 + 4 + 8)  # Linear(128, 1) without bias: fp32 weight, gradient, AdamW
    assert reward["activations"] == 2 * sft["activations"]
    assert "logits and loss" not in reward and reward["score and loss"] == 2 * TINY_TOKENS * 128 * 2
    assert "reference weights" not in reward

    # an untied 7B: its lm_head (vocab × hidden) is gone, every state of it
    untied = estimate(inputs_from_flags(QWEN25_7B, job="reward", seq_len=1024, gpus=[]))
    kept = QWEN25_7B_PARAMS - 152064 * 3584
    assert untied.trainer.weights == kept * 4 and untied.trainer.get("gradients") == kept * 4
    assert untied.trainer.get("score head") == 3584 * 16
    assert untied.trainer.trainable_params == kept + 3584
    # with LoRA the head still trains in full, beside the adapters
    lora = estimate(inputs_from_flags(QWEN25_7B, job="reward", lora_rank=16, seq_len=1024, gpus=[]))
    assert lora.trainer.get("score head") == 3584 * 16
    assert lora.trainer.trainable_params == 40_370_176 + 3584


def test_ppo_adds_a_value_head_and_the_kl_reference_is_counted_as_grpos():
    grpo = _parts(_tiny_report("rl"))
    ppo = _parts(_tiny_report("rl", rl={"algorithm": "ppo"}))
    assert ppo["value head"] == (128 + 1) * 16  # weight and bias, fp32 with its gradient and AdamW's two moments
    assert {k: v for k, v in ppo.items() if k != "value head"} == grpo
    assert "reference weights" not in ppo  # rl.kl_coef = 0: no KL anchor
    kl = _parts(_tiny_report("rl", rl={"algorithm": "ppo", "kl_coef": 0.05}))
    assert kl["reference weights"] == TINY_PARAMS * 4
    grpo_kl = _parts(_tiny_report("rl", rl={"kl_coef": 0.05}))
    assert grpo_kl["reference weights"] == TINY_PARAMS * 4 and "value head" not in grpo_kl
    lora_kl = _parts(_tiny_report("rl", rl={"algorithm": "ppo", "kl_coef": 0.05}, lora={"rank": 8}))
    assert "reference weights" not in lora_kl and lora_kl["value head"] == 129 * 16


def test_an_8b_dpo_reference_is_its_weight_bytes_and_is_not_sharded():
    n = LLAMA31_8B_PARAMS
    common = {"seq_len": 2048, "activation_checkpointing": "full", "gpus": []}
    sft = estimate(inputs_from_flags(LLAMA31_8B, **common))
    dpo = estimate(inputs_from_flags(LLAMA31_8B, job="dpo", **common))
    assert dpo.trainer.get("reference weights") == n * 4 == sft.trainer.weights
    assert dpo.trainer.activations == 2 * sft.trainer.activations
    # the log-probs are chunked as the loss is: twice the tokens add their hidden states' gradient, no logits
    assert dpo.trainer.total - sft.trainer.total == n * 4 + sft.trainer.activations + 2048 * 4096 * 2
    # FSDP over 8 shards the trained states, not the reference: it is copied before the model is wrapped
    fsdp = estimate(inputs_from_flags(LLAMA31_8B, job="dpo", strategy="fsdp", gpus_per_node=8, **common))
    assert fsdp.trainer.weights == -(-n * 4 // 8) and fsdp.trainer.get("reference weights") == n * 4
    # ZeRO's accounting holds bf16 weights: so is the copy
    zero = estimate(inputs_from_flags(LLAMA31_8B, job="dpo", strategy="zero2", gpus_per_node=8, **common))
    assert zero.trainer.get("reference weights") == n * 2
    assert (
        estimate(inputs_from_flags(LLAMA31_8B, job="dpo", reference=False, **common)).trainer.get("reference weights")
        == 0
    )


def test_the_largest_micro_batch_counts_pairs():
    from prime_train.validator.memory_breakdown import trainer_memory

    common = {"seq_len": 2048, "activation_checkpointing": "full", "loss": "full", "gpus": ["H200"]}
    sft = estimate(inputs_from_flags(LLAMA31_8B, lora_rank=16, **common))
    dpo = estimate(inputs_from_flags(LLAMA31_8B, job="dpo", lora_rank=16, **common))
    assert dpo.trainer.per_micro_batch_bytes == 2 * sft.trainer.per_micro_batch_bytes
    pairs, cap = dpo.gpus[0].max_micro_batch, dpo.gpus[0].memory_bytes
    assert 1 <= pairs < sft.gpus[0].max_micro_batch
    assert trainer_memory(dpo.inputs, dpo.shape, micro_batch=pairs).total <= cap
    assert trainer_memory(dpo.inputs, dpo.shape, micro_batch=pairs + 1).total > cap


def test_job_settings_the_jobs_cannot_have_are_refused():
    with pytest.raises(MemoryInputError, match="job = 'kto': must be one of"):
        inputs_from_flags(LLAMA31_8B, job="kto")
    with pytest.raises(MemoryInputError, match="rl_algorithm = 'ppo' is for job 'rl', not 'dpo'"):
        inputs_from_flags(LLAMA31_8B, job="dpo", rl_algorithm="ppo")
    with pytest.raises(MemoryInputError, match="job 'reward' holds no reference"):
        inputs_from_flags(LLAMA31_8B, job="reward", reference=True)


def test_memory_command_shows_each_jobs_lines(tmp_path):
    from typer.testing import CliRunner

    from prime_train.cli import app

    wide = {"COLUMNS": "220", "NO_COLOR": "1"}
    run = CliRunner()
    dpo = run.invoke(app, ["memory", "--job", "dpo", "--gpu", "H100"], env=wide)  # the tiny default as dpo
    assert dpo.exit_code == 0, dpo.output
    assert "reference weights" in dpo.stdout and "16 pairs × 2 (chosen and rejected) × 128 tokens" in dpo.stdout
    assert "training (dpo)" in dpo.stdout and "micro-batch 16 pair(s)" in dpo.stdout
    cfg = tmp_path / "dpo.toml"
    cfg.write_text('[run]\njob = "dpo"\n[dpo]\nprecompute_reference = true\n')
    pre = run.invoke(app, ["memory", str(cfg), "--json"], env=wide)
    data = json.loads(pre.stdout)
    assert data["settings"]["job"] == "dpo" and data["settings"]["reference"] is False
    assert "reference weights" not in {p["name"] for p in data["trainer"]["parts"]}
    ppo = run.invoke(app, ["memory", "--model", str(CONFIGS / "Qwen2.5-7B-Instruct"), "--job", "ppo", "--gpu", "H100"],
                     env=wide)  # fmt: skip
    assert ppo.exit_code == 0 and "value head" in ppo.stdout and "training (rl, ppo)" in ppo.stdout
    assert "Linear(3584, 1), 3,585 params" in ppo.stdout
    reward = run.invoke(app, ["memory", "--job", "reward", "--json"], env=wide)
    names = {p["name"] for p in json.loads(reward.stdout)["trainer"]["parts"]}
    assert {"score head", "score and loss"} <= names and "logits and loss" not in names
    bad = run.invoke(app, ["memory", "--job", "kto"], env=wide)
    assert bad.exit_code == 78 and "job 'kto'" in bad.output


# ---------------------------------------------------------------- preflight's fit check


def _model_config(tmp_path, job: str, **sections) -> Config:
    model_dir = tmp_path / "llama"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(LLAMA31_8B))
    base = {"model": {"path": str(model_dir), "activation_checkpointing": True}, "data": {"seq_len": 1024},
            "train": {"micro_batch_size": 1}, "distributed": {"nproc_per_node": 8, "strategy": "fsdp"}}  # fmt: skip
    return Config.model_validate({"run": {"job": job, "output_dir": str(tmp_path / "runs")}, **base, **sections})


def test_preflight_refuses_dpo_with_its_reference_where_sft_fits(tmp_path):
    from prime_train.validator.preflight import FAIL, PASS, check_memory_fit, estimate_memory

    gpu = 48 * GIB  # an L40S-sized GPU: the 8B model's sharded states fit it, a whole fp32 copy beside them does not
    sft = check_memory_fit(_model_config(tmp_path, "sft"), gpu_run=True, gpu_memory_bytes=gpu)
    assert sft.status == PASS, sft.message
    dpo_cfg = _model_config(tmp_path, "dpo")
    dpo = check_memory_fit(dpo_cfg, gpu_run=True, gpu_memory_bytes=gpu)
    assert dpo.status == FAIL, dpo.message
    assert dpo.details["reference_bytes"] == LLAMA31_8B_PARAMS * 4
    assert dpo.details["states_bytes"] - sft.details["states_bytes"] == LLAMA31_8B_PARAMS * 4
    assert dpo.details["activation_bytes"] == 2 * sft.details["activation_bytes"]
    assert "dpo: 2 sequences a micro-batch (pairs), reference copy 32.1 GB" in dpo.message
    assert "dpo.precompute_reference = true (no reference model held: 32.1 GB less)" in dpo.fix
    # the same figures as `prime-train memory`
    report = estimate(inputs_from_config(dpo_cfg, gpus=[]))
    est = estimate_memory(dpo_cfg, LLAMA31_8B, on_gpu=True)
    assert est["states_bytes"] + est["activation_bytes"] + est["logits_bytes"] == report.trainer.total - GIB
    precomputed = _model_config(tmp_path, "dpo", dpo={"precompute_reference": True})
    assert check_memory_fit(precomputed, gpu_run=True, gpu_memory_bytes=gpu).status == PASS
    ppo = _model_config(tmp_path, "rl", rl={"algorithm": "ppo"})
    assert check_memory_fit(ppo, gpu_run=True, gpu_memory_bytes=gpu).details["head_bytes"] == 4097 * 16


# ---------------------------------------------------------------- cost


SMALL = {
    "model_type": "llama", "hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
    "num_key_value_heads": 8, "intermediate_size": 1024, "vocab_size": 1000, "tie_word_embeddings": False,
}  # fmt: skip


def _cost_config(tmp_path, job: str, **sections) -> Config:
    model_dir = tmp_path / "small"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(SMALL))
    return Config.model_validate(
        {
            "run": {"job": job},
            "model": {"path": str(model_dir)},
            "data": {"seq_len": 1000},
            "train": {"max_steps": 300, "global_batch_size": 50, "micro_batch_size": 5},
            "distributed": {"nproc_per_node": 4},
            **sections,
        }
    )


def test_cost_prices_each_job_by_hand(tmp_path):
    from prime_train.validator.cost import CostInputError, estimate_cost
    from prime_train.validator.param_count import count_parameters

    n = count_parameters(SMALL)
    matmul = n - 1000 * 512  # the input embedding is a lookup; the untied lm_head is a matmul
    attention = 12 * 8 * 8 * 64 * 1000
    sft = estimate_cost(_cost_config(tmp_path, "sft"), gpu="H100", mfu=0.4)
    assert sft.flops_per_token == 6 * matmul + attention and sft.total_tokens == 300 * 50 * 1000

    dpo = estimate_cost(_cost_config(tmp_path, "dpo"), gpu="H100", mfu=0.4)
    # 50 pairs a step are 100 sequences; each token trains as SFT's and the reference runs a forward over it
    assert dpo.total_tokens == 2 * sft.total_tokens and dpo.tokens_per_full_step == 2 * 50 * 1000
    assert dpo.flops_per_token == 6 * matmul + attention + 2 * matmul + attention / 3
    assert dpo.rows[0].step_time_s[1] == pytest.approx(sft.rows[0].step_time_s[1] * 2 * (8 * matmul + attention * 4 / 3)
                                                       / (6 * matmul + attention))  # fmt: skip
    assert any("twice the work of an SFT step" in n for n in dpo.notes)
    assert any("frozen reference's forward" in n for n in dpo.notes)
    pre = estimate_cost(_cost_config(tmp_path, "dpo", dpo={"precompute_reference": True}), gpu="H100")
    assert pre.flops_per_token == sft.flops_per_token and any("not counted" in n for n in pre.notes)

    reward = estimate_cost(_cost_config(tmp_path, "reward"), gpu="H100", mfu=0.4)
    assert reward.flops_per_token == 6 * (matmul - 1000 * 512 + 512) + attention  # no lm_head, a score head
    assert reward.total_tokens == 2 * sft.total_tokens

    ppo_cfg = _cost_config(tmp_path, "rl", rl={"algorithm": "ppo"})
    with pytest.raises(CostInputError, match="rollout generation"):
        estimate_cost(ppo_cfg, gpu="H100")
    ppo = estimate_cost(ppo_cfg, gpu="H100", step_time_s=10.0)
    assert ppo.rows[0].step_time_s[1] == 10.0 and ppo.rows[0].memory_need_bytes is not None
    assert (
        ppo.rows[0].memory_need_bytes
        > estimate_cost(_cost_config(tmp_path, "rl"), gpu="H100", step_time_s=10.0).rows[0].memory_need_bytes
    )  # the value head


def test_cost_command_names_the_pairs(tmp_path):
    cfg = tmp_path / "dpo.toml"
    cfg.write_text('[run]\njob = "dpo"\n')
    run = subprocess.run([sys.executable, "-m", "prime_train", "cost", str(cfg), "--gpu", "H100"],
                         capture_output=True, text=True, timeout=120, env={"COLUMNS": "200", **_env()})  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "2 sequences a pair" in run.stdout and "twice the work of an SFT step" in " ".join(run.stdout.split())


def _env() -> dict[str, str]:
    import os

    return dict(os.environ)


# ---------------------------------------------------------------- init


@pytest.mark.parametrize("hardware", ["cpu", "H100:1", "H100:8"])
@pytest.mark.parametrize("job", ["dpo", "reward", "ppo"])
def test_init_writes_configs_that_lint_clean_for_the_new_jobs(tmp_path, job, hardware):
    from prime_train.validator.lint import lint_files
    from prime_train.validator.wizard import Answers, build_config

    path = tmp_path / f"{job}.toml"
    path.write_text(build_config(Answers(job=job, hardware=hardware)))
    problems, cfg = lint_files([str(path)], [])
    assert problems == [] and cfg is not None
    assert cfg.run.job == {"ppo": "rl"}.get(job, job)
    if job == "ppo":
        assert cfg.rl.algorithm == "ppo" and cfg.rl.gae_lambda == 1.0 and cfg.rl.kl_coef == 0
    if job in ("dpo", "reward"):
        # 32 pairs a step are 64 sequences, as SFT's 64; a micro-batch holds half SFT's sequences' worth of pairs
        sft = Config.model_validate(tomllib.loads(build_config(Answers(job="sft", hardware=hardware))))
        assert cfg.train.global_batch_size == 32 and 2 * cfg.train.micro_batch_size == sft.train.micro_batch_size
        assert cfg.model.path == "runs/tiny-sft/final" and cfg.data.datasets[0].task == "reverse-text"
    if job == "dpo":
        assert cfg.dpo.precompute_reference is False and "[dpo]" in path.read_text()


def test_init_cli_offers_the_new_jobs(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "prime_train", "init", "--job", "ppo", "-o", "p.toml"],
        cwd=tmp_path, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    cfg = load_config([str(tmp_path / "p.toml")])
    assert cfg.run.job == "rl" and cfg.rl.algorithm == "ppo" and cfg.run.name == "tiny-ppo"
    help_text = subprocess.run([sys.executable, "-m", "prime_train", "init", "--help"], capture_output=True, text=True,
                               timeout=120, env={**_env(), "COLUMNS": "200"}).stdout  # fmt: skip
    assert "ppo (rl with PPO), dpo or reward" in " ".join(help_text.split())


@pytest.mark.parametrize("job", ["dpo", "reward"])
def test_init_writes_the_users_preference_pairs(tmp_path, job):
    from prime_train.validator import data_fields
    from prime_train.validator.lint import lint_files
    from prime_train.validator.wizard import Answers, build_config

    (tmp_path / "pairs.jsonl").write_text(json.dumps({"prompt": "2+2=", "chosen": "4", "rejected": "5"}) + "\n")
    path = tmp_path / f"{job}.toml"
    path.write_text(build_config(Answers(job=job, dataset=str(tmp_path / "pairs.jsonl"))))
    assert 'format = "preference"' in path.read_text()
    if not hasattr(data_fields, "PREFERENCE_JOBS"):
        pytest.skip("lint reads preference records once the preference jobs are in (engine/preference.py)")
    problems, cfg = lint_files([str(path)], [])
    assert problems == [] and cfg is not None and cfg.data.datasets[0].format == "preference"


def test_init_counts_the_dpo_reference_when_it_decides_on_lora(tmp_path):
    from prime_train.validator.wizard import Answers, build_config

    model = tmp_path / "llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA31_8B))
    sft = build_config(Answers(job="sft", model=str(model), hardware="H100:1"))
    dpo = build_config(Answers(job="dpo", model=str(model), hardware="H100:1"))

    def full(text: str) -> int:
        return int(text.split("full fine-tuning needs about ")[1].split(" GiB")[0])

    # the fp32 reference (29.9 GiB) comes on top, and pairs of 2 sequences at half the micro-batch
    assert full(dpo) - full(sft) >= 29
    assert "with LoRA the reference is the base with the adapters switched off" in dpo
    assert "lr = 5e-06" in dpo  # DPO's 5e-7, ×10 for the adapters


# ---------------------------------------------------------------- verify-model


def test_verify_model_for_the_new_jobs(tmp_path):
    from prime_train.validator.models import verify_model

    shutil_copy = (CONFIGS / "Qwen2.5-7B-Instruct" / "config.json").read_text()
    directory = tmp_path / "qwen"
    directory.mkdir()
    (directory / "config.json").write_text(shutil_copy)
    n = QWEN25_7B_PARAMS
    sft = verify_model(str(directory), job="sft", gpu="H100:8", offline=True)
    dpo = verify_model(str(directory), job="dpo", gpu="H100:8", offline=True)
    assert dpo.ok and dpo.job_memory_parts == {"reference weights": n * 4}
    assert dpo.train_memory_bytes == n * 16 + n * 4
    # over 8 GPUs the 16 B/param are sharded, the reference copy is not
    assert dpo.train_gpu["full_fits"] and "dpo" in dpo.to_dict()["memory_assumptions"]["job"]
    assert sft.to_dict()["memory_assumptions"].get("job") is None
    reward = verify_model(str(directory), job="reward", offline=True)
    assert reward.job_memory_parts == {"score head": 3584 * 16, "lm_head dropped": -152064 * 3584 * 16}
    ppo = verify_model(str(directory), job="ppo", offline=True)
    assert ppo.job_memory_parts == {"value head": 3585 * 16}
    # one H100 is too small for all of them; dpo's LoRA offer holds no reference
    assert dpo.lora_train_memory_bytes == sft.lora_train_memory_bytes
    assert ppo.lora_train_memory_bytes == sft.lora_train_memory_bytes + 3585 * 16

    run = subprocess.run(
        [sys.executable, "-m", "prime_train", "verify-model", str(directory), "--job", "dpo", "--gpu", "H100"],
        capture_output=True, text=True, timeout=120, env={"COLUMNS": "200", "HF_HUB_OFFLINE": "1", **_env()},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    out = " ".join(run.stdout.split())
    assert "reference weights +28.4 GiB" in out and "usable for dpo" in out
    assert "16 B/param and dpo's reference" in out  # the LoRA offer says why full fine-tuning does not fit


def test_ppo_needs_a_model_vllm_serves_as_rl_does(tmp_path, monkeypatch):
    from prime_train.validator import models
    from prime_train.validator.models import verify_model

    directory = tmp_path / "odd"
    directory.mkdir()
    config = dict(json.loads((CONFIGS / "Qwen2.5-0.5B-Instruct" / "config.json").read_text()))
    config["architectures"] = ["NoSuchForCausalLM"]
    (directory / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(models, "installed_vllm_archs", lambda: ("0.11.0", {"LlamaForCausalLM"}))
    rl, ppo = (verify_model(str(directory), job=job, offline=True) for job in ("rl", "ppo"))
    dpo = verify_model(str(directory), job="dpo", offline=True)
    assert rl.problems == ppo.problems and any("vLLM does not serve" in p for p in ppo.problems)
    assert not dpo.problems  # a preference job serves nothing
