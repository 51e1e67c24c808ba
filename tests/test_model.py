"""Model building, parameter counts, FLOPs per token, device peaks and MFU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from prime_train.config.schema import ModelConfig
from prime_train.engine.metrics import EngineConfigError
from prime_train.engine.model import (
    PEAK_TFLOPS_BF16,
    build_model,
    decoder_layers,
    flops_per_token,
    mfu,
    num_parameters,
    peak_flops,
)

VOCAB = 320


def _hand_count(cfg: ModelConfig, vocab: int) -> int:
    """Parameters of a Llama/Qwen2 decoder, written out from the architecture."""
    h = cfg.hidden_size
    head_dim = h // cfg.num_heads
    kv = (cfg.num_kv_heads or cfg.num_heads) * head_dim
    inter = cfg.intermediate_size or 4 * h
    attention = h * h + 2 * h * kv + h * h  # q, k, v, o projections
    if cfg.arch == "qwen2":
        attention += h + 2 * kv  # Qwen2 has biases on q, k and v
    per_layer = attention + 3 * h * inter + 2 * h  # gate/up/down MLP and two RMSNorms
    embeddings = vocab * h * (1 if cfg.tie_embeddings else 2)
    return embeddings + cfg.num_layers * per_layer + h  # + final norm


@pytest.mark.parametrize(
    "cfg",
    [
        ModelConfig(),
        ModelConfig(arch="qwen2", num_kv_heads=2, intermediate_size=200, tie_embeddings=False),
        ModelConfig(arch="llama", hidden_size=64, num_layers=3, num_heads=8, num_kv_heads=2, tie_embeddings=False),
    ],
    ids=["llama-tied", "qwen2-gqa-untied", "llama-gqa-untied"],
)
def test_random_model_parameter_count_matches_architecture_formula(cfg):
    model = build_model(cfg, VOCAB)
    assert num_parameters(model) == _hand_count(cfg, VOCAB)
    assert num_parameters(model, exclude_embeddings=True) == _hand_count(cfg, VOCAB) - VOCAB * cfg.hidden_size
    assert model.config.vocab_size == VOCAB
    assert len(decoder_layers(model)) == cfg.num_layers
    assert all(p.dtype == torch.float32 for p in model.parameters())
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert tied == cfg.tie_embeddings


def test_random_init_is_determined_by_the_torch_seed():
    torch.manual_seed(7)
    a = build_model(ModelConfig(), VOCAB)
    torch.manual_seed(7)
    b = build_model(ModelConfig(), VOCAB)
    torch.manual_seed(8)
    c = build_model(ModelConfig(), VOCAB)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert not torch.equal(a.model.layers[0].mlp.up_proj.weight, c.model.layers[0].mlp.up_proj.weight)


def test_random_model_trains_forward_and_backward_without_a_kv_cache():
    model = build_model(ModelConfig(), VOCAB)
    ids = torch.randint(0, VOCAB, (2, 16))
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert out.past_key_values is None
    assert model.generation_config.use_cache  # generate() still decodes with a cache
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None


def test_from_pretrained_round_trip_loads_bf16_checkpoint_as_fp32(tmp_path):
    cfg = ModelConfig(arch="qwen2", num_kv_heads=2)
    original = build_model(cfg, VOCAB)
    original.to(torch.bfloat16).save_pretrained(tmp_path / "saved")

    loaded = build_model(ModelConfig(path=str(tmp_path / "saved")), VOCAB)

    assert type(loaded).__name__ == "Qwen2ForCausalLM"
    assert all(p.dtype == torch.float32 for p in loaded.parameters())
    expected = original.state_dict()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, expected[name].float()), name


def test_from_pretrained_grows_embeddings_to_the_padded_tokenizer_vocab(tmp_path):
    build_model(ModelConfig(), VOCAB).save_pretrained(tmp_path / "saved")
    loaded = build_model(ModelConfig(path=str(tmp_path / "saved")), VOCAB + 64)
    assert loaded.get_input_embeddings().weight.shape[0] == VOCAB + 64
    assert loaded.get_output_embeddings().weight.shape[0] == VOCAB + 64


def test_missing_local_model_path_is_a_config_error_naming_the_key(tmp_path):
    with pytest.raises(EngineConfigError, match=r"model\.path .*does not exist"):
        build_model(ModelConfig(path=str(tmp_path / "nowhere")), VOCAB)


def test_unreachable_hub_id_offline_is_a_config_error_naming_the_key(monkeypatch):
    import huggingface_hub.constants

    # the hub reads HF_HUB_OFFLINE once at import; set the flag it consults, so nothing waits on the network
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(EngineConfigError, match=r"model\.path 'no-such-org/no-such-model' could not be loaded"):
        build_model(ModelConfig(path="no-such-org/no-such-model"), VOCAB)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_flash_attention_without_cuda_is_a_config_error():
    with pytest.raises(EngineConfigError, match=r"model\.attn_implementation"):
        build_model(ModelConfig(attn_implementation="flash_attention_2"), VOCAB)


def test_flash_attention_on_a_gpu_without_flash_attn_is_a_config_error_not_a_crash(monkeypatch):
    # on the H100 this was an ImportError from transformers, retried as a crash; with no flash-attn package
    # installed here, transformers raises the same ImportError once it believes a GPU is present
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(EngineConfigError, match=r"model\.attn_implementation = 'flash_attention_2' cannot be used"):
        build_model(ModelConfig(attn_implementation="flash_attention_2"), VOCAB)


def test_decoder_layers_finds_the_largest_module_list_of_an_unknown_model():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.heads = nn.ModuleList([nn.Linear(2, 2)])
            self.blocks = nn.ModuleList([nn.Linear(2, 2) for _ in range(3)])

    odd = Odd()
    assert decoder_layers(odd) is odd.blocks
    wrapped = nn.Module()
    wrapped.module = odd  # how DDP holds it
    assert decoder_layers(wrapped) is odd.blocks


def test_flops_per_token_is_6n_plus_attention_term_with_lm_head_compute_counted():
    seq_len = 128
    for tie in (True, False):
        cfg = ModelConfig(tie_embeddings=tie)
        model = build_model(cfg, VOCAB)
        # input embedding lookup is free; the lm_head matmul is not, tied or not
        matmul_params = num_parameters(model, exclude_embeddings=True) + (VOCAB * cfg.hidden_size if tie else 0)
        expected = 6 * matmul_params + 12 * cfg.num_layers * cfg.hidden_size * seq_len
        assert flops_per_token(model.config, seq_len) == expected


def test_flops_per_token_of_llama_3_8b_uses_its_published_parameter_count():
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        tie_word_embeddings=False,
    )
    non_embedding = 8_030_261_248 - 128256 * 4096
    assert flops_per_token(config, 8192) == 6 * non_embedding + 12 * 32 * 4096 * 8192


def test_flops_per_token_leaves_the_torch_rng_untouched():
    model = build_model(ModelConfig(), VOCAB)
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    flops_per_token(model.config, 64)
    assert torch.equal(torch.rand(4), expected)


@pytest.mark.parametrize(
    ("device_name", "table_key"),
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 SXM5 80GB", "H100 SXM"),
        ("NVIDIA H100 PCIe", "H100 PCIe"),
        ("NVIDIA H200", "H200"),
        ("NVIDIA A100-SXM4-80GB", "A100"),
        ("NVIDIA A100-PCIE-40GB", "A100"),
        ("NVIDIA A100 80GB PCIe", "A100"),
        ("NVIDIA L40S", "L40S"),
        ("NVIDIA B200", "B200"),
    ],
)
def test_peak_flops_maps_cuda_device_names_to_the_bf16_table(device_name, table_key):
    assert peak_flops(device_name) == PEAK_TFLOPS_BF16[table_key] * 1e12


@pytest.mark.parametrize(
    "device_name",
    [
        "cpu",
        "",
        "NVIDIA A10",
        "NVIDIA L40",
        "NVIDIA H100 NVL",
        "NVIDIA H200 NVL",
        "NVIDIA GH200 480GB",
        "NVIDIA GB200",
        "Tesla V100-SXM2-16GB",
        "AMD Instinct MI300X",
    ],
)
def test_peak_flops_of_unknown_devices_is_none_rather_than_a_guess(device_name):
    assert peak_flops(device_name) is None


def test_mfu_is_achieved_over_peak_flops_across_devices():
    # 8 H100s at 989 TFLOP/s each; 1e6 tokens/s at 3.9e9 FLOPs/token is 3.9e15 FLOP/s of 7.912e15
    assert mfu(1e6, 3.9e9, 989e12, 8) == pytest.approx(3.9e15 / (8 * 989e12))
    assert mfu(1e6, 3.9e9, None, 8) is None
    assert mfu(1e6, 3.9e9, peak_flops("cpu"), 1) is None


@pytest.mark.parametrize("implementation", ["native", "hf"])
def test_the_trainers_model_from_a_path_is_in_training_mode(tmp_path, implementation):
    """from_pretrained returns eval mode; the trainer's model must not keep it (dropout, lora_dropout, an MoE
    router's jitter and load-balancing loss act only in training mode)."""
    from prime_train.config.schema import Config
    from prime_train.engine.model import load_model_and_tokenizer
    from prime_train.engine.tokenizer import build_byte_tokenizer, padded_vocab_size

    tokenizer = build_byte_tokenizer()
    build_model(ModelConfig(), padded_vocab_size(tokenizer, 64)).save_pretrained(tmp_path / "saved")
    tokenizer.save_pretrained(tmp_path / "saved")
    cfg = Config.model_validate({"model": {"path": str(tmp_path / "saved"), "implementation": implementation}})
    model = load_model_and_tokenizer(cfg)[1]
    assert all(m.training for m in model.modules())
