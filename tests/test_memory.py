"""The memory calculator against a real model, a real AdamW step and real saved activations, and its arithmetic."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from rich.console import Console

from prime_train.config.schema import Config
from prime_train.validator.gpus import load_gpus
from prime_train.validator.memory import estimate, inputs_from_config, inputs_from_flags, render_memory
from prime_train.validator.memory_breakdown import kv_bytes_per_token, trainer_memory
from prime_train.validator.memory_inputs import GIB, MIB, MemoryInputError, MemoryInputs, ModelShape, resolve_model
from prime_train.validator.model_shape import model_shape

# Qwen2.5-7B-Instruct's published config.json (the fields the calculator reads)
QWEN25_7B = {
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "tie_word_embeddings": False,
    "attention_dropout": 0.0,
}
QWEN25_7B_PARAMS = 7_615_616_512  # FACTS.md, counted on a meta-device model


def _small_config(**model: object) -> Config:
    """A Llama-shaped engine config: hidden 256, 4 layers, GQA 8/2 heads, SwiGLU 688 wide, fp32 on the CPU."""
    fields = {"hidden_size": 256, "num_layers": 4, "num_heads": 8, "num_kv_heads": 2, "intermediate_size": 688}
    return Config.model_validate(
        {
            "model": {**fields, **model},
            "data": {"seq_len": 128},
            "train": {"micro_batch_size": 2, "precision": "fp32"},
        }
    )


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one buffer count once)."""
    seen = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("tied", [False, True])
def test_weights_gradients_and_adamw_states_match_a_real_step(tied):
    """One real AdamW step of the engine's own model: the calculator's fp32 figures agree within 1 %."""
    torch = pytest.importorskip("torch")
    from prime_train.engine.evaluate import token_losses
    from prime_train.engine.model import build_model
    from prime_train.engine.optim import build_optimizer

    cfg = _small_config(tie_embeddings=tied)
    hf, _ = model_shape(cfg)
    torch.manual_seed(0)
    model = build_model(cfg.model, hf["vocab_size"])
    optimizer = build_optimizer(model, cfg.train, torch.device("cpu"))
    ids = torch.randint(0, hf["vocab_size"], (2, 128))
    pos = torch.arange(128).expand(2, 128)
    loss, _ = token_losses(model, ids, pos, ids.clone())
    loss.backward()
    optimizer.step()

    params = list({id(p): p for p in model.parameters()}.values())
    weights = sum(p.numel() * p.element_size() for p in params)
    grads = sum(p.grad.numel() * p.grad.element_size() for p in params)
    states = [optimizer.state[p] for p in params]
    moments = sum(s[k].numel() * s[k].element_size() for s in states for k in ("exp_avg", "exp_avg_sq"))
    steps = sum(s["step"].numel() * s["step"].element_size() for s in states)
    assert moments > 0 and steps > 0

    report = estimate(inputs_from_config(cfg, precision="fp32", strategy="none"))
    trainer = report.trainer
    assert trainer.weights == pytest.approx(weights, rel=0.01)
    assert trainer.gradients == pytest.approx(grads, rel=0.01)
    # `step` counters are left out by design (module docstring): they are noise next to m and v
    assert trainer.optimizer_states == pytest.approx(moments + steps, rel=0.01)
    assert steps < 1e-3 * moments


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_activations_match_the_tensors_autograd_saves(attention):
    """Every tensor autograd keeps for backward in a real fp32 forward (engine model and loss), counted by a hook."""
    torch = pytest.importorskip("torch")
    from prime_train.engine.evaluate import token_losses
    from prime_train.engine.model import build_model

    cfg = _small_config(tie_embeddings=False, attn_implementation=attention)
    hf, _ = model_shape(cfg)
    vocab = hf["vocab_size"]
    torch.manual_seed(0)
    model = build_model(cfg.model, vocab)
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    activations, loss_side = [], []

    def pack(t):
        if t.untyped_storage().data_ptr() not in param_storages:
            (loss_side if t.dim() and t.shape[-1] == vocab else activations).append(t)
        return t

    ids = torch.randint(0, vocab, (2, 128))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_losses(model, ids, torch.arange(128).expand(2, 128), ids.clone())
    measured = _storage_bytes(activations)

    report = estimate(inputs_from_config(cfg, loss="full"))  # transformers' model: the loss on whole logits
    assert report.trainer.activations == pytest.approx(measured, rel=0.03)
    # the loss keeps its fp32 log-softmax: a third of the 12 bytes per vocabulary entry counted at backward's peak
    saved_loss = _storage_bytes(loss_side)
    assert saved_loss == pytest.approx(report.trainer.get("logits and loss") / 3, rel=0.02)


@pytest.mark.parametrize("frozen_head", [False, True], ids=["full", "lora"])
def test_the_native_models_fused_loss_keeps_what_the_estimate_counts_and_no_logits(monkeypatch, frozen_head):
    """The model the trainer runs for a Llama-shaped config is the native one, whose loss never holds tokens x vocab
    logits (engine/loss.py). The estimate used to count 12 bytes per token per vocabulary entry whatever the model
    (23.5 GiB a GPU for Llama 3.1 8B at 2 x 8192 tokens); now it counts what the fused loss keeps for backward,
    measured here with autograd's hook, plus its passing peak: one chunk's fp32 logits and gradient and the lm_head
    gradient's fp32 sum. Under LoRA lm_head is frozen and the loss forms no gradient of it at all."""
    torch = pytest.importorskip("torch")
    from prime_train.engine import loss as fused
    from prime_train.engine.model import build_model
    from prime_train.validator.memory_inputs import loss_chunk_tokens

    cfg = _small_config(tie_embeddings=False)
    if frozen_head:
        cfg = cfg.model_copy(update={"lora": cfg.lora.model_copy(update={"rank": 8})})
    hf, _ = model_shape(cfg)
    vocab, hidden, tokens = hf["vocab_size"], hf["hidden_size"], 2 * 128
    torch.manual_seed(0)
    model = build_model(cfg.model, vocab, for_training=True)
    assert type(model).__name__ == "NativeCausalLM"
    model.lm_head.weight.requires_grad_(not frozen_head)  # as engine/lora.py leaves it: no adapter, frozen
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved_by_loss, everything = [], []
    forward = fused._FusedLinearCrossEntropy.forward

    def loss_forward(ctx, *args):
        save = ctx.save_for_backward

        def recorded(*tensors):
            saved_by_loss.extend(tensors)
            save(*tensors)

        ctx.save_for_backward = recorded
        return forward(ctx, *args)

    monkeypatch.setattr(fused._FusedLinearCrossEntropy, "forward", staticmethod(loss_forward))

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            everything.append(t)
        return t

    ids = torch.randint(0, vocab, (2, 128))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, labels=ids.clone()).loss.backward()
    assert saved_by_loss, "the fused loss saved nothing: not the path the trainer runs"
    logits = [t for t in everything if t.dim() and t.shape[-1] == vocab and t.numel() >= tokens * vocab]
    assert not logits, "a tokens x vocab tensor was kept for backward"
    kept = _storage_bytes(t for t in saved_by_loss if t is not None)
    # the hidden states' and (trained) the lm_head's gradients, fp32 here
    assert kept == (tokens + (0 if frozen_head else vocab)) * hidden * 4
    assert (model.lm_head.weight.grad is None) == frozen_head

    report = estimate(inputs_from_config(cfg))
    # a whole chunk, even of a smaller batch, and the lm_head gradient's fp32 sum when it trains
    passing = loss_chunk_tokens(vocab) * 12 * vocab + (0 if frozen_head else vocab * hidden * 4)
    assert report.trainer.get("logits and loss") == kept + passing
    # where it matters: Qwen2.5-7B's 152k vocabulary at 2 x 8192 tokens, 27.9 GiB of whole-logits loss against 5 GiB
    big = MemoryInputs(model=QWEN25_7B, seq_len=8192, micro_batch=2)
    m = ModelShape.from_hf(QWEN25_7B)
    assert big.chunked_loss and trainer_memory(big, m).get("logits and loss") < 5 * GIB
    assert trainer_memory(replace(big, loss="full"), m).get("logits and loss") > 25 * GIB


def test_selective_checkpointing_keeps_what_the_estimate_counts():
    """What selective checkpointing keeps of a layer: its input and the outputs of the ops its policy saves
    (engine/parallel.py selective_save_ops), recorded as the native model's layers run forward."""
    torch = pytest.importorskip("torch")
    from torch.utils._python_dispatch import TorchDispatchMode

    from prime_train.engine.model import build_model, decoder_layers
    from prime_train.engine.parallel import apply_ac, selective_save_ops

    cfg = _small_config(tie_embeddings=False, activation_checkpointing="selective")
    hf, _ = model_shape(cfg)
    torch.manual_seed(0)
    model = build_model(cfg.model, hf["vocab_size"], for_training=True)
    layers = decoder_layers(model)
    apply_ac(model, layers, "selective")
    save, inside, kept = selective_save_ops(), [False], []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if inside[0] and func in save:
                kept.extend(t for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor))
            return out

    for layer in layers:
        layer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
        layer.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    ids = torch.randint(0, hf["vocab_size"], (2, 128))
    with Record():
        model(ids, labels=ids.clone())
    layer_inputs = len(layers) * ids.numel() * hf["hidden_size"] * 4  # fp32 here
    measured = _storage_bytes(kept) + layer_inputs

    from prime_train.validator.memory_breakdown import _activation_bytes_per_token

    inputs = inputs_from_config(cfg)
    per_token = _activation_bytes_per_token(inputs, ModelShape.from_hf(hf))["selective"]
    assert ids.numel() * len(layers) * per_token == measured
    # and that is what the estimate's activations are made of, with the final norm and the token ids outside
    assert estimate(inputs).trainer.activations > ids.numel() * len(layers) * per_token


def test_the_mirrored_native_engine_facts_are_the_engines():
    import inspect

    from prime_train.engine.hf_head import FUSED_MODEL_TYPES
    from prime_train.engine.llama import SUPPORTED_MODEL_TYPES, NativeCausalLM
    from prime_train.engine.loss import chunk_tokens
    from prime_train.validator.memory_inputs import HF_CHUNKED_MODEL_TYPES, loss_chunk_tokens

    # the native decoder's families are counted chunked as its loss is, and so are transformers' given the head
    assert HF_CHUNKED_MODEL_TYPES == FUSED_MODEL_TYPES and set(SUPPORTED_MODEL_TYPES) <= set(FUSED_MODEL_TYPES)
    assert inspect.signature(NativeCausalLM.forward).parameters["loss_chunk_size"].default is None  # chunk_tokens
    vocabularies = (1, 320, 32_000, 50_304, 65_536, 65_537, 128_256, 151_936, 256_000, 10**7)
    assert [loss_chunk_tokens(v) for v in vocabularies] == [chunk_tokens(v) for v in vocabularies]
    assert [chunk_tokens(v) for v in vocabularies] == [1024] * 5 + [960, 512, 384, 256, 64]


def test_eager_attention_and_checkpointing_move_activations_the_right_way():
    m = ModelShape.from_hf(QWEN25_7B)
    base = MemoryInputs(model=QWEN25_7B, seq_len=4096, micro_batch=1)
    sdpa = trainer_memory(base, m).activations
    eager = trainer_memory(MemoryInputs(model=QWEN25_7B, seq_len=4096, attention="eager"), m).activations
    selective = trainer_memory(
        MemoryInputs(model=QWEN25_7B, seq_len=4096, activation_checkpointing="selective"), m
    ).activations
    full = trainer_memory(MemoryInputs(model=QWEN25_7B, seq_len=4096, activation_checkpointing="full"), m).activations
    # the score matrix: 28 heads × 4096 × (fp32 softmax + its bf16 copy) a token and layer, at least
    assert eager - sdpa >= 28 * 4096 * 6 * 4096 * 28
    # selective keeps the matmul and attention outputs and recomputes norms and the MLP's elementwise tensors
    assert full < selective < sdpa
    # full keeps one 3584-wide fp32 layer input per layer (autocast) and rebuilds one layer: about a tenth here
    assert full < sdpa / 5
    # activations grow linearly with the micro-batch; the states do not
    two = trainer_memory(MemoryInputs(model=QWEN25_7B, seq_len=4096, micro_batch=2), m)
    assert two.activations == pytest.approx(2 * sdpa, rel=1e-6)
    assert two.weights == trainer_memory(base, m).weights


def test_sharding_divides_the_states_by_strategy():
    m = ModelShape.from_hf(QWEN25_7B)
    assert m.num_params == QWEN25_7B_PARAMS

    def parts(strategy, gpus=8, nodes=1, shard=None, precision="fp32"):
        inputs = MemoryInputs(
            model=QWEN25_7B,
            strategy=strategy,
            gpus_per_node=gpus,
            num_nodes=nodes,
            hsdp_shard_size=shard,
            precision=precision,
        )
        t = trainer_memory(inputs, m)
        return t.weights, t.gradients, t.optimizer_states, t.activations

    w, g, o, act = parts("none", gpus=1)
    assert (w, g, o) == (4 * QWEN25_7B_PARAMS, 4 * QWEN25_7B_PARAMS, 8 * QWEN25_7B_PARAMS)
    assert parts("ddp") == (w, g, o, act)
    assert parts("zero1") == (w, g, math.ceil(o / 8), act)
    assert parts("zero2") == (w, math.ceil(g / 8), math.ceil(o / 8), act)
    assert parts("zero3") == (math.ceil(w / 8), math.ceil(g / 8), math.ceil(o / 8), act)
    assert parts("fsdp", gpus=4, nodes=2) == parts("zero3")  # 4 × 2 GPUs
    # HSDP shards within a node (or its shard group) and replicates across nodes
    assert parts("hsdp", gpus=4, nodes=2)[:3] == (math.ceil(w / 4), math.ceil(g / 4), math.ceil(o / 4))
    assert parts("hsdp", gpus=4, nodes=2, shard=2)[:3] == (math.ceil(w / 2), math.ceil(g / 2), math.ceil(o / 2))
    # bf16 under ZeRO: the ZeRO paper's 2 + 2 + 12 bytes; the engine with DDP: 4 + 4 + 8 plus autocast's copy
    zw, zg, zo, _ = parts("zero3", gpus=1, precision="bf16")
    assert (zw, zg, zo) == (2 * QWEN25_7B_PARAMS, 2 * QWEN25_7B_PARAMS, 12 * QWEN25_7B_PARAMS)
    ddp = trainer_memory(MemoryInputs(model=QWEN25_7B, strategy="ddp", gpus_per_node=2), m)
    assert ddp.get("bf16 weight copy") == 2 * QWEN25_7B_PARAMS
    assert ddp.get("DDP gradient buckets") == ddp.gradients
    with pytest.raises(MemoryInputError, match="hsdp_shard_size = 3"):
        estimate(MemoryInputs(model=QWEN25_7B, strategy="hsdp", gpus_per_node=4, hsdp_shard_size=3))


def test_kv_cache_of_qwen25_7b_by_hand():
    """FACTS.md: KV bytes per token = 2 × layers × kv_heads × head_dim × dtype bytes."""
    m = ModelShape.from_hf(QWEN25_7B)
    by_hand = 2 * 28 * 4 * (3584 // 28) * 2  # 57,344 bytes
    assert kv_bytes_per_token(m, 2) == by_hand == 57344
    assert kv_bytes_per_token(m, 1) == by_hand // 2  # fp8
    assert kv_bytes_per_token(m, 2, tensor_parallel=2) == by_hand // 2
    assert kv_bytes_per_token(m, 2, tensor_parallel=8) == by_hand // 4  # 4 kv heads over 8 ranks: one each

    inputs = MemoryInputs(model=QWEN25_7B, max_model_len=4000, max_num_seqs=32, gpu_memory_utilization=0.9)
    report = estimate(inputs)
    inf = report.inference
    assert inf.kv_bytes_per_token == by_hand
    assert inf.kv_bytes_per_sequence == by_hand * 4000  # 4000 is a whole number of 16-token blocks
    assert inf.kv_needed_bytes == 32 * by_hand * 4000
    assert inf.weights_bytes == 2 * QWEN25_7B_PARAMS
    h100 = next(g for g in report.gpus if g.gpu == "H100 SXM")
    budget = int(0.9 * 81559 * MIB) - inf.fixed_bytes
    assert h100.kv_available_bytes == budget
    assert h100.full_length_seqs == budget // (by_hand * 4000)
    assert h100.inference_verdict == "fits"
    l4 = next(g for g in report.gpus if g.gpu == "L4")
    assert 0 < l4.full_length_seqs < 32 and l4.inference_verdict == "limited"  # 14.2 GiB of weights in 22.5 GiB
    (small,) = estimate(MemoryInputs(**{**inputs.__dict__, "gpu_memory_utilization": 0.6, "gpus": ["L4"]})).gpus
    assert small.full_length_seqs == 0 and small.inference_verdict == "fails"  # vLLM would refuse to start


def test_gpu_verdicts_headroom_and_shortfall():
    report = estimate(MemoryInputs(model=QWEN25_7B, seq_len=2048))  # bf16 AdamW on one GPU, no sharding
    need = report.trainer.total
    table = load_gpus()
    by_name = {g.gpu: g for g in report.gpus}
    assert set(by_name) == set(table.names())
    for spec in table.gpus:
        verdict = by_name[spec.name]
        assert verdict.trainer_fits == (need <= spec.memory_bytes)
        assert verdict.trainer_headroom_bytes == spec.memory_bytes - need
    # 7.6B params × 18 bytes is beyond 80 GB but within a B200 or an MI300X
    assert not by_name["H100 SXM"].trainer_fits and by_name["H100 SXM"].headroom_gib < -50
    assert by_name["B200"].trainer_fits and by_name["MI300X"].trainer_fits
    # sharded over 8 GPUs with full checkpointing, an 80 GB GPU has room, and a larger micro-batch fits
    sharded = estimate(
        MemoryInputs(
            model=QWEN25_7B,
            seq_len=2048,
            strategy="fsdp",
            gpus_per_node=8,
            activation_checkpointing="full",
            gpus=["H100"],
        )
    )
    (h100,) = sharded.gpus
    assert h100.gpu == "H100 SXM" and h100.trainer_fits and h100.max_micro_batch >= 2
    grown = trainer_memory(
        MemoryInputs(
            model=QWEN25_7B,
            seq_len=2048,
            strategy="fsdp",
            gpus_per_node=8,
            activation_checkpointing="full",
            micro_batch=h100.max_micro_batch,
        ),
        sharded.shape,
    )
    assert grown.total <= h100.memory_bytes < grown.total + grown.per_micro_batch_bytes


def test_gpu_table_has_the_engines_peaks_and_names_unknown_gpus():
    pytest.importorskip("torch")
    from prime_train.engine.model import PEAK_TFLOPS_BF16

    table = load_gpus()
    assert table.checked
    for engine_name, peak in PEAK_TFLOPS_BF16.items():
        assert table.find(engine_name).bf16_tflops == peak
    assert table.find("nvidia h100 80gb hbm3").name == "H100 SXM"
    assert table.find("A100-80GB").memory_bytes == 80 * GIB
    with pytest.raises(MemoryInputError) as err:
        table.find("H800")
    assert "'H800'" in str(err.value) and "H100 SXM" in str(err.value) and "MI300X" in str(err.value)


def test_colocated_split_leaves_each_side_what_it_needs():
    inputs = MemoryInputs(
        model=QWEN25_7B,
        seq_len=1024,
        strategy="fsdp",
        gpus_per_node=8,
        activation_checkpointing="full",
        max_model_len=2048,
        max_num_seqs=32,
        colocate=True,
        gpus=["H100 SXM", "RTX 4090"],
    )
    report = estimate(inputs)
    h100, rtx = report.gpus
    c = h100.colocation
    assert c["fits"]
    util, cap, inf = c["recommended_gpu_memory_utilization"], h100.memory_bytes, report.inference
    # vLLM's share holds its fixed part and max_num_seqs full-length sequences; the trainer's holds its micro-batch
    assert inf.fixed_bytes + c["max_num_seqs_at_recommended"] * inf.kv_bytes_per_sequence <= util * cap
    assert c["max_num_seqs_at_recommended"] >= inputs.max_num_seqs
    mb = c["max_micro_batch_at_recommended"]
    assert mb >= inputs.micro_batch
    at_mb = trainer_memory(inputs, report.shape, micro_batch=mb)
    assert at_mb.total <= (1 - util) * cap < at_mb.total + at_mb.per_micro_batch_bytes
    assert rtx.colocation["fits"] is False and rtx.colocation["need_bytes"] > rtx.memory_bytes


def test_inputs_from_config_follow_the_engine():
    cfg = Config.model_validate(
        {
            "run": {"job": "rl"},
            "model": {"activation_checkpointing": True, "attn_implementation": "eager"},
            "train": {"precision": "auto", "micro_batch_size": 4},
            "distributed": {"nproc_per_node": 4},
            "inference": {"max_model_len": 1024, "max_num_seqs": 8, "colocate": True, "gpu_memory_utilization": 0.5},
        }
    )
    inputs = inputs_from_config(cfg)
    assert (inputs.strategy, inputs.gpus_per_node, inputs.precision) == ("ddp", 4, "bf16")
    assert (inputs.activation_checkpointing, inputs.attention, inputs.micro_batch) == ("full", "eager", 4)
    assert (inputs.max_model_len, inputs.max_num_seqs, inputs.colocate) == (1024, 8, True)
    assert inputs.gpu_memory_utilization == 0.5
    assert inputs_from_config(cfg, strategy="zero2").strategy == "zero2"
    assert inputs_from_config(Config()).max_model_len is None  # SFT: no inference section
    with pytest.raises(MemoryInputError, match="unknown memory setting"):
        inputs_from_config(cfg, micro_batch_size=2)
    with pytest.raises(MemoryInputError, match="strategy = 'zero4'"):
        inputs_from_config(cfg, strategy="zero4")
    with pytest.raises(MemoryInputError, match="gpu_memory_utilization"):
        inputs_from_config(cfg, gpu_memory_utilization=1.5)


def test_model_from_a_file_or_directory_and_clear_errors(tmp_path):
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(QWEN25_7B))
    hf, source = resolve_model(str(tmp_path / "m"))
    assert hf == QWEN25_7B and source.endswith("config.json")
    assert resolve_model(str(tmp_path / "m" / "config.json"))[0] == QWEN25_7B
    (tmp_path / "empty").mkdir()
    with pytest.raises(MemoryInputError, match=r"no config\.json"):
        resolve_model(str(tmp_path / "empty"))
    with pytest.raises(MemoryInputError, match=r"neither a config\.json"):
        resolve_model(str(tmp_path / "missing" / "config.json"))
    flags = inputs_from_flags(str(tmp_path / "m"), strategy="zero3", gpus_per_node=8, max_model_len=None)
    assert (flags.strategy, flags.world_size, flags.max_model_len, flags.model) == ("zero3", 8, None, QWEN25_7B)
    with pytest.raises(MemoryInputError, match="unknown memory setting"):
        inputs_from_flags(QWEN25_7B, gpu_count=8)
    with pytest.raises(MemoryInputError, match="'hidden_size'"):
        estimate(MemoryInputs(model={"num_hidden_layers": 2}, model_source="broken.json"))


def test_render_and_json():
    report = estimate(MemoryInputs(model=QWEN25_7B, model_source="Qwen2.5-7B", max_model_len=4096, colocate=True))
    console = Console(record=True, width=200)
    render_memory(report, console)
    text = console.export_text()
    for expected in ("Trainer memory per GPU", "optimizer states", "H100 SXM", "does not fit", "MI300X", "KV cache"):
        assert expected in text
    data = json.loads(json.dumps(report.to_dict()))
    assert data["model"]["num_params"] == QWEN25_7B_PARAMS
    assert data["trainer"]["total_bytes"] == report.trainer.total
    assert {g["gpu"] for g in data["gpus"]} == set(load_gpus().names())
    assert data["inference"]["kv_bytes_per_token"] == 57344


def test_a_gpu_without_bf16_is_flagged_when_the_run_is_bf16():
    """A T4 (in the one GPU table since `init` and `cost` take it) has no bf16: a bf16 verdict for it says so."""
    shape = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "intermediate_size": 128, "vocab_size": 256}  # fmt: skip
    bf16 = estimate(inputs_from_flags(shape, precision="bf16", gpus=["T4", "H100"]))
    assert [v.gpu for v in bf16.gpus] == ["T4", "H100 SXM"]
    assert any(n.startswith("T4: no bf16") for n in bf16.notes)
    # the table does not mark T4 "fits" beside that note: the run cannot start there at all
    assert [(v.gpu, v.cannot_start) for v in bf16.gpus] == [("T4", "no bf16"), ("H100 SXM", None)]
    console = Console(record=True, width=200)
    render_memory(bf16, console)
    [t4] = [line for line in console.export_text().splitlines() if line.startswith("│ T4 ")]
    assert "cannot start (no bf16)" in t4 and "fits" not in t4, t4
    fp32 = estimate(inputs_from_flags(shape, precision="fp32", gpus=["T4"]))
    assert not any("no bf16" in n for n in fp32.notes)


# ---------------------------------------------------------------- LoRA

LLAMA31_8B_CONFIG = "tests/data/model_configs/Llama-3.1-8B"  # the hub's config.json, as the counter tests read it


def test_adapter_count_of_the_default_tiny_model_is_the_engines():
    """The engine reports 23,552 trainable of 581,248 at rank 4 and 47,104 at rank 8 for the default tiny model (its
    tests build it with a 256-token vocabulary): the calculator counts the same adapters."""
    from prime_train.validator.param_count import count_adapters, count_parameters

    hf, _ = model_shape(Config())
    assert count_adapters(hf, 4).trainable == 23_552
    assert count_adapters(hf, 8).trainable == 47_104
    assert count_parameters({**hf, "vocab_size": 256}) + 23_552 == 581_248
    trainer = estimate(inputs_from_config(Config.model_validate({"lora": {"rank": 4}}))).trainer
    assert trainer.trainable_params == 23_552
    assert trainer.total_params == count_parameters(hf) + 23_552
    assert trainer.to_dict()["trainable_fraction"] == pytest.approx(23_552 / trainer.total_params, abs=1e-6)


def test_llama3_8b_fits_one_80gb_gpu_with_lora_and_not_trained_whole():
    settings = {"seq_len": 2048, "micro_batch": 1, "activation_checkpointing": "full", "gpus": ["H100", "A100-80GB"]}
    full = estimate(inputs_from_flags(LLAMA31_8B_CONFIG, **settings))
    lora = estimate(inputs_from_flags(LLAMA31_8B_CONFIG, lora_rank=16, **settings))
    qlora = estimate(inputs_from_flags(LLAMA31_8B_CONFIG, lora_rank=16, lora_quantize="nf4", **settings))
    assert not any(g.trainer_fits for g in full.gpus)
    assert all(g.trainer_fits and not g.tight for g in lora.gpus)
    assert all(g.trainer_fits for g in qlora.gpus) and qlora.trainer.total < lora.trainer.total
    # rank 16 on q/k/v/o and gate/up/down of 32 layers: the figure peft prints for Llama-3-8B
    assert lora.trainer.trainable_params == 41_943_040
    names = [p.name for p in lora.trainer.parts]
    assert {"adapter weights", "adapter gradients", "adapter optimizer states"} <= set(names)
    assert "gradients" not in names and "optimizer states" not in names  # the frozen base has neither
    n, a = 8_030_261_248, 41_943_040
    assert lora.trainer.weights == n * 4  # the base as the engine holds it: fp32
    assert lora.trainer.gradients == a * 4 and lora.trainer.optimizer_states == a * 8
    # NF4: the decoder blocks' linear weights at 4.127 bits; embeddings, lm_head and norms as they were
    linear = 32 * (4096 * 4096 * 2 + 4096 * 1024 * 2 + 3 * 4096 * 14336)
    assert qlora.trainer.weights == math.ceil(linear * (4 + 8 / 64 + 32 / 64 / 256) / 8 + (n - linear) * 4)
    # activations barely move: what the frozen weights' gradients needed goes, the adapters' r-wide outputs come
    assert 0.9 * full.trainer.activations < lora.trainer.activations < full.trainer.activations


def test_lora_settings_the_engine_refuses_are_refused():
    with pytest.raises(MemoryInputError, match="set a LoRA rank"):
        inputs_from_flags(LLAMA31_8B_CONFIG, lora_quantize="nf4")
    with pytest.raises(MemoryInputError, match=r"not supported with distributed\.strategy = 'fsdp'"):
        inputs_from_flags(LLAMA31_8B_CONFIG, lora_rank=8, lora_quantize="nf4", strategy="fsdp", gpus_per_node=8)
    one_gpu = inputs_from_flags(LLAMA31_8B_CONFIG, lora_rank=8, lora_quantize="nf4", strategy="fsdp")
    assert estimate(one_gpu).trainer.trainable_params > 0  # one process shards nothing: the engine trains it unwrapped
    with pytest.raises(MemoryInputError, match=r"'qkv' matches no linear layer.*q_proj"):
        estimate(inputs_from_flags(LLAMA31_8B_CONFIG, lora_rank=8, lora_targets=["q_proj", "qkv"]))


def _lora_model(cfg: Config, rank: int = 8, **lora: object):
    torch = pytest.importorskip("torch")
    pytest.importorskip("peft")
    from prime_train.config.schema import LoraConfig
    from prime_train.engine.lora import apply_lora
    from prime_train.engine.model import build_model

    hf, _ = model_shape(cfg)
    torch.manual_seed(0)
    model = build_model(cfg.model, hf["vocab_size"])
    return apply_lora(model, LoraConfig(rank=rank, **lora)), hf


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj"]], ids=["all-linear", "q-v"])
def test_lora_weights_gradients_and_adamw_states_match_a_real_step(targets):
    """One AdamW step of the engine's model with peft's adapters in it: the frozen base, the adapters and their
    gradients and moments as the calculator counts them (fp32 on the CPU)."""
    torch = pytest.importorskip("torch")
    from prime_train.engine.evaluate import token_losses
    from prime_train.engine.optim import build_optimizer

    cfg = _small_config(tie_embeddings=False)
    model, hf = _lora_model(cfg, target_modules=targets)
    optimizer = build_optimizer(model, cfg.train, torch.device("cpu"))
    ids = torch.randint(0, hf["vocab_size"], (2, 128))
    loss, _ = token_losses(model, ids, torch.arange(128).expand(2, 128), ids.clone())
    loss.backward()
    optimizer.step()

    params = list({id(p): p for p in model.parameters()}.values())
    trained = [p for p in params if p.requires_grad]
    assert all(p.grad is None for p in params if not p.requires_grad)
    moments = sum(optimizer.state[p][k].numel() * 4 for p in trained for k in ("exp_avg", "exp_avg_sq"))
    lora_cfg = cfg.model_copy(update={"lora": cfg.lora.model_copy(update={"rank": 8, "target_modules": targets})})
    trainer = estimate(inputs_from_config(lora_cfg, precision="fp32", strategy="none")).trainer
    assert trainer.trainable_params == sum(p.numel() for p in trained)
    assert trainer.weights + trainer.get("adapter weights") == sum(p.numel() * p.element_size() for p in params)
    assert trainer.gradients == sum(p.grad.numel() * p.grad.element_size() for p in trained)
    assert trainer.optimizer_states == moments


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj"]], ids=["all-linear", "q-v"])
def test_lora_activations_match_the_tensors_autograd_saves(targets):
    """What a real fp32 forward of the engine's model with adapters keeps for backward (a saved-tensors hook): the
    full model's activations less what only the frozen weights' gradients needed, plus each adapter's r-wide output."""
    torch = pytest.importorskip("torch")
    from prime_train.engine.evaluate import token_losses

    cfg = _small_config(tie_embeddings=False)
    model, hf = _lora_model(cfg, target_modules=targets)
    vocab = hf["vocab_size"]
    param_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    activations = []

    def pack(t):
        if t.untyped_storage().data_ptr() not in param_storages and not (t.dim() and t.shape[-1] == vocab):
            activations.append(t)
        return t

    ids = torch.randint(0, vocab, (2, 128))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_losses(model, ids, torch.arange(128).expand(2, 128), ids.clone())
    measured = _storage_bytes(activations)
    lora_cfg = cfg.model_copy(update={"lora": cfg.lora.model_copy(update={"rank": 8, "target_modules": targets})})
    lora = estimate(inputs_from_config(lora_cfg, loss="full")).trainer.activations
    assert lora == pytest.approx(measured, rel=0.03)
    assert lora < estimate(inputs_from_config(cfg, loss="full")).trainer.activations  # the whole model keeps more


def test_selective_checkpointing_keeps_the_adapters_matmul_outputs_too():
    """Selective checkpointing keeps every matmul's output (engine/parallel.py): with LoRA, A's and B's as well."""
    torch = pytest.importorskip("torch")
    from torch.utils._python_dispatch import TorchDispatchMode

    from prime_train.engine.model import decoder_layers
    from prime_train.engine.parallel import apply_ac, selective_save_ops
    from prime_train.validator.memory_breakdown import _activation_bytes_per_token, _lora_activations

    cfg = _small_config(tie_embeddings=False, activation_checkpointing="selective")
    model, hf = _lora_model(cfg)
    layers = decoder_layers(model)
    apply_ac(model, layers, "selective")
    save, inside, kept = selective_save_ops(), [False], []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if inside[0] and func in save:
                kept.extend(t for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor))
            return out

    for layer in layers:
        layer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
        layer.register_forward_hook(lambda *_: inside.__setitem__(0, False))
    ids = torch.randint(0, hf["vocab_size"], (2, 128))
    with Record():
        model(ids, labels=ids.clone())
    measured = _storage_bytes(kept) + len(layers) * ids.numel() * hf["hidden_size"] * 4  # + the layer inputs

    lora_cfg = cfg.model_copy(update={"lora": cfg.lora.model_copy(update={"rank": 8})})
    inputs = inputs_from_config(lora_cfg)
    shape = ModelShape.from_hf(hf)
    per_token = _activation_bytes_per_token(inputs, shape)["selective"]
    per_token += _lora_activations(inputs, shape, inputs.adapters).selective
    assert ids.numel() * len(layers) * per_token == measured


def test_memory_command_takes_lora_flags_and_shows_the_adapters(tmp_path):
    from typer.testing import CliRunner

    from prime_train.cli import app

    wide = {"COLUMNS": "200", "NO_COLOR": "1"}
    args = ["memory", "--model", LLAMA31_8B_CONFIG, "--seq-len", "2048", "--checkpointing", "full", "--gpu", "H100"]
    result = CliRunner().invoke(app, [*args, "--lora-rank", "16", "--json"], env=wide)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["lora"] == {"rank": 16, "targets": ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj",
                                                    "v_proj"], "quantize": "none", "trainable_params": 41_943_040,
                            "exact": True}  # fmt: skip
    assert data["trainer"]["trainable_params"] == 41_943_040 and data["gpus"][0]["trainer_fits"]
    text = CliRunner().invoke(app, [*args, "--lora-rank", "16", "--lora-quantize", "nf4"], env=wide).stdout
    assert "41,943,040 trainable of 8,072,204,288 parameters (0.520 %), base in NF4" in text
    assert "adapter optimizer states" in text and "NF4 base: 0.516 B a weight" in text
    refused = CliRunner().invoke(app, [*args, "--lora-quantize", "nf4"], env=wide)
    assert refused.exit_code == 78 and "set a LoRA rank" in refused.output


# ---------------------------------------------------------------- ZeRO stages, offload, fp16 and float8 (issue 30)


def test_zero_stages_of_llama31_8b_on_8_gpus_follow_what_each_stage_shards():
    settings = dict(gpus_per_node=8, seq_len=4096, activation_checkpointing="full")
    m = ModelShape.from_hf(resolve_model(LLAMA31_8B_CONFIG)[0])
    report = estimate(inputs_from_flags(LLAMA31_8B_CONFIG, strategy="fsdp", **settings))
    rows = {r["stage"]: r for r in report.stages}
    assert list(rows) == ["0", "1", "2", "3", "3 + cpu offload"]

    def total(**kw) -> int:
        return estimate(inputs_from_flags(LLAMA31_8B_CONFIG, **settings, **kw)).trainer.total

    # the engine's stage 3 is plain FSDP2; the DeepSpeed column is the zero1/2/3 strategies' accounting
    assert rows["3"]["engine_bytes"] == total(strategy="fsdp") == report.trainer.total
    assert [rows[s]["deepspeed_bytes"] for s in ("1", "2", "3")] == [total(strategy=f"zero{s}") for s in "123"]
    assert rows["0"]["engine_bytes"] == rows["0"]["deepspeed_bytes"] == total(strategy="ddp")
    # stage 2 keeps every layer gathered in bf16 through backward, where stage 3 holds the root and two layers;
    # FSDP2 has no optimizer-only stage, so 1 is 2
    kept_gathered = m.num_params - m.root_params - 2 * m.layer_params
    assert rows["2"]["engine_bytes"] - rows["3"]["engine_bytes"] == 2 * kept_gathered
    assert rows["1"]["engine_bytes"] == rows["2"]["engine_bytes"]
    # offload: fp32 weights, gradients and AdamW's two moments, sharded over 8, leave the GPU for the host
    shards = sum(math.ceil(m.num_params * b / 8) for b in (4, 4, 8))
    assert rows["3"]["engine_bytes"] - rows["3 + cpu offload"]["engine_bytes"] == shards
    assert rows["3 + cpu offload"]["engine_host_gib"] == round(shards / GIB, 2)
    # each stage shards more: none of them holds more than the one before (DDP holds the most)
    engine = [rows[s]["engine_bytes"] for s in rows]
    assert engine == sorted(engine, reverse=True)


def test_memory_prints_the_stages_side_by_side_and_in_json():
    from typer.testing import CliRunner

    from prime_train.cli import app

    wide = {"COLUMNS": "200", "NO_COLOR": "1"}
    args = ["memory", "--model", LLAMA31_8B_CONFIG, "--gpus-per-node", "8", "--strategy", "fsdp", "--gpu", "H100"]
    text = CliRunner().invoke(app, [*args, "--zero-stage", "2"], env=wide).stdout
    assert "ZeRO stages per GPU over 8 GPU(s), bf16" in text
    assert "ZeRO stage 2: the whole model unsharded through backward" in text
    lines = [line for line in text.splitlines() if line.startswith("│ 3 + cpu offload")]
    assert len(lines) == 1 and len(lines[0].split("│")) == 7  # stage, shards, engine, host, DeepSpeed
    data = json.loads(CliRunner().invoke(app, [*args, "--cpu-offload", "--json"], env=wide).stdout)
    assert [r["stage"] for r in data["zero_stages"]] == ["0", "1", "2", "3", "3 + cpu offload"]
    assert data["trainer"]["host_bytes"] > 0
    assert data["trainer"]["total_bytes"] == data["zero_stages"][-1]["engine_bytes"]
    refused = CliRunner().invoke(app, [*args[:-2], "--strategy", "ddp", "--zero-stage", "2"], env=wide)
    assert refused.exit_code == 78 and "zero_stage = 2" in refused.output


def test_config_zero_stage_fp16_and_float8_reach_the_estimate():
    cfg = Config.model_validate({"distributed": {"zero_stage": 2, "cpu_offload": True, "nproc_per_node": 4},
                                 "train": {"precision": "fp16", "float8": True}})  # fmt: skip
    inputs = inputs_from_config(cfg)
    assert (inputs.strategy, inputs.zero_stage, inputs.cpu_offload, inputs.precision) == ("fsdp", 2, True, "fp16")
    fp16, bf16 = estimate(inputs), estimate(replace(inputs, precision="bf16", float8=False))
    assert fp16.trainer.total == bf16.trainer.total  # 2-byte compute either way; float8 changes no line
    assert any(n.startswith("fp16: the bytes of bf16") for n in fp16.notes)
    assert any(n.startswith("float8 (torchao): the same bytes") for n in fp16.notes)
    one = inputs_from_config(Config.model_validate({"distributed": {"zero_stage": 3}}))
    assert (one.strategy, one.zero_stage) == ("none", None)  # one process: the engine trains unwrapped


def test_transformers_families_with_the_chunked_head_count_chunks_and_those_without_whole_logits():
    """engine/hf_head.py: the listed families train on the chunked loss on transformers' model too; a soft cap
    (Gemma 2) holds one more fp32 chunk buffer, a scaled one (Cohere) none, and an MoE's router loss beside it none."""
    from prime_train.validator.memory_inputs import loss_chunk_tokens

    def logits_line(config: dict) -> tuple[bool, int]:
        inputs = MemoryInputs(model=config, seq_len=2048, micro_batch=8)
        return inputs.chunked_loss, trainer_memory(inputs, ModelShape.from_hf(config)).get("logits and loss")

    configs = {}
    for name in ("gemma-3-1b-it", "gemma-2-2b", "Phi-3-mini-4k-instruct"):
        with open(f"tests/data/model_configs/{name}/config.json") as f:
            configs[name] = json.load(f)
    gemma3, gemma2 = configs["gemma-3-1b-it"], configs["gemma-2-2b"]
    chunked, line = logits_line(gemma3)
    assert chunked and line < 3 * GIB  # 48 GiB as whole fp32 logits: 16,384 tokens x 262,144 x 12 B
    assert logits_line(configs["Phi-3-mini-4k-instruct"])[0]
    chunked, line = logits_line(gemma2)
    uncapped = logits_line({**gemma2, "final_logit_softcapping": None})[1]
    assert chunked and line - uncapped == loss_chunk_tokens(gemma2["vocab_size"]) * gemma2["vocab_size"] * 4
    with open("tests/data/model_configs/Qwen3-30B-A3B/config.json") as f:
        moe = json.load(f)
    assert logits_line({**moe, "output_router_logits": True}) == logits_line(moe)
    assert logits_line(moe)[0]
    assert logits_line({**gemma3, "model_type": "cohere", "logit_scale": 0.0625, "final_logit_softcapping": None}) == (
        logits_line({**gemma3, "final_logit_softcapping": None})
    )
    assert not logits_line({**gemma3, "model_type": "gpt_neox"})[0]


def test_an_moe_router_loss_keeps_every_layers_router_logits_and_probabilities_past_checkpointing():
    """engine/hf_head.py: with the router loss on, transformers keeps each layer's router logits until the loss, and
    its load-balancing loss an fp32 softmax of them: 8 B per expert per layer per token past full or selective
    checkpointing, the softmax's 4 B without checkpointing (the logits are among the MLP's then)."""
    with open("tests/data/model_configs/Qwen3-30B-A3B/config.json") as f:
        moe = json.load(f)
    experts, layers, tokens = moe["num_experts"], moe["num_hidden_layers"], 4 * 2048

    def activations(ckpt: str, **settings) -> int:
        inputs = MemoryInputs(model=moe, seq_len=2048, micro_batch=4, activation_checkpointing=ckpt, **settings)
        return trainer_memory(inputs, ModelShape.from_hf(moe)).get("activations")

    for ckpt, per_layer in (("full", 8), ("selective", 8), ("none", 4)):
        off = activations(ckpt)  # Qwen's config.json: output_router_logits false
        assert activations(ckpt, router_aux_loss_coef=0.001) - off == per_layer * experts * layers * tokens, ckpt
        assert activations(ckpt, router_aux_loss_coef=0.001, job="reward") == activations(ckpt, job="reward")
        assert activations(ckpt, router_aux_loss_coef=0.0) == off
    on = {**moe, "output_router_logits": True}
    assert MemoryInputs(model=on).router_loss and not MemoryInputs(model=on, router_aux_loss_coef=0).router_loss
    cfg = Config.model_validate({"model": {"router_aux_loss_coef": 0.01}})
    assert inputs_from_config(cfg, model=moe).router_loss
