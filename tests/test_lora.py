"""LoRA / QLoRA on peft (engine/lora.py): the [lora] section, adapters on the native decoder and on transformers'
Llama, training only the adapters, small adapter state, PEFT's format, merged export, resume identity, activation
checkpointing, compile, and FSDP2 on two gloo ranks.

Run as a script, this file is the worker the two-process test launches under torchrun.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from enginetools import tiny_llama

from prime_train.config.loader import ConfigError, load_config
from prime_train.config.schema import Config, DistributedConfig, LoraConfig, ModelConfig, TrainConfig
from prime_train.engine import lora
from prime_train.engine.export import ADAPTER_DIR, export_hf
from prime_train.engine.metrics import EngineConfigError
from prime_train.engine.model import build_model, decoder_layers
from prime_train.engine.optim import build_optimizer
from prime_train.engine.parallel import DistInfo, apply_compile, parallelize, set_seed

pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
    # peft's PeftModel.from_pretrained asks transformers the old name
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
]

THIS_FILE = Path(__file__).resolve()
VOCAB = 256
CPU = torch.device("cpu")
SINGLE = DistInfo(rank=0, local_rank=0, world_size=1, local_world_size=1, device=CPU, backend="gloo")
ALL_LINEAR = ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
BATCH = torch.randint(0, 64, (4, 24), generator=torch.Generator().manual_seed(0))  # ids fit both models' vocab
PROMPT = torch.tensor([[1, 5, 9, 17, 33, 40, 2, 7, 11, 3]])


def native_model(seed: int = 0, **model):
    """The default config's model (a tiny Llama, trained natively: engine/llama.py)."""
    cfg = Config(model=ModelConfig(**model)) if model else Config()
    torch.manual_seed(seed)
    m = build_model(cfg.model, VOCAB, for_training=True)
    assert type(m).__name__ == "NativeCausalLM"
    return m


def hf_model(seed: int = 0):
    """transformers' LlamaForCausalLM from a tiny config."""
    return tiny_llama(seed).train()


MODELS = {"native": native_model, "hf": hf_model}


def lora_cfg(**kw) -> LoraConfig:
    return LoraConfig(**{"rank": 4, **kw})


def base_weights(model) -> dict[str, torch.Tensor]:
    """Every tensor of the state dict but the adapters', copied, under the plain (pre-LoRA) names."""
    return {
        k.replace(".base_layer.", "."): v.detach().clone()
        for k, v in model.state_dict().items()
        if not lora.is_adapter_key(k)
    }


def train(model, steps: int, *, lr: float = 1e-2) -> list[float]:
    """`steps` AdamW steps on BATCH through the engine's own optimizer; the losses."""
    optimizer = build_optimizer(model, TrainConfig(lr=lr, weight_decay=0.0), CPU)
    losses = []
    for _ in range(steps):
        loss = model(input_ids=BATCH, labels=BATCH).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def logits(model, ids: torch.Tensor = PROMPT) -> torch.Tensor:
    was = model.training
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids).logits
    model.train(was)
    return out


def fresh_hf_base(model_dir_or_config, weights: dict[str, torch.Tensor]):
    """A plain transformers model holding `weights` (the LoRA model's frozen base)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_config(model_dir_or_config)
    missing, unexpected = hf.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return hf.eval()


# ---------------------------------------------------------------- the [lora] section


def test_lora_section_defaults_off_and_validates_what_is_pure(tmp_path):
    cfg = Config()
    assert cfg.lora.rank == 0 and not cfg.lora.enabled
    assert (cfg.lora.target_modules, cfg.lora.quantize, cfg.lora.merge_on_export) == ("all-linear", "none", True)
    assert LoraConfig(rank=8).scale_alpha == 16.0 and LoraConfig(rank=8, alpha=8).scale_alpha == 8.0
    for field in LoraConfig.model_fields.values():
        assert field.description, field
    bad = {
        "rank": -1,
        "alpha": 0,
        "dropout": 1.0,
        "target_modules": [],
        "quantize": "int8",
    }
    for key, value in bad.items():
        with pytest.raises(ValueError, match=key):
            LoraConfig(**{key: value, **({"rank": 4} if key != "rank" else {})})
    with pytest.raises(ValueError, match="not a module name"):
        LoraConfig(rank=4, target_modules=["q.*"])
    with pytest.raises(ValueError, match=r"needs lora\.rank > 0"):
        LoraConfig(quantize="nf4")
    with pytest.raises(ValueError, match="extra"):
        LoraConfig(rank=4, r=4)

    # a TOML table and the command line: names separated by commas, or the one word
    path = tmp_path / "lora.toml"
    path.write_text('[lora]\nrank = 16\ntarget_modules = ["q_proj", "v_proj"]\n')
    assert load_config([path]).lora.target_modules == ["q_proj", "v_proj"]
    loaded = load_config([path], ["--lora.target_modules", "q_proj,o_proj", "--lora.alpha", "8"])
    assert (loaded.lora.target_modules, loaded.lora.scale_alpha) == (["q_proj", "o_proj"], 8.0)
    assert load_config([path], ["--lora.target_modules", "all-linear"]).lora.target_modules == "all-linear"
    with pytest.raises(ConfigError, match="dropout"):
        load_config([path], ["--lora.dropout", "1.5"])


def test_nf4_refusal_names_the_missing_piece():
    nf4 = LoraConfig(rank=8, quantize="nf4")
    assert "CUDA GPU" in nf4.unavailable(strategy="none", cuda=False, bitsandbytes=True)
    assert "bitsandbytes" in nf4.unavailable(strategy="none", cuda=True, bitsandbytes=False)
    assert "'fsdp'" in nf4.unavailable(strategy="fsdp", cuda=True, bitsandbytes=True)
    assert nf4.unavailable(strategy="ddp", cuda=True, bitsandbytes=True) is None
    assert LoraConfig(rank=8).unavailable(strategy="fsdp", cuda=False, bitsandbytes=False) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_nf4_without_cuda_is_a_config_error_before_anything_changes():
    model = native_model()
    before = base_weights(model)
    with pytest.raises(EngineConfigError, match="needs a CUDA GPU"):
        lora.apply_lora(model, lora_cfg(quantize="nf4"), device="cpu")
    assert not lora.has_lora(model)
    assert all(torch.equal(before[k], v) for k, v in base_weights(model).items())


# ---------------------------------------------------------------- applying


@pytest.mark.parametrize("kind", ["native", "hf"])
def test_apply_lora_trains_only_the_adapters_of_every_attention_and_mlp_linear(kind):
    model = MODELS[kind]()
    plain = {n for n, _ in model.named_parameters()}
    assert lora.apply_lora(model, lora_cfg()) is model

    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert trainable and all(lora.is_adapter_key(n) for n in trainable)
    assert {n.replace(".base_layer.", ".") for n in frozen} == plain  # the whole base, and nothing else
    adapted = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in trainable}
    assert adapted == set(ALL_LINEAR)
    layers = len(decoder_layers(model))
    assert len(trainable) == 2 * len(ALL_LINEAR) * layers  # lora_A and lora_B of each
    assert not any("lm_head" in n or "embed" in n for n in trainable)
    assert lora.adapter_identity(model) == {"rank": 4, "alpha": 8.0, "target_modules": ALL_LINEAR}
    n_trainable, total = lora.trainable_parameters(model)
    assert n_trainable == sum(p.numel() for n, p in model.named_parameters() if n in trainable)
    assert 0 < n_trainable < total / 4  # rank 4 on hidden 32 (HF tiny) is still a sizeable fraction


def test_named_targets_adapt_only_those_layers():
    model = native_model()
    lora.apply_lora(model, lora_cfg(target_modules=["q_proj", "mlp.down_proj"]))
    adapted = {n.split(".lora_")[0] for n, p in model.named_parameters() if p.requires_grad}
    assert adapted == {f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn.q_proj", "mlp.down_proj")}
    assert lora.adapter_identity(model)["target_modules"] == ["mlp.down_proj", "q_proj"]


@pytest.mark.parametrize("kind", ["native", "hf"])
def test_a_target_that_matches_nothing_lists_the_models_linear_layers(kind):
    model = MODELS[kind]()
    with pytest.raises(EngineConfigError) as err:
        lora.apply_lora(model, lora_cfg(target_modules=["q_proj", "query_key_value", "lm_head"]))
    message = str(err.value)
    assert "'query_key_value', 'lm_head'" in message and "match no linear layer" in message
    assert "Its linear layers are: " + ", ".join(ALL_LINEAR) in message
    assert not lora.has_lora(model)  # refused before any layer was replaced


def test_apply_lora_refuses_a_wrapped_model_and_a_second_adapter():
    model = native_model()
    lora.apply_lora(model, lora_cfg())
    with pytest.raises(EngineConfigError, match="already has LoRA"):
        lora.apply_lora(model, lora_cfg())
    with pytest.raises(ValueError, match="before parallelize"):
        lora.apply_lora(torch.compile(native_model()), lora_cfg())


# ---------------------------------------------------------------- training


@pytest.mark.parametrize("kind", ["native", "hf"])
def test_training_moves_only_the_adapters_and_lowers_the_loss(kind):
    model = MODELS[kind]()
    before = base_weights(model)
    lora.apply_lora(model, lora_cfg())
    optimizer = build_optimizer(model, TrainConfig(), CPU)
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert held == {id(p) for n, p in model.named_parameters() if lora.is_adapter_key(n)}
    adapters_before = {k: v.clone() for k, v in lora.adapter_state_dict(model).items()}

    losses = train(model, 8)

    assert losses[-1] < losses[0] - 0.05, losses
    after = base_weights(model)
    assert after.keys() == before.keys()
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert not changed, f"frozen weights moved: {changed}"
    adapters_after = lora.adapter_state_dict(model)
    assert all(not torch.equal(adapters_before[k], adapters_after[k]) for k in adapters_after if ".lora_B." in k)


def test_adapter_state_dict_is_small_and_named_as_the_bare_model(capsys):
    model = native_model()
    lora.apply_lora(model, lora_cfg())
    adapter = lora.adapter_state_dict(model)
    full = model.state_dict()
    assert set(adapter) == {k for k in full if lora.is_adapter_key(k)}
    assert all(".default." in k and not k.startswith(("module.", "_orig_mod.")) for k in adapter)
    adapter_bytes = sum(t.numel() * t.element_size() for t in adapter.values())
    full_bytes = sum(t.numel() * t.element_size() for t in {id(t): t for t in full.values()}.values())
    trainable, total = lora.trainable_parameters(model)
    with capsys.disabled():
        print(
            f"\n[lora] tiny default model, rank 4: {trainable} of {total} parameters trainable "
            f"({100 * trainable / total:.2f}%); adapter state {adapter_bytes} bytes vs full {full_bytes} bytes "
            f"({100 * adapter_bytes / full_bytes:.2f}%)"
        )
    assert adapter_bytes * 20 < full_bytes

    # the same names through compile (whole) and activation checkpointing wrappers
    wrapped = native_model()
    lora.apply_lora(wrapped, lora_cfg())
    cfg = Config()
    cfg.model.activation_checkpointing = "full"
    wrapped = parallelize(wrapped, cfg, SINGLE)
    assert any("_checkpoint_wrapped_module" in n for n, _ in wrapped.named_parameters())
    assert set(lora.adapter_state_dict(torch.compile(wrapped))) == set(adapter)


def test_load_adapter_state_dict_round_trips_and_refuses_another_adapter():
    trained = native_model()
    lora.apply_lora(trained, lora_cfg())
    train(trained, 3)
    state = lora.adapter_state_dict(trained)

    fresh = native_model()
    lora.apply_lora(fresh, lora_cfg())
    assert not torch.allclose(logits(fresh), logits(trained))
    lora.load_adapter_state_dict(fresh, state)
    assert torch.equal(logits(fresh), logits(trained))

    other = native_model()
    lora.apply_lora(other, lora_cfg(target_modules=["q_proj"]))
    with pytest.raises(EngineConfigError, match="not adapters of this model"):
        lora.load_adapter_state_dict(other, state)
    with pytest.raises(EngineConfigError, match="missing"):
        lora.load_adapter_state_dict(fresh, {k: v for k, v in state.items() if "layers.0." not in k})


# ---------------------------------------------------------------- export: PEFT's format and the merged model


@pytest.mark.parametrize("kind", ["native", "hf"])
def test_export_writes_a_peft_adapter_and_a_merged_model_with_the_trained_logits(tmp_path, kind):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = MODELS[kind](seed=3)
    before = base_weights(model)
    lora.apply_lora(model, lora_cfg())
    train(model, 6)
    expected = logits(model)

    out = export_hf(model, None, tmp_path / "final", rank=0, merge=True, adapter=True)

    # the merged model: plain transformers, plain names, the trained model's logits
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    assert not any("lora" in n or "base_layer" in n for n in merged.state_dict())
    torch.testing.assert_close(logits(merged), expected, rtol=1e-4, atol=1e-4)
    # and not the base's: the adapters did change the model
    assert not torch.allclose(logits(fresh_hf_base(merged.config, before)), expected, atol=1e-3)

    # the adapter: PEFT's files, loaded by PeftModel.from_pretrained on a fresh model holding the same base weights
    adapter_dir = out / ADAPTER_DIR
    assert sorted(p.name for p in adapter_dir.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = lora.read_adapter_config(adapter_dir)
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
    assert config["target_modules"] == ALL_LINEAR and config["task_type"] == "CAUSAL_LM"
    peft_model = PeftModel.from_pretrained(fresh_hf_base(merged.config, before), adapter_dir).eval()
    torch.testing.assert_close(logits(peft_model), expected, rtol=1e-5, atol=1e-5)

    # with its adapters bypassed it is the base again (RL's KL reference), and only inside the context
    with lora.adapters_disabled(model):
        torch.testing.assert_close(logits(model), logits(fresh_hf_base(merged.config, before)), rtol=1e-5, atol=1e-5)
    assert torch.equal(logits(model), expected)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        n for n, _ in model.named_parameters() if lora.is_adapter_key(n)
    }
    # the live model still trains after the export (it was not merged or unwrapped)
    assert lora.has_lora(model) and train(model, 1)


def test_gpt2_style_conv1d_layers_merge_and_load_in_peft(tmp_path):
    """transformers' Conv1D keeps its weight as in x out (peft's fan_in_fan_out): merged with the transpose."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=64, bos_token_id=1,
                                       eos_token_id=2))  # fmt: skip
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert lora.linear_module_names(model) == ["c_attn", "c_fc", "c_proj"]
    lora.apply_lora(model, lora_cfg())
    assert lora.adapter_identity(model)["fan_in_fan_out"] is True
    train(model, 4)
    expected = logits(model)
    out = export_hf(model, None, tmp_path / "final", rank=0, merge=True, adapter=True)
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    torch.testing.assert_close(logits(merged), expected, rtol=1e-4, atol=1e-4)
    base = GPT2LMHeadModel(merged.config)
    base.load_state_dict(before)
    peft_model = PeftModel.from_pretrained(base.eval(), out / ADAPTER_DIR).eval()
    torch.testing.assert_close(logits(peft_model), expected, rtol=1e-5, atol=1e-5)


def test_export_without_merge_writes_the_adapter_alone(tmp_path):
    model = native_model()
    lora.apply_lora(model, lora_cfg())
    out = export_hf(model, None, tmp_path / "final", rank=0, merge=False, adapter=True)
    assert not list(out.glob("*.safetensors")) and not (out / "config.json").exists()
    assert (out / ADAPTER_DIR / "adapter_model.safetensors").is_file()
    with pytest.raises(ValueError, match="merge and adapter are off"):
        export_hf(model, None, tmp_path / "final", rank=0, merge=False, adapter=False)


def test_merge_lora_gives_the_plain_model_with_the_trained_logits():
    model = native_model()
    plain_names = set(model.state_dict())
    lora.apply_lora(model, lora_cfg(dropout=0.1))
    train(model, 5)
    expected = logits(model)
    merged = lora.merge_lora(model)
    assert set(merged.state_dict()) == plain_names and not lora.has_lora(merged)
    assert not any(type(m).__module__.startswith("peft") for m in merged.modules())
    torch.testing.assert_close(logits(merged), expected, rtol=1e-4, atol=1e-4)


def test_merged_state_dict_is_w_plus_scaled_b_a():
    torch.manual_seed(0)
    w, a, b, bias = torch.randn(6, 5), torch.randn(2, 5), torch.randn(6, 2), torch.randn(6)
    state = {
        "x.base_layer.weight": w,
        "x.base_layer.bias": bias,
        "x.lora_A.default.weight": a,
        "x.lora_B.default.weight": b,
        "norm.weight": torch.ones(3),
    }
    w_before = w.clone()
    merged = lora.merged_state_dict(state, {"rank": 2, "alpha": 8.0, "target_modules": ["x"]})
    assert set(merged) == {"x.weight", "x.bias", "norm.weight"} and not state  # consumed, not held twice
    torch.testing.assert_close(merged["x.weight"], w + 4.0 * b @ a)
    assert merged["x.bias"] is bias and torch.equal(w, w_before)  # no tensor changed in place


# ---------------------------------------------------------------- resume


def test_resume_with_other_lora_settings_is_refused_naming_both():
    saved = {"rank": 8, "alpha": 16.0, "target_modules": ["q_proj", "v_proj"]}
    lora.check_resume_compatible(saved, {"rank": 8, "alpha": 16, "target_modules": ["v_proj", "q_proj"]})
    lora.check_resume_compatible(None, None)
    current = {"rank": 16, "alpha": 32.0, "target_modules": ALL_LINEAR}
    with pytest.raises(EngineConfigError) as err:
        lora.check_resume_compatible(saved, current, checkpoint="checkpoint step-40")
    message = str(err.value)
    assert "checkpoint step-40 was saved with LoRA rank 8, alpha 16.0, target_modules q_proj, v_proj" in message
    assert "this run has LoRA rank 16, alpha 32.0, target_modules " + ", ".join(ALL_LINEAR) in message
    assert "kept as it is" in message
    with pytest.raises(EngineConfigError, match=r"saved with no LoRA .* this run has LoRA rank 8"):
        lora.check_resume_compatible(None, saved)
    with pytest.raises(EngineConfigError, match=r"alpha 16\.0.*alpha 8\.0"):
        lora.check_resume_compatible(saved, {**saved, "alpha": 8.0})


def test_an_adapter_only_checkpoint_holds_the_adapters_and_their_optimizer_state(tmp_path):
    """The checkpoint wiring engine/lora.py recommends: TrainState's model and optim entries from
    lora.checkpoint_state, saved and loaded through DCP as the Checkpointer does, applied by load_checkpoint_state."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from prime_train.engine import safe_dcp

    def build():
        model = native_model()
        lora.apply_lora(model, lora_cfg())
        return model, build_optimizer(model, TrainConfig(lr=1e-2), CPU)

    model, optimizer = build()
    for _ in range(3):
        model(input_ids=BATCH, labels=BATCH).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model_sd, optim_sd = lora.checkpoint_state(model, optimizer)
    assert model_sd and all(lora.is_adapter_key(k) for k in model_sd)  # the tied lm_head too stays out
    assert set(optim_sd["state"]) == set(model_sd)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp_path / "lora", no_dist=True)
    full_model, full_optim = get_state_dict(model, optimizer)
    dcp.save({"model": full_model, "optim": full_optim}, checkpoint_id=tmp_path / "full", no_dist=True)
    size = {d: sum(f.stat().st_size for f in (tmp_path / d).iterdir()) for d in ("lora", "full")}
    assert size["lora"] * 5 < size["full"], size

    fresh, fresh_optimizer = build()
    template_model, template_optim = lora.checkpoint_state(fresh, fresh_optimizer)
    state = {"model": template_model, "optim": template_optim}
    safe_dcp.load(state, tmp_path / "lora", no_dist=True)
    lora.load_checkpoint_state(fresh, fresh_optimizer, state["model"], state["optim"])
    assert torch.equal(logits(fresh), logits(model))
    # the optimizer goes on where it was: the next step is the same step
    for m, o in ((model, optimizer), (fresh, fresh_optimizer)):
        m(input_ids=BATCH, labels=BATCH).loss.backward()
        o.step()
    assert torch.equal(logits(fresh), logits(model))


# ---------------------------------------------------------------- activation checkpointing and compile


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_gives_the_adapters_their_gradients(mode):
    def grads(checkpointing: str) -> dict[str, torch.Tensor]:
        model = native_model()
        lora.apply_lora(model, lora_cfg())
        cfg = Config()
        cfg.model.activation_checkpointing = checkpointing
        model = parallelize(model, cfg, SINGLE)
        named = {n.replace("_checkpoint_wrapped_module.", ""): p for n, p in model.named_parameters()}
        with torch.no_grad():  # lora_B starts at zero: give it a value so lora_A's gradient is not zero too
            for i, name in enumerate(sorted(n for n in named if ".lora_B." in n)):
                named[name].normal_(0, 0.02, generator=torch.Generator().manual_seed(i))
        model(input_ids=BATCH, labels=BATCH).loss.backward()
        return {n: p.grad for n, p in named.items() if p.grad is not None}

    plain, checkpointed = grads("none"), grads(mode)
    assert set(checkpointed) == set(plain) and all(lora.is_adapter_key(n) for n in plain)
    assert all(g.abs().sum() > 0 for g in checkpointed.values())
    for name, grad in plain.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("whole", [False, True])
def test_compiled_lora_model_trains_like_eager(whole):
    """Per decoder layer with fullgraph (what FSDP2 runs) and the whole native model: peft's LoRA layers trace
    without a graph break. aot_eager traces forward and backward as inductor does, without its C++ codegen."""
    torch._dynamo.reset()
    eager = native_model()
    lora.apply_lora(eager, lora_cfg())
    compiled = native_model()
    lora.apply_lora(compiled, lora_cfg())
    apply_compile(compiled, decoder_layers(compiled), backend="aot_eager", whole_model=whole)
    assert train(compiled, 3) == pytest.approx(train(eager, 3), rel=1e-5)


# ---------------------------------------------------------------- QLoRA (CUDA and bitsandbytes only)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_nf4_base_trains_the_adapters_and_exports_merged(tmp_path):
    pytest.importorskip("bitsandbytes")
    from transformers import AutoModelForCausalLM

    device = torch.device("cuda")
    model = native_model()
    lora.apply_lora(model, lora_cfg(quantize="nf4"), device=device)
    model.to(device)
    assert lora.has_quantized_base(model)
    optimizer = build_optimizer(model, TrainConfig(lr=1e-2, weight_decay=0.0), device)
    batch = BATCH.to(device)
    losses = []
    for _ in range(6):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    expected = logits(model, PROMPT.to(device)).float().cpu()
    out = export_hf(model, None, tmp_path / "final", rank=0, merge=True, adapter=True)
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    # the merged model holds the dequantized base: close to the 4-bit model's logits, not equal
    torch.testing.assert_close(logits(merged), expected, rtol=0.05, atol=0.05)


# ---------------------------------------------------------------- FSDP2 on two gloo ranks


def _torchrun(mode: str, tmp_path: Path) -> tuple[list[dict], str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    env["OMP_NUM_THREADS"] = "1"  # two ranks on two cores
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
           str(THIS_FILE), mode, str(tmp_path)]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    return [json.loads((tmp_path / f"{mode}-rank{r}.json").read_text()) for r in range(2)], output


def _fsdp_config(**model) -> Config:
    return Config(
        model=ModelConfig(**model),
        train=TrainConfig(lr=1e-2, weight_decay=0.0, warmup_steps=0, scheduler="constant"),
        distributed=DistributedConfig(strategy="fsdp"),
    )


def _single_process_reference() -> dict:
    """The same LoRA training in one process, on the whole batch: the losses FSDP2 must reproduce."""
    set_seed(1234, 0)
    model = build_model(_fsdp_config().model, VOCAB, for_training=True)
    lora.apply_lora(model, lora_cfg())
    return {"losses": train(model, 3), "logits": logits(model).tolist()}


def test_fsdp2_ddp_and_compiled_fsdp2_with_lora_train_like_one_process(tmp_path):
    (r0, r1), output = _torchrun("fsdp", tmp_path)
    assert "Applied FSDP" in output and "Applied DDP" in output and "LoRA rank 4" in output
    assert r0["all_dtensor"] and r0["optimizer_holds"] == r0["adapter_params"] > 0
    # each rank trained on its half of the batch; the all-reduced losses are the one-process losses
    reference = _single_process_reference()
    assert r0["losses"] == pytest.approx(reference["losses"], rel=1e-4)
    assert r0["losses"][-1] < r0["losses"][0]
    # the gathered adapter is the same whole tensors on both ranks, and the base did not move
    assert r0["adapter_checksums"] == r1["adapter_checksums"] and r0["adapter_keys"] == r1["adapter_keys"]
    assert r0["adapter_keys"] == sorted(r0["adapter_keys"]) and all(".lora_" in k for k in r0["adapter_keys"])
    assert r0["base_unchanged"] and r1["base_unchanged"]
    assert r0["ddp_losses"] == pytest.approx(reference["losses"], rel=1e-4)
    assert "Applied torch.compile to 2 decoder layers (fullgraph)" in output
    assert r0["compiled_losses"] == pytest.approx(reference["losses"], rel=1e-4)
    assert r0["ddp_adapter_checksums"] == r1["ddp_adapter_checksums"]
    # export under FSDP2 (rank 0 writes): merged and PEFT adapter, both giving the one-process model's logits
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    final = tmp_path / "final"
    merged = AutoModelForCausalLM.from_pretrained(final).eval()
    expected = torch.tensor(reference["logits"])
    torch.testing.assert_close(logits(merged), expected, rtol=1e-3, atol=1e-3)
    base = torch.load(tmp_path / "base.pt", weights_only=True)
    peft_model = PeftModel.from_pretrained(fresh_hf_base(merged.config, base), final / ADAPTER_DIR).eval()
    torch.testing.assert_close(logits(peft_model), logits(merged), rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- the torchrun worker


def _train_rank(model, optimizer, dist: DistInfo) -> list[float]:
    """3 steps on this rank's half of BATCH; the losses averaged over ranks."""
    per_rank = BATCH.shape[0] // dist.world_size
    ids = BATCH[dist.rank * per_rank : (dist.rank + 1) * per_rank]
    losses = []
    for _ in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t = loss.detach().reshape(1).clone()
        torch.distributed.all_reduce(t)
        losses.append(t.item() / dist.world_size)
    return losses


def _worker_fsdp(dist: DistInfo, out_dir: Path) -> dict:
    from torch.distributed.tensor import DTensor

    # DDP first: the same LoRA model, replicated
    cfg = _fsdp_config()
    cfg.distributed.strategy = "ddp"
    set_seed(1234, dist.rank)
    model = lora.apply_lora(build_model(cfg.model, VOCAB, for_training=True), lora_cfg())
    model = parallelize(model, cfg, dist)
    ddp_losses = _train_rank(model, build_optimizer(model, cfg.train, dist.device), dist)
    ddp_adapter = lora.adapter_state_dict(model)
    del model

    cfg = _fsdp_config(activation_checkpointing="full")
    set_seed(1234, dist.rank)
    model = build_model(cfg.model, VOCAB, for_training=True)
    base = base_weights(model)
    if dist.rank == 0:
        torch.save(base, out_dir / "base.pt")
    lora.apply_lora(model, lora_cfg())
    model = parallelize(model, cfg, dist)
    optimizer = build_optimizer(model, cfg.train, dist.device)
    losses = _train_rank(model, optimizer, dist)

    adapter = lora.adapter_state_dict(model)
    full = {k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    base_now = {k.replace(".base_layer.", "."): v for k, v in full.items() if not lora.is_adapter_key(k)}
    export_hf(model, None, out_dir / "final", rank=dist.rank, merge=True, adapter=True)
    fsdp = {
        "all_dtensor": all(isinstance(p, DTensor) for p in model.parameters()),
        "optimizer_holds": sum(len(g["params"]) for g in optimizer.param_groups),
        "adapter_params": sum(1 for n, p in model.named_parameters() if p.requires_grad and ".lora_" in n),
    }
    del model, optimizer

    # FSDP2 over decoder layers compiled with fullgraph (aot_eager: inductor's tracing without its C++ codegen)
    import functools

    import prime_train.engine.parallel as parallel_module

    cfg = _fsdp_config()
    cfg.train.compile = True
    real = parallel_module.apply_compile
    parallel_module.apply_compile = functools.partial(real, backend="aot_eager")
    try:
        set_seed(1234, dist.rank)
        compiled = lora.apply_lora(build_model(cfg.model, VOCAB, for_training=True), lora_cfg())
        compiled = parallelize(compiled, cfg, dist)
        compiled_losses = _train_rank(compiled, build_optimizer(compiled, cfg.train, dist.device), dist)
    finally:
        parallel_module.apply_compile = real
    return {
        "compiled_losses": compiled_losses,
        "ddp_losses": ddp_losses,
        "ddp_adapter_checksums": [float(ddp_adapter[k].double().sum()) for k in sorted(ddp_adapter)],
        "losses": losses,
        **fsdp,
        "adapter_keys": sorted(adapter),
        "adapter_checksums": [float(adapter[k].double().sum()) for k in sorted(adapter)],
        "base_unchanged": base_now.keys() == base.keys() and all(torch.equal(base[k], base_now[k]) for k in base),
    }


def _worker(mode: str, out_dir: str) -> None:
    from prime_train.engine.parallel import destroy_distributed, init_distributed

    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)
    dist = init_distributed(DistributedConfig())
    result = {"fsdp": _worker_fsdp}[mode](dist, Path(out_dir))
    destroy_distributed()
    Path(out_dir, f"{mode}-rank{dist.rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])


# ---------------------------------------------------------------- rank-stabilised LoRA


def test_rslora_scales_by_alpha_over_sqrt_rank_merges_exports_and_must_match_on_resume(tmp_path):
    """lora.rslora: peft's use_rslora, so the live model scales B @ A by alpha / sqrt(r) (16 / 2 = 8 at rank 4, not
    16 / 4 = 4); the merge and the PEFT export use the same scale, and the identity carries it (older checkpoints,
    without the key, are plain LoRA)."""
    from peft import PeftModel

    assert LoraConfig(rank=4, alpha=16).scaling == 4.0 and LoraConfig(rank=4, alpha=16, rslora=True).scaling == 8.0
    plain_model = hf_model()
    plain_model.save_pretrained(tmp_path / "base")
    model = lora.apply_lora(hf_model(), lora_cfg(alpha=16, rslora=True))
    assert lora.adapter_identity(model) == {"rank": 4, "alpha": 16.0, "target_modules": ALL_LINEAR, "rslora": True}
    q = model.model.layers[0].self_attn.q_proj
    assert q.scaling[lora.ADAPTER_NAME] == 8.0
    train(model, 3)
    expected = logits(model)
    state = {name: t.clone() for name, t in model.state_dict().items()}
    plain_model.load_state_dict(lora.merged_state_dict(state, lora.adapter_identity(model)))
    torch.testing.assert_close(logits(plain_model), expected, rtol=1e-4, atol=1e-4)
    lora.save_peft_adapter(model, tmp_path / "adapter", str(tmp_path / "base"))
    assert lora.read_adapter_config(tmp_path / "adapter")["use_rslora"] is True
    from transformers import AutoModelForCausalLM

    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "adapter")
    torch.testing.assert_close(logits(loaded), expected, rtol=1e-4, atol=1e-4)
    # the wrong scale would show: plain LoRA's merge of the same adapters is another model
    state = {name: t.clone() for name, t in model.state_dict().items()}
    plain_scale = {k: v for k, v in lora.adapter_identity(model).items() if k != "rslora"}
    plain_model.load_state_dict(lora.merged_state_dict(state, plain_scale))
    assert (logits(plain_model) - expected).abs().max() > 1e-3
    with pytest.raises(EngineConfigError, match=r"saved with LoRA rank 4, alpha 16\.0, .*, rsLoRA; this run has"):
        lora.check_resume_compatible(lora.adapter_identity(model), plain_scale)
