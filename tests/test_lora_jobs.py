"""LoRA in the jobs, end to end in real subprocesses: configs/examples/tiny-lora.toml learns and exports a merged model
and a PEFT adapter that agree; adapter-only checkpoints are small, resume after kill -9 exactly, and refuse a resume
with other [lora] settings (exit 78, the checkpoint left whole); GRPO with LoRA on the embedded worker, which loads
the merged weights the trainer publishes.

The engine-level pieces (adapters, state, merge, PEFT format) are tested in test_lora.py.
"""

from __future__ import annotations

import json
import random
import re
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from enginetools import (
    REPO,
    TINY,
    TINY_RL,
    cli,
    env,
    final_weights,
    free_port,
    kill_group,
    losses_by_step,
    metrics,
    run_train,
    start,
    tiny_overrides,
    wait_for,
)
from safetensors.torch import load_file

from prime_train.contract import read_json
from prime_train.engine import safe_dcp
from prime_train.engine.lora import is_adapter_key
from prime_train.engine.verify import verify_checkpoint

pytestmark = [
    # peft's PeftModel.from_pretrained asks transformers the old name
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
]

TINY_LORA = REPO / "configs" / "examples" / "tiny-lora.toml"
ALL_LINEAR = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
IDENTITY_16 = {"rank": 16, "alpha": 32.0, "target_modules": ALL_LINEAR}
# the tiny model (hidden 128, MLP 512, 2 layers) with rank-16 adapters on its 7 linear layers: r × (in + out) each
TRAINABLE_16 = 2 * 16 * (4 * (128 + 128) + 3 * (128 + 512))
PROMPT = torch.tensor([[1, 5, 9, 17, 33, 40, 2, 7, 11, 3]])


def output(result: subprocess.CompletedProcess) -> str:
    return result.stdout + result.stderr


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def model_keys(step_dir: Path) -> list[str]:
    """The model entries a DCP checkpoint holds (its metadata's `model.` keys, without the prefix)."""
    keys = safe_dcp.read_metadata(step_dir).state_dict_metadata
    return [k.removeprefix("model.") for k in keys if k.startswith("model.")]


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(input_ids=PROMPT).logits


# ---------------------------------------------------------------- the example: learning and export


@pytest.fixture(scope="module")
def tiny_lora_run(tmp_path_factory, half_trained_sft_model):
    """configs/examples/tiny-lora.toml as its comment runs it, from the 60-step tiny SFT model (about 35 s)."""
    out = tmp_path_factory.mktemp("tiny-lora")
    result = subprocess.run(
        cli("train", str(TINY_LORA), "--model.path", str(half_trained_sft_model), "--run.output_dir", str(out),
            "--logging.tensorboard", "false"),
        env=env(), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, output(result)[-4000:]
    return out / "tiny-lora", result


@pytest.mark.slow
def test_tiny_lora_example_learns_with_a_seventh_of_the_parameters(tiny_lora_run):
    """Measured on a 2-core CPU: loss 1.42 (step 1) -> 0.30 (step 100), held-out exact match 0.17 -> 0.95."""
    run_dir, result = tiny_lora_run
    records = metrics(run_dir)
    first = records[0]
    assert first["step"] == 0 and first["trainable_params"] == TRAINABLE_16, first
    assert first["trainable_fraction"] == pytest.approx(TRAINABLE_16 / first["total_params"]) and (
        0.1 < first["trainable_fraction"] < 0.2
    )
    assert re.search(r"0\.66M parameters, 0\.094M \(14\.\d+%\) trainable, LoRA rank 16", output(result))
    losses = losses_by_step(run_dir)
    start_loss = sum(losses[s] for s in range(1, 6)) / 5
    end_loss = sum(losses[s] for s in range(91, 101)) / 10
    assert end_loss < 0.4 * start_loss, (start_loss, end_loss)
    exact = {r["step"]: r["eval_exact_match"] for r in records if "eval_exact_match" in r}
    assert exact[100] >= exact[0] + 0.5, exact  # 0.17 -> 0.95 measured

    # the checkpoint holds the adapters alone (and says which): the frozen base is model.path again at every start
    step_dir = run_dir / "checkpoints" / "step-50"
    assert read_json(step_dir / "meta.json")["lora"] == IDENTITY_16
    keys = model_keys(step_dir)
    assert keys and all(is_adapter_key(k) for k in keys), keys[:5]


@pytest.mark.slow
def test_tiny_lora_exports_a_merged_model_and_a_peft_adapter_with_the_same_logits(
    tiny_lora_run, half_trained_sft_model
):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    final = tiny_lora_run[0] / "final"
    merged = AutoModelForCausalLM.from_pretrained(final)
    assert not any("lora" in n or "base_layer" in n for n in merged.state_dict())
    base = AutoModelForCausalLM.from_pretrained(half_trained_sft_model)
    base_logits = logits(base)
    adapter = PeftModel.from_pretrained(base, final / "adapter")
    assert read_json(final / "adapter" / "adapter_config.json")["base_model_name_or_path"] == str(
        half_trained_sft_model
    )
    torch.testing.assert_close(logits(adapter), logits(merged), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(logits(merged), base_logits, atol=1e-2)  # and the adapter did change the model


@pytest.mark.slow
def test_generate_from_a_lora_runs_checkpoint_applies_its_adapter(tiny_lora_run, half_trained_sft_model):
    """`generate RUN --step N` converts the adapter-only checkpoint on the fly onto the run's base: at the last step
    it answers as final/ does, and not as the base under it (exact match 0.17 before the adapter, 0.95 after)."""
    from typer.testing import CliRunner

    from prime_train.cli import app
    from prime_train.tasks import ReverseTextTask

    rng = random.Random(7)
    prompts = [ReverseTextTask().generate(rng).prompt for _ in range(8)]

    def replies(*source: str) -> tuple[str, list[str]]:
        args = ["generate", *source, "--raw", "--temperature", "0", "--max-tokens", "8", "--json"]
        result = CliRunner().invoke(app, [*args, *(a for p in prompts for a in ("-p", p))])
        assert result.exit_code == 0, result.output[-3000:]
        doc = json.loads(result.stdout[result.stdout.index("{") :])
        return doc["model"], [r["completion"] for r in doc["replies"]]

    run_dir = tiny_lora_run[0]
    source, last = replies(str(run_dir), "--step", "100")
    assert source == f"{run_dir / 'checkpoints' / 'step-100'} (converted)"
    assert last == replies(str(run_dir))[1]  # final/, the merged export
    base = replies(str(half_trained_sft_model))[1]
    right = [p.removeprefix("reverse ").removesuffix("=")[::-1] for p in prompts]
    hits = {name: sum(map(str.__eq__, got, right)) for name, got in (("lora", last), ("base", base))}
    assert hits["lora"] >= 6 and hits["lora"] > hits["base"], (hits, last, base, right)
    assert last != base


# ---------------------------------------------------------------- adapter-only checkpoints: size, kill -9, refusals

# no save at the last step: the checkpoints are step-10 and step-20 (ckpt.resumable_final_save is on by default)
SHORT = {"train.max_steps": 30, "ckpt.interval": 10, "ckpt.resumable_final_save": "false"}


@pytest.fixture(scope="module")
def short_runs(tmp_path_factory):
    """Two 30-step runs of the tiny default, one with --lora.rank 16 and one without (a few seconds each)."""
    out = tmp_path_factory.mktemp("short")
    results = {}
    for name, rank in (("lora", 16), ("full", 0)):
        results[name] = run_train(out, name, **SHORT, **{"lora.rank": rank})
        assert results[name].returncode == 0, output(results[name])[-4000:]
    return out, results


def test_a_lora_checkpoint_is_a_fraction_of_a_full_one_and_the_run_says_so(short_runs):
    out, results = short_runs
    lora, full = out / "lora" / "checkpoints" / "step-20", out / "full" / "checkpoints" / "step-20"
    # measured: 1.4 MB against 7.2 MB (the adapters are 14% of the parameters; hf/ and the RNG state are the rest)
    assert dir_bytes(lora) * 4 < dir_bytes(full), (dir_bytes(lora), dir_bytes(full))
    assert read_json(lora / "meta.json")["lora"] == IDENTITY_16 and "lora" not in read_json(full / "meta.json")
    said = re.search(r"about ([\d.]+) MB against about ([\d.]+) MB for the full weights", output(results["lora"]))
    assert said and float(said.group(1)) * 5 < float(said.group(2)), said
    assert "trainable" in output(results["full"]) and "LoRA" not in output(results["full"])


def test_a_lora_run_killed_after_a_checkpoint_resumes_from_it_exactly(short_runs):
    out, _ = short_runs
    overrides = tiny_overrides(out, "killed", **SHORT, **{"lora.rank": 16})
    proc = start(cli("train", str(TINY), *overrides))
    try:
        wait_for((out / "killed" / "checkpoints" / "step-10").is_dir, 300, "the step-10 checkpoint")
        kill_group(proc, signal.SIGKILL)
        proc.wait(30)
    finally:
        kill_group(proc, signal.SIGKILL)
    assert proc.returncode == -signal.SIGKILL
    resumed = run_train(out, "killed", **SHORT, **{"lora.rank": 16})
    assert resumed.returncode == 0, output(resumed)[-4000:]
    assert "resumed from" in output(resumed)
    straight, killed = losses_by_step(out / "lora"), losses_by_step(out / "killed")
    for step in range(21, 31):  # after any checkpoint the killed run could have resumed from
        assert straight[step] == killed[step], (step, straight[step], killed[step])  # bitwise on CPU
    for name in ("lora", "killed"):
        assert (out / name / "final" / "adapter" / "adapter_model.safetensors").is_file()
    wa, wb = final_weights(out / "lora"), final_weights(out / "killed")
    assert wa.keys() == wb.keys()
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key


@pytest.mark.parametrize(
    ("rank", "says"),
    [(8, "this run has LoRA rank 8, alpha 16.0"), (0, "this run has no LoRA")],
    ids=["another-rank", "no-lora"],
)
def test_resuming_with_other_lora_settings_exits_78_and_leaves_the_checkpoint_whole(short_runs, rank, says):
    out, _ = short_runs
    ckpt_dir = out / "lora" / "checkpoints"
    before = {p.name: (p / "manifest.json").read_bytes() for p in ckpt_dir.iterdir()}
    assert set(before) == {"step-10", "step-20"}, before  # the last step is not saved (no resumable final save)
    result = run_train(out, "lora", flags=("--resume",), **{**SHORT, "train.max_steps": 40, "lora.rank": rank})
    assert result.returncode == 78, output(result)[-4000:]
    text = output(result)
    newest = max(before, key=lambda name: int(name[5:]))
    assert f"{newest} was saved with LoRA rank 16, alpha 32.0, target_modules {', '.join(ALL_LINEAR)}" in text
    assert says in text and "Traceback" not in result.stderr
    # nothing set aside as corrupt, nothing rewritten: the run resumes with its own settings
    assert {p.name: (p / "manifest.json").read_bytes() for p in ckpt_dir.iterdir()} == before
    assert all(verify_checkpoint(ckpt_dir / name) is None for name in before)


# ---------------------------------------------------------------- GRPO


def test_grpo_with_lora_trains_the_adapters_and_the_embedded_worker_serves_the_merged_policy(
    tmp_path, half_trained_sft_model
):
    """configs/tiny-rl.toml with --lora.rank 16 and a KL term (its reference: the policy with its adapters off), 4
    steps of 8 prompts (about 10 s). The worker samples with the merged weights the trainer publishes each step."""
    args = {
        "run.output_dir": str(tmp_path), "run.name": "rl", "model.path": str(half_trained_sft_model),
        "inference.base_port": free_port(), "logging.tensorboard": "false", "supervisor.poll_interval_s": 0.5,
        "train.max_steps": 4, "rl.prompts_per_step": 8, "rl.eval_prompts": 16, "ckpt.interval": 2,
        "lora.rank": 16, "rl.kl_coef": 0.05,
    }  # fmt: skip
    argv = [part for key, value in args.items() for part in (f"--{key}", str(value))]
    result = subprocess.run(cli("run", str(TINY_RL), *argv), env=env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, output(result)[-4000:]
    run_dir = tmp_path / "rl"
    rows = {r["step"]: r for r in metrics(run_dir)}
    assert rows[0]["trainable_params"] == TRAINABLE_16
    steps = range(1, 5)
    assert all(rows[s]["workers_reloaded"] == 1 for s in steps), rows
    # on-policy (tiny-rl's rl.max_async_level 0): the worker's logprobs are the trainer's LoRA policy's, up to
    # float32 rounding; unmerged or stale weights would be off by far more
    assert max(rows[s]["logprob_mismatch"] for s in steps) < 1e-3, rows
    # the reference is the frozen base: the same as the policy before the first step, apart after it
    assert rows[1]["kl"] == pytest.approx(0.0, abs=1e-6) and all(rows[s]["kl"] > 0 for s in (2, 3, 4)), rows
    weights = load_file(str(run_dir / "weights" / "step-4" / "model.safetensors"))
    base = load_file(str(Path(half_trained_sft_model) / "model.safetensors"))
    assert weights.keys() == base.keys()  # merged: the plain HF names, no adapters
    assert any(not torch.equal(weights[k], base[k]) for k in base)
    assert read_json(run_dir / "checkpoints" / "step-2" / "meta.json")["lora"] == IDENTITY_16
    assert all(is_adapter_key(k) for k in model_keys(run_dir / "checkpoints" / "step-2"))
    assert (run_dir / "final" / "adapter" / "adapter_config.json").is_file()


def test_mfu_counts_four_flops_a_frozen_base_parameter_and_six_an_adapter_parameter():
    from transformers import LlamaConfig

    from prime_train.engine.model import flops_per_token

    config = LlamaConfig(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                         vocab_size=320)  # fmt: skip
    attention = 12.0 * 2 * 4 * 32 * 128
    full = flops_per_token(config, 128)
    frozen = (full - attention) / 6.0  # the base's matmul parameters (the tied output layer's included)
    lora = flops_per_token(config, 128, adapter_params=TRAINABLE_16)
    assert lora == pytest.approx(4.0 * frozen + 6.0 * TRAINABLE_16 + attention)
    assert lora < full


# ---------------------------------------------------------------- ckpt to-hf of a LoRA checkpoint


@pytest.fixture(scope="module")
def final_step_lora_run(tmp_path_factory):
    """The random-initialised tiny default with --lora.rank 16, 6 steps, its last step saved too (a few seconds):
    to-hf of step-6 must give the run's own final/."""
    out = tmp_path_factory.mktemp("final-step")
    args = {"train.max_steps": 6, "ckpt.interval": 3, "ckpt.resumable_final_save": "true", "lora.rank": 16,
            "data.datasets.0.num_examples": 400}  # fmt: skip
    result = run_train(out, "lora", **args)
    assert result.returncode == 0, output(result)[-4000:]
    return out / "lora"


def test_to_hf_of_a_lora_run_s_last_step_is_its_final_export(final_step_lora_run, tmp_path):
    from transformers import AutoModelForCausalLM

    step = final_step_lora_run / "checkpoints" / "step-6"
    assert read_json(step / "meta.json")["lora"] == IDENTITY_16
    result = subprocess.run(cli("ckpt", "to-hf", str(step), str(tmp_path / "hf"), "--json"), env=env(),
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert result.returncode == 0, output(result)[-4000:]
    # the base rebuilt from run.seed bit for bit, the same adapters, the same merge: the run's final/ exactly
    ours, final = load_file(str(tmp_path / "hf" / "model.safetensors")), final_weights(final_step_lora_run)
    assert ours.keys() == final.keys() and all(torch.equal(ours[k], final[k]) for k in final)
    theirs = load_file(str(final_step_lora_run / "final" / "adapter" / "adapter_model.safetensors"))
    adapter = load_file(str(tmp_path / "hf" / "adapter" / "adapter_model.safetensors"))
    assert adapter.keys() == theirs.keys() and all(torch.equal(adapter[k], theirs[k]) for k in theirs)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    final_model = AutoModelForCausalLM.from_pretrained(final_step_lora_run / "final")
    assert torch.equal(logits(merged), logits(final_model))
    assert read_json(tmp_path / "hf" / "adapter" / "adapter_config.json")["r"] == 16


def test_to_hf_of_a_lora_checkpoint_honours_the_export_guards_and_adapter_only(final_step_lora_run, tmp_path):
    from prime_train.engine.export import ExportRefused, dcp_to_hf

    step = final_step_lora_run / "checkpoints" / "step-3"
    out = dcp_to_hf(step, tmp_path / "hf")
    assert (out / ".prime-train-export.json").is_file() and (out / "adapter" / "adapter_model.safetensors").is_file()
    with pytest.raises(ExportRefused, match="--overwrite"):
        dcp_to_hf(step, out)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    with pytest.raises(ExportRefused, match="not an export of prime-train"):
        dcp_to_hf(step, tmp_path / "mine", overwrite=True)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep"
    # --adapter-only of a random-initialised run: an adapter with no base anyone has, refused as merge_on_export is
    with pytest.raises(ValueError, match="random-initialised"):
        dcp_to_hf(step, out, overwrite=True, adapter_only=True)
    assert dcp_to_hf(step, out, overwrite=True) == out


@pytest.mark.parametrize(
    ("meta_lora", "config_rank", "says"),
    [
        ({**IDENTITY_16, "rank": 8}, None, "saved with LoRA rank 8, alpha 32.0"),
        ({**IDENTITY_16, "alpha": 64.0}, None, "saved with LoRA rank 16, alpha 64.0"),
        ({**IDENTITY_16, "target_modules": ["q_proj", "v_proj"]}, None, "target_modules q_proj, v_proj"),
        ({**IDENTITY_16, "rank": 8, "alpha": 16.0}, 8, "adapter weights do not match its meta.json's lora identity"),
        (None, None, "names no LoRA adapter"),
    ],
    ids=["rank", "alpha", "targets", "rank-and-config", "no-identity"],
)
def test_to_hf_refuses_a_lora_checkpoint_whose_identity_was_tampered(
    final_step_lora_run, tmp_path, meta_lora, config_rank, says
):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(final_step_lora_run, run, ignore=shutil.ignore_patterns("final", "tensorboard", "logs"))
    step = run / "checkpoints" / "step-6"
    meta = read_json(step / "meta.json")
    if meta_lora is None:
        del meta["lora"]
    else:
        meta["lora"] = meta_lora
    (step / "meta.json").write_text(json.dumps(meta))
    if config_rank is not None:
        config = run / "config.toml"
        config.write_text(re.sub(r"(?m)^rank = 16$", f"rank = {config_rank}", config.read_text()))
    result = subprocess.run(cli("ckpt", "to-hf", str(step), str(tmp_path / "hf")), env=env(), capture_output=True,
                            text=True, timeout=300)  # fmt: skip
    assert result.returncode == 78, output(result)[-4000:]
    assert says in output(result) and "Traceback" not in result.stderr, output(result)[-4000:]
    assert not (tmp_path / "hf").exists()


@pytest.mark.slow
def test_to_hf_of_a_lora_step_on_model_path_gives_the_adapter_peft_loads_on_that_base(
    tiny_lora_run, half_trained_sft_model, tmp_path
):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from prime_train.engine.export import dcp_to_hf

    step = tiny_lora_run[0] / "checkpoints" / "step-50"
    out = dcp_to_hf(step, tmp_path / "hf")
    merged = AutoModelForCausalLM.from_pretrained(out)
    base = AutoModelForCausalLM.from_pretrained(half_trained_sft_model)
    base_logits = logits(base)
    assert read_json(out / "adapter" / "adapter_config.json")["base_model_name_or_path"] == str(half_trained_sft_model)
    adapter = PeftModel.from_pretrained(base, out / "adapter")
    torch.testing.assert_close(logits(adapter), logits(merged), rtol=1e-4, atol=1e-4)
    assert not torch.allclose(logits(merged), base_logits, atol=1e-2)
    # step 50 is not the run's end: its adapter is not final/'s
    final = load_file(str(tiny_lora_run[0] / "final" / "adapter" / "adapter_model.safetensors"))
    ours = load_file(str(out / "adapter" / "adapter_model.safetensors"))
    assert ours.keys() == final.keys() and any(not torch.equal(ours[k], final[k]) for k in final)

    only = dcp_to_hf(step, tmp_path / "adapter-only", adapter_only=True)
    assert not list(only.glob("*.safetensors")) and not (only / "config.json").exists()
    again = load_file(str(only / "adapter" / "adapter_model.safetensors"))
    assert all(torch.equal(again[k], ours[k]) for k in ours)


def test_to_hf_refuses_a_lora_reward_model_step_naming_the_job(tmp_path):
    # a LoRA reward run's step holds the score head beside the adapters; rebuilding a causal LM would drop it
    from prime_train.engine.lora_to_hf import lora_checkpoint_to_hf

    step = tmp_path / "run" / "checkpoints" / "step-10"
    step.mkdir(parents=True)
    (tmp_path / "run" / "config.toml").write_text('[run]\njob = "reward"\n[lora]\nrank = 8\n')
    with pytest.raises(ValueError, match=r"reward model's \(run.job = 'reward'\) trained with LoRA") as err:
        lora_checkpoint_to_hf(step, tmp_path / "out", None, write=lambda *a, **k: pytest.fail("wrote"))
    assert "final/" in str(err.value) and not (tmp_path / "out").exists()
