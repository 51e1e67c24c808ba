"""Quantization-aware training (train.qat, engine/qat.py): torchao's prepare swaps the decoder's linear layers for fake
quantized ones, the convert at export writes final/quantized/ that transformers loads as the quantized model and that
answers as the fake-quantized model did, the scheme this machine cannot run is refused (78) by lint and the engine, and
a QAT run resumes after kill -9 as the uninterrupted run trains."""

from __future__ import annotations

import signal
import subprocess

import pytest
import torch
from enginetools import (
    TINY,
    cli,
    env,
    final_weights,
    kill_group,
    losses_by_step,
    run_train,
    start,
    tiny_llama,
    tiny_overrides,
    wait_for,
)

from prime_train.engine.metrics import EngineConfigError
from prime_train.engine.qat import QUANTIZED_DIR, apply_qat, qat_unavailable, write_quantized

SCHEME = "int8_dynamic_act_int4_weight"


def output(result: subprocess.CompletedProcess) -> str:
    return result.stdout + result.stderr


def test_prepare_fake_quantizes_the_decoder_linears_and_the_export_loads_as_the_quantized_model(tmp_path):
    from torchao.quantization.qat import FakeQuantizedLinear
    from transformers import AutoModelForCausalLM

    model = tiny_llama(intermediate_size=96)  # hidden 32, MLP 96: every input width a multiple of the group (32)
    names = set(model.state_dict())
    assert apply_qat(model, SCHEME, torch.device("cpu")) == 14  # 7 per layer; lm_head stays
    assert isinstance(model.model.layers[0].mlp.down_proj, FakeQuantizedLinear)
    assert not isinstance(model.lm_head, FakeQuantizedLinear)
    assert set(model.state_dict()) == names  # checkpoints and the HF export see the same weights as without QAT
    ids = torch.randint(0, 64, (2, 12))
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()  # the straight-through backward reaches every weight
    assert model.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
    model.eval()
    with torch.no_grad():
        fake = model(input_ids=ids).logits
    model.save_pretrained(tmp_path)
    out = write_quantized(tmp_path, SCHEME)
    assert out == tmp_path / QUANTIZED_DIR
    loaded = AutoModelForCausalLM.from_pretrained(out)
    weight = loaded.model.layers[1].mlp.down_proj.weight
    assert type(weight).__name__ == "IntxUnpackedToInt8Tensor" and weight.qdata.dtype == torch.int8
    assert int(weight.qdata.min()) >= -8 and int(weight.qdata.max()) <= 7  # int4 values
    assert loaded.config.quantization_config.quant_method == "torchao"
    with torch.no_grad():
        real = loaded(input_ids=ids).logits
    # what training saw through fake quantization is what the converted model computes
    assert torch.allclose(real, fake, atol=1e-4), (real - fake).abs().max()


def test_int4_weight_only_needs_cuda_kernels_and_the_engine_says_so_in_words():
    why = qat_unavailable("int4_weight_only", torch.device("cpu"))
    assert why is not None and "CUDA" in why
    assert qat_unavailable(SCHEME, torch.device("cpu")) is None
    with pytest.raises(EngineConfigError, match="int4_weight_only"):
        apply_qat(tiny_llama(), "int4_weight_only", torch.device("cpu"))


def test_lint_refuses_int4_weight_only_on_this_machine_and_qat_with_lora():
    result = subprocess.run(
        cli("lint", str(TINY), "--train.qat", "int4_weight_only", "--lora.rank", "4"),
        env=env(), capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    if __import__("importlib").util.find_spec("mslk") is None:
        assert "train.qat = 'int4_weight_only' converts to torchao's int4 kernels" in output(result)
    assert result.returncode == 78, output(result)
    assert "train.qat with lora.rank > 0" in output(result) and "Traceback" not in output(result)


QAT_SHORT = {"train.qat": SCHEME, "train.max_steps": 12, "ckpt.interval": 6, "ckpt.async_save": "false"}


@pytest.mark.slow
def test_a_qat_run_killed_after_a_checkpoint_resumes_exactly_and_exports_the_quantized_model(tmp_path):
    from transformers import AutoModelForCausalLM

    straight = run_train(tmp_path, "straight", **QAT_SHORT)
    assert straight.returncode == 0, output(straight)[-4000:]
    assert "Applied QAT (int8_dynamic_act_int4_weight, fake-quantized) to 14 of 15 linear layers" in output(straight)
    proc = start(cli("train", str(TINY), *tiny_overrides(tmp_path, "killed", **QAT_SHORT)))
    try:
        wait_for((tmp_path / "killed" / "checkpoints" / "step-6").is_dir, 300, "the step-6 checkpoint")
        kill_group(proc, signal.SIGKILL)
        proc.wait(30)
    finally:
        kill_group(proc, signal.SIGKILL)
    resumed = run_train(tmp_path, "killed", **QAT_SHORT)
    assert resumed.returncode == 0, output(resumed)[-4000:]
    assert "resumed from" in output(resumed)
    a, b = losses_by_step(tmp_path / "straight"), losses_by_step(tmp_path / "killed")
    for step in range(7, 13):
        assert a[step] == b[step], (step, a[step], b[step])
    wa, wb = final_weights(tmp_path / "straight"), final_weights(tmp_path / "killed")
    for key in wa:
        assert torch.equal(wa[key], wb[key]), key
    quantized = AutoModelForCausalLM.from_pretrained(tmp_path / "killed" / "final" / QUANTIZED_DIR)
    assert type(quantized.model.layers[0].self_attn.q_proj.weight).__name__ == "IntxUnpackedToInt8Tensor"
