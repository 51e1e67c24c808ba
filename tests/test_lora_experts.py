"""LoRA on a mixture-of-experts model's fused expert tensors (lora.target_parameters, peft's target_parameters).

transformers 5 runs the routed experts of Mixtral, Qwen2-MoE, Qwen3-MoE, GPT-OSS and DeepSeek-V3 as one 3-D tensor a
projection, not nn.Linear layers, so lora.target_modules never reaches them. These tests hold the engine's side
(adapters that train, merge, export in PEFT's format and resume), the calculator's (counts and the merged weights a
layer keeps for its backward, against what a forward really saves) and lint's, with real models and real runs.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoConfig, AutoModelForCausalLM

from prime_train.config.schema import LoraConfig
from prime_train.engine import lora
from prime_train.engine.metrics import EngineConfigError
from prime_train.validator.memory_breakdown import expert_adapter_part
from prime_train.validator.memory_inputs import MemoryInputs
from prime_train.validator.param_count import count_adapters, decoder_expert_tensors

SHAPE = dict(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    tie_word_embeddings=False,
)  # fmt: skip
# each family's own keys for 4 experts, 2 a token (widths unlike the hidden size, so a transposed tensor shows)
MOE = {
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                      shared_expert_intermediate_size=24),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "gpt_oss": dict(num_local_experts=4, num_experts_per_tok=2),  # stores its experts in x out (is_transposed)
    "deepseek_v3": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, first_k_dense_replace=1,
                        n_group=1, topk_group=1, kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4,
                        qk_nope_head_dim=4, v_head_dim=8),
}  # fmt: skip
EXPERTS = ["down_proj", "gate_up_proj"]


def _config(model_type: str, **overrides):
    return AutoConfig.for_model(model_type, **{**SHAPE, **MOE.get(model_type, {}), **overrides})


def _model(model_type: str, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(model_type, **overrides), dtype=torch.float32)
    return model.train()


def _with_trained_adapters(model, cfg: LoraConfig, seed: int = 1):
    """apply_lora, then B set away from its zero start (as training would): the adapters change the model."""
    lora.apply_lora(model, cfg)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return model


IDS = torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(5))


def _logits(model) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(IDS).logits


def test_the_config_names_expert_tensors_and_refuses_dropout_with_them():
    cfg = LoraConfig(rank=8, target_parameters="gate_up_proj, experts.down_proj")
    assert cfg.target_parameters == ["gate_up_proj", "experts.down_proj"]
    assert LoraConfig(rank=8).target_parameters == []
    with pytest.raises(ValidationError, match=r"lora.dropout = 0.1 cannot apply to lora.target_parameters"):
        LoraConfig(rank=8, dropout=0.1, target_parameters=["gate_up_proj"])
    with pytest.raises(ValidationError, match=r"'experts\.\*' is not a parameter name"):
        LoraConfig(rank=8, target_parameters=["experts.*"])
    with pytest.raises(ValidationError, match="names a tensor twice"):
        LoraConfig(rank=8, target_parameters=["down_proj", "down_proj"])


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_each_expert_gets_its_own_adapter_that_trains_merges_and_loads_in_peft(model_type, tmp_path):
    """qwen3_moe stores its experts out x in, gpt_oss in x out: the merge folds each expert's B @ A into its own slice
    either way, and the merged model, peft's own loading of the exported adapter, and the live model agree."""
    from peft import PeftModel

    base = _model(model_type)
    base.save_pretrained(tmp_path / "base")
    base_logits = _logits(base)
    model = _with_trained_adapters(_model(model_type), LoraConfig(rank=2, target_parameters=EXPERTS))
    assert lora.adapter_identity(model)["target_parameters"] == EXPERTS
    # every expert's slice of lora_A gets a gradient from a batch that routes tokens to it; the base gets none
    model.train()
    model(IDS, labels=IDS).loss.backward()
    for plain, (wrapper, _) in lora.expert_adapters(model).items():
        grad = model.get_submodule(wrapper).lora_A[lora.ADAPTER_NAME].weight.grad
        assert grad is not None and grad.reshape(4, 2, -1).abs().sum(dim=(1, 2)).gt(0).sum() >= 2, plain
    assert all(p.grad is None for n, p in model.named_parameters() if not lora.is_adapter_key(n))
    live = _logits(model)
    assert (live - base_logits).abs().max() > 1e-3  # the adapters change what the model computes

    with lora.adapters_disabled(model):
        torch.testing.assert_close(_logits(model), base_logits)
    state = {name: t.clone() for name, t in model.state_dict().items()}
    merged = lora.merged_state_dict(state, lora.adapter_identity(model), lora.expert_adapters(model))
    plain = _model(model_type, seed=7)
    plain.load_state_dict(merged, strict=True)
    torch.testing.assert_close(_logits(plain), live, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=r"adapters of model\.layers\.0\.mlp\.experts\S* were not merged"):
        lora.merged_state_dict(dict(model.state_dict()), lora.adapter_identity(model))  # the expert map left out

    lora.save_peft_adapter(model, tmp_path / "adapter", str(tmp_path / "base"))
    saved = lora.read_adapter_config(tmp_path / "adapter")
    assert saved["target_parameters"] == EXPERTS and saved["lora_dropout"] == 0.0
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "base")
    peft_model = PeftModel.from_pretrained(reloaded, tmp_path / "adapter")
    torch.testing.assert_close(_logits(peft_model), live, atol=1e-5, rtol=1e-5)

    # in place: one plain module where peft had nested a wrapper a tensor, every parameter named as before
    lora.merge_lora(model)
    assert type(model.model.layers[0].mlp.experts) is type(base.model.layers[0].mlp.experts)
    assert sorted(n for n, _ in model.named_parameters()) == sorted(n for n, _ in base.named_parameters())
    torch.testing.assert_close(_logits(model), live, atol=1e-5, rtol=1e-5)


def test_target_parameters_that_name_no_expert_tensor_are_refused_before_the_model_changes():
    model = _model("qwen3_moe")
    with pytest.raises(EngineConfigError, match=r"'up_proj' matches no fused expert tensor .* Its expert tensors are: "
                                                r"down_proj, gate_up_proj"):  # fmt: skip
        lora.apply_lora(model, LoraConfig(rank=2, target_parameters=["up_proj"]))
    # 'weight' ends every linear layer's and norm's tensor name: peft would adapt them all
    with pytest.raises(EngineConfigError, match=r"'weight' names model\.\S+weight, which is not a fused expert tensor"):
        lora.apply_lora(model, LoraConfig(rank=2, target_parameters=["gate_up_proj", "weight"]))
    assert not lora.has_lora(model)
    with pytest.raises(EngineConfigError, match=r"LlamaForCausalLM has no fused expert tensors .* lora.target_modules"):
        lora.apply_lora(_model("llama"), LoraConfig(rank=2, target_parameters=["down_proj"]))


def test_a_checkpoint_with_expert_adapters_does_not_resume_without_them_and_older_ones_still_do():
    model = lora.apply_lora(_model("qwen3_moe"), LoraConfig(rank=2, target_parameters=EXPERTS))
    with_experts = lora.adapter_identity(model)
    without = {key: value for key, value in with_experts.items() if key != "target_parameters"}
    with pytest.raises(EngineConfigError, match=r"target_parameters down_proj, gate_up_proj; this run has LoRA rank 2"):
        lora.check_resume_compatible(with_experts, without)
    lora.check_resume_compatible(without, dict(without, target_parameters=[]))  # a meta.json from before the key


@pytest.mark.parametrize("model_type", list(MOE))
def test_the_calculator_counts_the_expert_tensors_and_adapters_the_engine_builds(model_type):
    """decoder_expert_tensors against the real model's 3-D tensors, and count_adapters' trainable count against the
    engine's, attention and experts adapted together."""
    model = _model(model_type)
    hf = _config(model_type).to_dict()
    real = {}
    for name, param in model.named_parameters():
        if param.dim() == 3:
            key = name.split(".", 3)[-1]  # model.layers.<i>.<name in the block>
            real[key] = real.get(key, 0) + param.numel()
    counted = {t.name: t.params for t in decoder_expert_tensors(hf)}
    assert counted == real
    lora.apply_lora(model, LoraConfig(rank=3, target_parameters=EXPERTS))
    trainable, _ = lora.trainable_parameters(model)
    ad = count_adapters(hf, 3, "all-linear", EXPERTS)
    assert ad.trainable == trainable and [t.name.rsplit(".", 1)[-1] for t in ad.experts] == EXPERTS
    assert ad.expert_problem() is None


def test_the_calculator_refuses_expert_names_a_model_does_not_have():
    ad = count_adapters(_config("qwen3_moe").to_dict(), 4, "all-linear", ["up_proj"])
    assert ad.expert_problem() == (
        "lora.target_parameters: 'up_proj' matches no fused expert tensor in the decoder blocks of the model; its "
        "expert tensors are: down_proj, gate_up_proj"
    )
    dense = count_adapters(_config("llama").to_dict(), 4, "all-linear", ["down_proj"])
    assert "the model has no fused expert tensors" in dense.expert_problem()


def _saved_bytes(model) -> int:
    """Bytes of the tensors one forward keeps for its backward, apart from the parameters themselves."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(IDS[:1, :8], labels=IDS[:1, :8]).loss
    loss.backward()
    return sum(kept.values())


def test_the_merged_expert_weights_a_forward_keeps_are_what_the_calculator_counts():
    """Without checkpointing each sparse layer keeps W + B @ A of every adapted expert tensor for its backward (fp32
    weights here, 4 B): measured by the tensors the forward saves, against the same model without expert adapters."""
    shape = dict(hidden_size=64, moe_intermediate_size=96, num_experts=8, num_hidden_layers=3)
    kept = {}
    for name, parameters in (("attention", []), ("experts", EXPERTS)):
        model = _model("qwen3_moe", **shape)
        lora.apply_lora(model, LoraConfig(rank=4, target_parameters=parameters))
        kept[name] = _saved_bytes(model.train())
    measured = kept["experts"] - kept["attention"]
    hf = _config("qwen3_moe", **shape).to_dict()
    inputs = MemoryInputs(model=hf, precision="fp32", strategy="none", activation_checkpointing="none",
                          lora_rank=4, lora_target_parameters=tuple(EXPERTS))  # fmt: skip
    part = expert_adapter_part(inputs, inputs.adapters)
    largest = 8 * 64 * 2 * 96 * 4  # one gate_up_proj's gradient, which exists in the backward only
    assert abs((part.bytes - largest) - measured) <= 0.02 * measured, (part, measured)
    checkpointed = expert_adapter_part(MemoryInputs(**{**inputs.__dict__, "activation_checkpointing": "full"}),
                                       inputs.adapters)  # fmt: skip
    assert checkpointed.bytes - largest == (part.bytes - largest) // 3  # one of the three layers at a time


def test_lint_names_lora_target_parameters_for_a_model_without_those_tensors(tmp_path, monkeypatch):
    from prime_train.validator.lint import lint_files

    monkeypatch.chdir(tmp_path)
    for model_type in ("qwen3_moe", "llama"):
        (tmp_path / model_type).mkdir()
        _config(model_type).save_pretrained(tmp_path / model_type)
    config = tmp_path / "run.toml"
    config.write_text(
        f'[run]\noutput_dir = "{tmp_path}"\n[model]\npath = "{tmp_path / "qwen3_moe"}"\n'
        '[lora]\nrank = 8\ntarget_parameters = ["gate_up_proj", "up_proj"]\n'
    )
    problems, _ = lint_files([str(config)], [])
    found = [(p.key, p.severity, p.line) for p in problems if p.key.startswith("lora.")]
    assert found == [("lora.target_parameters", "error", 7)], [p.format() for p in problems]
    assert "'up_proj' matches no fused expert tensor" in next(p.message for p in problems if p.key.startswith("lora"))
    assert lint_files([str(config)], ["--lora.target_parameters", "gate_up_proj"])[0] == []
    problems, _ = lint_files([str(config)], ["--model.path", str(tmp_path / "llama")])
    assert any(p.key == "lora.target_parameters" and "no fused expert tensors" in p.message for p in problems)


def _saved_moe(tmp_path) -> str:
    """A tiny Qwen3-MoE saved for model.path, in the byte tokenizer's vocabulary."""
    from prime_train.engine.tokenizer import build_byte_tokenizer, padded_vocab_size

    vocab = padded_vocab_size(build_byte_tokenizer(), 64)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_config("qwen3_moe", vocab_size=vocab))
    model.save_pretrained(tmp_path / "moe")
    build_byte_tokenizer().save_pretrained(tmp_path / "moe")
    return str(tmp_path / "moe")


def test_an_sft_run_trains_the_experts_adapters_and_exports_them_merged_and_in_peft_format(tmp_path):
    """A real run, one process and two FSDP2 ranks with the same global batch: the same losses; final/ is the merged
    model whose experts moved off the base, and final/adapter/ loads through peft to the same logits; the step
    checkpoint converted by `ckpt to-hf` is final/ again."""
    from enginetools import cli, env, run_train
    from peft import PeftModel

    path = _saved_moe(tmp_path)
    common = {"model.path": path, "lora.rank": 4, "lora.target_parameters": "gate_up_proj,down_proj",
              "train.max_steps": 3, "ckpt.interval": 1000, "logging.log_interval": 1, "train.lr": 1e-2,
              "train.micro_batch_size": 8, "train.global_batch_size": 16}  # fmt: skip
    losses = {}
    for name, extra in (("one", {}), ("fsdp", {"distributed.nproc_per_node": 2, "distributed.strategy": "fsdp"})):
        result = run_train(tmp_path, name, timeout=300, **common, **extra)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "down_proj (each expert), gate_up_proj (each expert)" in result.stdout
        rows = map(json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines())
        losses[name] = [row["loss"] for row in rows if "loss" in row]
    assert len(losses["one"]) == 3 and losses["one"] == pytest.approx(losses["fsdp"], rel=1e-4)

    base = AutoModelForCausalLM.from_pretrained(path)
    final = tmp_path / "one" / "final"
    merged = AutoModelForCausalLM.from_pretrained(final)
    moved = (merged.model.layers[0].mlp.experts.gate_up_proj - base.model.layers[0].mlp.experts.gate_up_proj).abs()
    assert moved.amax(dim=(1, 2)).gt(0).all()  # every expert of the first layer trained
    adapter = json.loads((final / "adapter" / "adapter_config.json").read_text())
    assert adapter["target_parameters"] == EXPERTS
    peft_model = PeftModel.from_pretrained(base, final / "adapter")
    torch.testing.assert_close(_logits(peft_model), _logits(merged), atol=1e-5, rtol=1e-5)
    fsdp = AutoModelForCausalLM.from_pretrained(tmp_path / "fsdp" / "final")
    torch.testing.assert_close(_logits(fsdp), _logits(merged), atol=1e-4, rtol=1e-4)

    out = tmp_path / "converted"
    step = tmp_path / "one" / "checkpoints" / "step-3"
    result = subprocess.run(cli("ckpt", "to-hf", str(step), str(out)), env=env(), capture_output=True, text=True,
                            timeout=300)  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    torch.testing.assert_close(_logits(AutoModelForCausalLM.from_pretrained(out)), _logits(merged))


def test_a_dense_layer_of_an_moe_keeps_its_own_adapters_and_the_export_says_what_peft_will_load(tmp_path, caplog):
    """peft 0.21 on transformers 5 renames gate/up/down_proj targets of some MoE families to their fused experts (for
    adapters trained on transformers 4), which moved the adapters of Qwen3-MoE's mlp_only_layers and DeepSeek-V3's
    first layers onto the experts of every other layer, at twice the rank. The engine's targets go in as resolved;
    peft's own loading of the exported adapter still renames them, and the export says so."""
    import logging

    model = _with_trained_adapters(_model("qwen3_moe", mlp_only_layers=[0]), LoraConfig(rank=2))
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "model.layers.0.mlp.gate_proj.lora_A.default.weight" in trained
    assert not any(".experts." in n or ".gate.weight" in n for n in trained)
    hf = _config("qwen3_moe", mlp_only_layers=[0]).to_dict()
    assert lora.trainable_parameters(model)[0] == count_adapters(hf, 2).trainable
    live = _logits(model)
    state = {name: t.clone() for name, t in model.state_dict().items()}
    plain = _model("qwen3_moe", seed=7, mlp_only_layers=[0])
    plain.load_state_dict(lora.merged_state_dict(state, lora.adapter_identity(model), lora.expert_adapters(model)))
    torch.testing.assert_close(_logits(plain), live, atol=1e-5, rtol=1e-5)
    with caplog.at_level(logging.WARNING, logger="prime_train.engine"):
        lora.save_peft_adapter(model, tmp_path / "adapter", "base")
    assert "adapts down_proj, gate_proj, up_proj of dense layers" in caplog.text
    assert "The merged model (lora.merge_on_export) is" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="prime_train.engine"):  # no dense MLP names: nothing to say
        lora.save_peft_adapter(lora.apply_lora(_model("qwen3_moe"), LoraConfig(rank=2)), tmp_path / "other", "base")
    assert "dense layers" not in caplog.text


# rewards that vary between a random model's samples, so GRPO's advantages move the policy from the first step
SHARE_ENV = """
from prime_train.environments import Prompt


class Share:
    name = "share"
    uses_tools = False

    def prompts(self, split, n, seed):
        return [Prompt(f"reverse {w}=", w[::-1], {}) for w in ("abc", "xyz", "hello", "moe")[:n] * n][:n]

    def reward(self, prompt, completion):
        return sum(c in "aeiou" for c in completion) / max(1, len(completion))


def load_environment(**kwargs):
    return Share()
"""


def test_rl_with_expert_adapters_publishes_merged_weights_the_worker_serves_as_the_trainer_computes(tmp_path):
    """GRPO with LoRA on the experts: the embedded worker loads the merged weights each step (the experts' updates
    folded in, saved per expert as transformers writes an MoE); its log-probs of its own samples at the second step,
    drawn from a policy that had moved, are the trainer's."""
    from enginetools import TINY_RL, cli, env, free_port

    (tmp_path / "share_env.py").write_text(SHARE_ENV)
    args = {"run.output_dir": str(tmp_path), "run.name": "rl", "model.path": _saved_moe(tmp_path),
            "lora.rank": 4, "lora.target_parameters": "gate_up_proj,down_proj", "train.lr": 1e-2,
            "rl.environment": "share_env:load_environment",
            "inference.base_port": free_port(), "logging.tensorboard": "false", "supervisor.poll_interval_s": 0.5,
            "train.max_steps": 2, "rl.prompts_per_step": 4, "rl.group_size": 4, "train.global_batch_size": 16,
            "rl.eval_prompts": 0, "train.eval_interval": 1000, "ckpt.interval": 1000, "logging.log_interval": 1,
            "rl.mask_truncated": "false"}  # fmt: skip
    argv = cli("run", str(TINY_RL), *[part for key, value in args.items() for part in (f"--{key}", str(value))])
    result = subprocess.run(argv, env={**env(), "PYTHONPATH": str(tmp_path)}, capture_output=True, text=True,
                            timeout=600)  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [row for row in map(json.loads, (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines())
            if "reward" in row]  # fmt: skip
    assert len(rows) == 2 and rows[0]["grad_norm"] > 0, rows
    assert all(row["logprob_mismatch"] < 1e-4 for row in rows), rows
    log = (tmp_path / "rl" / "logs" / "attempt-1" / "trainer.log").read_text()
    assert "down_proj (each expert), gate_up_proj (each expert)" in log
    published = AutoModelForCausalLM.from_pretrained(tmp_path / "rl" / "final")
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "moe")
    assert not torch.equal(published.model.layers[1].mlp.experts.down_proj, base.model.layers[1].mlp.experts.down_proj)
