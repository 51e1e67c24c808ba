"""The reward model job (run.job = "reward", engine/reward.py): the Bradley-Terry loss, the scalar head at the last
token that is not padding on both model implementations, LoRA with the head trained in full, a real run from the
60-step tiny SFT model that ranks held-out pairs, kill -9 and resume, and final/ as transformers'
AutoModelForSequenceClassification scoring what the job scored."""

from __future__ import annotations

import copy
import math
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from enginetools import (
    REPO,
    TINY,
    cli,
    env,
    final_weights,
    kill_group,
    losses_by_step,
    metrics,
    run_train,
    start,
    tiny_llama,
    tiny_overrides,
    wait_for,
)

from prime_train.engine import safe_dcp
from prime_train.engine.lora import is_adapter_key
from prime_train.engine.reward import (
    NativeRewardModel,
    bradley_terry_loss,
    last_token_index,
    reward_model_from,
    sequence_rewards,
)

TINY_REWARD = REPO / "configs" / "examples" / "tiny-reward.toml"
PAD = 0
# right-padded rows of the tiny Llama's vocabulary (64 ids; 0 is the pad here)
ROWS = torch.tensor([[5, 6, 7, 8, 0, 0], [9, 10, 11, 12, 13, 14], [3, 4, 0, 0, 0, 0]])


def output(result: subprocess.CompletedProcess) -> str:
    return result.stdout + result.stderr


# ---------------------------------------------------------------- the loss and the head


def test_bradley_terry_loss_is_minus_log_sigmoid_of_the_margin():
    chosen, rejected = torch.tensor([2.0, 0.0, -1.0]), torch.tensor([0.0, 0.0, 1.0])
    # by hand: -log sigmoid(m) = log(1 + e^-m) for margins 2, 0, -2
    by_hand = [math.log1p(math.exp(-2.0)), math.log(2.0), math.log1p(math.exp(2.0))]
    assert by_hand == pytest.approx([0.126928, 0.693147, 2.126928], abs=1e-6)
    assert float(bradley_terry_loss(chosen, rejected)) == pytest.approx(sum(by_hand) / 3, abs=1e-6)
    assert float(bradley_terry_loss(chosen, rejected, reduction="sum")) == pytest.approx(sum(by_hand), abs=1e-6)
    # centering adds coefficient · (r_c + r_r)² per pair: (2 + 0)² = 4, 0, 0
    centred = bradley_terry_loss(chosen, rejected, center_coefficient=0.01)
    assert float(centred) == pytest.approx((sum(by_hand) + 0.04) / 3, abs=1e-6)
    # only the margin counts: shifting both rewards changes nothing
    assert torch.equal(bradley_terry_loss(chosen + 5, rejected + 5), bradley_terry_loss(chosen, rejected))
    with pytest.raises(ValueError, match="reduction"):
        bradley_terry_loss(chosen, rejected, reduction="none")


def test_the_last_token_is_the_rightmost_that_is_not_padding_for_either_padding_side():
    ids = torch.tensor([[5, 6, 7, 0, 0], [0, 0, 5, 6, 7], [5, 6, 7, 8, 9], [0, 0, 0, 0, 0]])
    assert last_token_index(ids, PAD).tolist() == [2, 4, 4, 0]


def _heads():
    """The same tiny Llama under the hf and the native reward model, the same head (seeded alike)."""
    from prime_train.engine.model import _to_native

    lm = tiny_llama(tie=True)
    native_lm = _to_native(copy.deepcopy(lm))
    torch.manual_seed(7)
    hf = reward_model_from(lm, PAD).eval()
    torch.manual_seed(7)
    native = reward_model_from(native_lm, PAD).eval()
    return hf, native


def test_native_and_hf_reward_models_read_the_head_at_the_last_real_token():
    hf, native = _heads()
    assert type(hf).__name__ == "LlamaForSequenceClassification" and isinstance(native, NativeRewardModel)
    # transformers' names on both: the decoder and the head, no lm_head
    assert sorted(hf.state_dict()) == sorted(native.state_dict())
    assert "score.weight" in native.state_dict() and not any(k.startswith("lm_head") for k in native.state_dict())
    assert hf.config.num_labels == 1 and hf.config.pad_token_id == PAD
    assert hf.config.architectures == ["LlamaForSequenceClassification"]
    with torch.no_grad():
        # by hand: the decoder's final hidden state of each row alone (no padding at all), at its last token
        expected = torch.stack(
            [hf.score(hf.model(input_ids=row[row != PAD][None]).last_hidden_state[0, -1])[0] for row in ROWS]
        )
        for model in (hf, native):
            torch.testing.assert_close(sequence_rewards(model, ROWS), expected, rtol=1e-5, atol=1e-5)
        # and with the attention mask HF users pass
        masked = hf(input_ids=ROWS, attention_mask=(ROWS != PAD).long()).logits[:, 0]
        torch.testing.assert_close(masked, expected, rtol=1e-5, atol=1e-5)
    assert len(set(expected.tolist())) == 3  # the rows do score differently


def test_the_reward_model_holds_the_loaded_decoder_itself_and_trains_the_head():
    lm = tiny_llama()
    decoder_weight = lm.model.layers[0].self_attn.q_proj.weight
    model = reward_model_from(lm, PAD).train()
    assert model.model.layers[0].self_attn.q_proj.weight is decoder_weight  # no copy
    chosen, rejected = sequence_rewards(model, ROWS[:1]), sequence_rewards(model, ROWS[1:2])
    bradley_terry_loss(chosen, rejected).backward()
    assert model.score.weight.grad is not None and model.score.weight.grad.abs().sum() > 0
    assert decoder_weight.grad is not None and decoder_weight.grad.abs().sum() > 0


@pytest.mark.parametrize("implementation", ["hf", "native"])
def test_with_lora_the_head_trains_in_full_outside_peft_and_a_checkpoint_holds_it(implementation):
    from prime_train.config.schema import LoraConfig, TrainConfig
    from prime_train.engine.lora import apply_lora, checkpoint_state
    from prime_train.engine.optim import build_optimizer

    hf, native = _heads()
    model = {"hf": hf, "native": native}[implementation]
    apply_lora(model, LoraConfig(rank=4), train_in_full=("score",))
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert "score.weight" in trainable
    assert trainable - {"score.weight"} and all(is_adapter_key(n) for n in trainable - {"score.weight"})
    assert not any("score" in name and "lora" in name for name, _ in model.named_modules())  # no adapter on it
    optimizer = build_optimizer(model, TrainConfig(), torch.device("cpu"))
    in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert id(model.score.weight) in in_optimizer
    model.train()
    loss = bradley_terry_loss(sequence_rewards(model, ROWS[:1]), sequence_rewards(model, ROWS[1:2]))
    loss.backward()
    optimizer.step()
    model_state, optim_state = checkpoint_state(model, optimizer)
    assert "score.weight" in model_state
    assert all(is_adapter_key(k) or k == "score.weight" for k in model_state)
    assert "score.weight" in optim_state["state"]  # its AdamW moments too


# ---------------------------------------------------------------- the job: plan, launch, bad settings


def test_the_reward_job_runs_as_its_own_module_under_the_engine_plan():
    from prime_train.config.schema import Config
    from prime_train.launch import plan_engine_launch
    from prime_train.resilience.plan import ENGINE_PLANS, EnginePlan

    cfg = Config.model_validate({"run": {"job": "reward"}})
    assert plan_engine_launch(cfg, "c.toml").argv[2] == "prime_train.engine.reward"
    assert ENGINE_PLANS["reward"] is EnginePlan


def test_the_example_lints_clean():
    result = subprocess.run(cli("lint", str(TINY_REWARD)), env=env(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, output(result)
    assert "no problems" in result.stdout


def test_lora_without_the_merged_export_is_refused_before_anything_loads(tmp_path):
    result = run_train(tmp_path, "nomerge", **{"run.job": "reward", "lora.rank": 4, "lora.merge_on_export": "false"})
    assert result.returncode == 78, output(result)[-3000:]
    assert "lora.merge_on_export = false" in output(result) and "Traceback" not in output(result)


# ---------------------------------------------------------------- a real run: learning and export


@pytest.fixture(scope="module")
def tiny_reward_run(tmp_path_factory, half_trained_sft_model):
    """configs/examples/tiny-reward.toml as its comment runs it, from the 60-step tiny SFT model (1000 steps)."""
    out = tmp_path_factory.mktemp("tiny-reward")
    result = subprocess.run(
        cli("train", str(TINY_REWARD), "--model.path", str(half_trained_sft_model), "--run.output_dir", str(out),
            "--logging.tensorboard", "false"),
        env=env(), capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    assert result.returncode == 0, output(result)[-4000:]
    return out / "tiny-reward", result


@pytest.mark.slow
def test_tiny_reward_example_ranks_held_out_pairs(tiny_reward_run):
    """Measured on a 2-core CPU: held-out accuracy 0.46 at step 0, 0.91 at step 600, 0.93 at step 1000."""
    run_dir, _ = tiny_reward_run
    records = metrics(run_dir)
    evals = {r["step"]: r for r in records if "eval_preference_accuracy" in r}
    last = max(evals)
    assert last == 1000
    assert evals[0]["eval_preference_accuracy"] < 0.7, evals[0]  # the untrained head: about chance
    accuracy = {s: r["eval_preference_accuracy"] for s, r in evals.items()}
    assert evals[last]["eval_preference_accuracy"] >= 0.9, accuracy
    assert evals[last]["eval_preference_margin"] > evals[0]["eval_preference_margin"] + 1.0
    steps = [r for r in records if "loss" in r and r["step"] > 0]
    assert {"accuracy", "margin", "mean_score"} <= steps[-1].keys() and "reward" not in steps[-1]
    early = sum(r["loss"] for r in steps[:50]) / 50
    late = sum(r["loss"] for r in steps[-50:]) / 50
    assert late < 0.5 * early, (early, late)
    # the checkpoint holds the head with the decoder, under transformers' names
    keys = {
        k.removeprefix("model.")
        for k in safe_dcp.read_metadata(run_dir / "checkpoints" / "step-900").state_dict_metadata
    }
    assert "score.weight" in keys and not any(k.startswith("lm_head") for k in keys)


def _hf_scores(final, pairs_config, seed: int, micro_batch_size: int):
    """Accuracy and margin of the exported model over the held-out pairs the job evaluated on."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from prime_train.engine.preference import build_eval_pairs

    model = AutoModelForSequenceClassification.from_pretrained(final, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(final)
    batches = build_eval_pairs(
        pairs_config.data, tokenizer, micro_batch_size=micro_batch_size, rank=0, world_size=1, seed=seed,
        max_batches=pairs_config.train.eval_batches,
    )  # fmt: skip
    chosen, rejected = [], []
    with torch.no_grad():
        for batch in batches:
            mask = (~batch.pad_mask).long()
            scores = model(input_ids=batch.input_ids, attention_mask=mask).logits[:, 0]
            chosen.append(scores[: batch.num_pairs])
            rejected.append(scores[batch.num_pairs :])
    return model, torch.cat(chosen), torch.cat(rejected)


@pytest.mark.slow
def test_the_export_is_an_hf_sequence_classifier_scoring_as_the_job_did(tiny_reward_run):
    from transformers import AutoConfig

    from prime_train.config.loader import load_config

    run_dir, _ = tiny_reward_run
    final = run_dir / "final"
    config = AutoConfig.from_pretrained(final)
    assert config.architectures == ["LlamaForSequenceClassification"] and config.num_labels == 1
    assert config.pad_token_id is not None and (final / "tokenizer.json").is_file()
    assert "score.weight" in final_weights(run_dir)
    cfg = load_config([str(run_dir / "config.toml")])
    model, chosen, rejected = _hf_scores(final, cfg, cfg.run.seed, cfg.train.micro_batch_size)
    assert model.config.pad_token_id == config.pad_token_id
    last = [r for r in metrics(run_dir) if "eval_preference_accuracy" in r][-1]
    # the job's own rewards (the native model, in the training process) at its last eval, before the export
    assert len(chosen) == 256
    # fp32 both: the margins agree to rounding, so the ranking of every pair but a near-tie does too
    assert float((chosen - rejected).mean()) == pytest.approx(last["eval_preference_margin"], rel=1e-4, abs=1e-4)
    accuracy = float((chosen > rejected).float().mean())
    assert accuracy == pytest.approx(last["eval_preference_accuracy"], abs=1.5 / len(chosen))


@pytest.mark.slow
def test_ckpt_to_hf_of_a_reward_checkpoint_writes_the_same_classifier(tiny_reward_run, tmp_path):
    from transformers import AutoModelForSequenceClassification

    from prime_train.engine.export import dcp_to_hf

    run_dir, _ = tiny_reward_run
    # the last checkpoint (the last step itself is exported, not saved: no resumable final save)
    out = dcp_to_hf(run_dir / "checkpoints" / "step-900", tmp_path / "step-900")
    converted = AutoModelForSequenceClassification.from_pretrained(out)
    assert converted.config.architectures == ["LlamaForSequenceClassification"]
    assert converted.config.num_labels == 1 and converted.config.pad_token_id is not None
    final = final_weights(run_dir)
    state = converted.state_dict()
    assert state.keys() == final.keys()
    # 100 steps before the end: the same model, somewhat earlier
    assert not torch.equal(state["score.weight"], final["score.weight"])
    assert torch.nn.functional.cosine_similarity(state["score.weight"], final["score.weight"]).item() > 0.5


# ---------------------------------------------------------------- kill -9 and resume; hf and LoRA

SHORT = {"run.job": "reward", "train.max_steps": 30, "ckpt.interval": 10, "train.lr": 6e-4}


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """30 steps of the tiny default as a reward model, random-initialised (a few seconds)."""
    out = tmp_path_factory.mktemp("reward-short")
    result = run_train(out, "straight", **SHORT)
    assert result.returncode == 0, output(result)[-4000:]
    return out


def test_a_reward_run_killed_after_a_checkpoint_resumes_from_it_exactly(straight_run):
    out = straight_run
    proc = start(cli("train", str(TINY), *tiny_overrides(out, "killed", **SHORT)))
    try:
        wait_for((out / "killed" / "checkpoints" / "step-10").is_dir, 300, "the step-10 checkpoint")
        kill_group(proc, signal.SIGKILL)
        proc.wait(30)
    finally:
        kill_group(proc, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    resumed = run_train(out, "killed", **SHORT)
    assert resumed.returncode == 0, output(resumed)[-4000:]
    assert "resumed from" in output(resumed)
    straight, killed = losses_by_step(out / "straight"), losses_by_step(out / "killed")
    for step in range(21, 31):  # after any checkpoint the killed run could have resumed from
        assert straight[step] == killed[step], (step, straight[step], killed[step])  # bitwise on CPU
    wa, wb = final_weights(out / "straight"), final_weights(out / "killed")
    assert wa.keys() == wb.keys() and "score.weight" in wa
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key


def test_a_reward_run_from_a_reward_models_final_goes_on_with_its_head(straight_run, tmp_path):
    """model.path = a reward run's final/: the decoder loads as the LM's and the score head is read from its
    safetensors. The head given here is the old run's times 100, so step 0 of the new run must score the held-out
    pairs with 100 x the old run's last margin (a new head would not); a reward model without the head is refused
    with 78, naming it."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    def variant(name: str, change) -> Path:
        copy_dir = tmp_path / name
        shutil.copytree(straight_run / "straight" / "final", copy_dir)
        weights = load_file(copy_dir / "model.safetensors")
        change(weights)
        save_file(weights, copy_dir / "model.safetensors", metadata={"format": "pt"})
        return copy_dir

    scaled = variant("scaled", lambda w: w.update({"score.weight": w["score.weight"] * 100}))
    result = run_train(tmp_path, "goes-on", **{**SHORT, "train.max_steps": 1, "model.path": str(scaled)})
    assert result.returncode == 0, output(result)[-4000:]
    before = [r for r in metrics(straight_run / "straight") if "eval_preference_margin" in r][-1]
    after = next(r for r in metrics(tmp_path / "goes-on") if "eval_preference_margin" in r)
    assert after["step"] == 0 and before["step"] == 30
    assert after["eval_preference_margin"] == pytest.approx(100 * before["eval_preference_margin"], rel=1e-3)
    assert after["eval_preference_accuracy"] == before["eval_preference_accuracy"]

    headless = variant("headless", lambda w: w.pop("score.weight"))
    assert "ForSequenceClassification" in json.loads((headless / "config.json").read_text())["architectures"][0]
    # a run directory of its own: one named as the model's directory would be the model's (lint refuses that)
    refused = run_train(tmp_path, "headless-run", **{**SHORT, "train.max_steps": 1, "model.path": str(headless)})
    assert refused.returncode == 78, output(refused)[-3000:]
    assert "holds no score.weight" in output(refused) and "Traceback" not in output(refused)


def test_the_hf_implementation_with_lora_trains_and_exports_a_merged_classifier(tmp_path):
    from transformers import AutoModelForSequenceClassification

    from prime_train.config.loader import load_config

    extra = {**SHORT, "train.max_steps": 20, "model.implementation": "hf", "lora.rank": 8}
    result = run_train(tmp_path, "hf-lora", **extra)
    assert result.returncode == 0, output(result)[-4000:]
    run_dir = tmp_path / "hf-lora"
    keys = [
        k.removeprefix("model.")
        for k in safe_dcp.read_metadata(run_dir / "checkpoints" / "step-10").state_dict_metadata
        if k.startswith("model.")
    ]
    assert "score.weight" in keys and all(is_adapter_key(k) or k == "score.weight" for k in keys), keys[:5]
    final = run_dir / "final"
    assert not (final / "adapter").exists()
    merged = AutoModelForSequenceClassification.from_pretrained(final)
    assert not any("lora" in n or "base_layer" in n for n in merged.state_dict())
    cfg = load_config([str(run_dir / "config.toml")])
    cfg.train.eval_batches = 1
    _, chosen, rejected = _hf_scores(final, cfg, cfg.run.seed, cfg.train.micro_batch_size)
    assert torch.isfinite(chosen).all() and not torch.equal(chosen, rejected)
