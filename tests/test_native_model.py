"""The native decoder (engine/llama.py) and the fused chunked loss (engine/loss.py) against transformers' own models."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
)

from prime_train.engine import llama
from prime_train.engine.llama import NativeCausalLM, supports, to_hf
from prime_train.engine.loss import chunked_cross_entropy, chunked_token_log_probs, reference_cross_entropy

VOCAB = 96
# small but not degenerate: GQA (4 query heads on 2 KV heads), 2 layers so a bad mask reaches the next layer
SHAPE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def _configs():
    return {
        "llama": LlamaConfig(**SHAPE),
        # a Llama 3.1 rope whose original context (16) is short enough for the scaling to move frequencies here
        "llama3-rope": LlamaConfig(
            **SHAPE,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
        "llama-tied": LlamaConfig(**SHAPE, tie_word_embeddings=True),
        "qwen2": Qwen2Config(**SHAPE),
        "qwen3": Qwen3Config(**SHAPE, head_dim=32),
        "mistral": MistralConfig(**SHAPE, sliding_window=None),
    }


FAMILIES = list(_configs())


def _pair(name: str, seed: int = 0):
    """An HF model of the family with every weight perturbed (biases and norms too), and a native copy."""
    config = _configs()[name]
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    hf.config.use_cache = False  # as the engine runs it: no cache, so HF masks packed rows per document
    with torch.no_grad():
        for param in hf.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    native = NativeCausalLM(config)
    native.load_state_dict(hf.state_dict(), strict=True)
    return hf, native


def _batch(batch: int = 2, length: int = 24, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (batch, length), generator=generator)


def _packed_positions(batch: int, lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths])[None].repeat(batch, 1)


@pytest.mark.parametrize("family", FAMILIES)
def test_native_state_dict_is_transformers_and_logits_equal_on_plain_and_packed_rows(family):
    hf, native = _pair(family)
    assert list(native.state_dict()) == list(hf.state_dict())
    if hf.config.tie_word_embeddings:
        assert native.lm_head.weight is native.model.embed_tokens.weight
    ids = _batch()
    positions = _packed_positions(2, [7, 11, 6])
    with torch.no_grad():
        torch.testing.assert_close(native(ids).logits, hf(input_ids=ids).logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(
            native(ids, position_ids=positions).logits,
            hf(input_ids=ids, position_ids=positions).logits,
            atol=1e-5,
            rtol=1e-5,
        )


# eager FlexAttention warns that it is the unfused reference: that is what is meant here
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("attention", ["sdpa", "flex"])
def test_packed_rows_equal_each_document_run_alone(attention):
    _, native = _pair("qwen3")
    native.attention = attention
    lengths = [5, 12, 7]
    ids = _batch(length=sum(lengths))
    with torch.no_grad():
        packed = native(ids, position_ids=_packed_positions(2, lengths)).logits
        alone = torch.cat([native(part).logits for part in ids.split(lengths, dim=1)], dim=1)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize(
    ("attention", "positions_from"), [("sdpa", "real_tokens"), ("sdpa", "row_start"), ("flex", "row_start")]
)
def test_left_padded_batch_with_attention_mask_equals_unpadded_rows(attention, positions_from):
    hf, native = _pair("llama")
    native.attention = attention
    rows = [_batch(1, n, seed=n)[0] for n in (9, 4, 13)]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = row
        mask[i, width - len(row) :] = 1
    if positions_from == "real_tokens":  # what the engine's greedy evaluation passes
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
    else:
        # positions counted from the row's first column: padding and text form one "document", so only the
        # key-padding mask keeps padding out (RoPE scores depend on offsets alone: the logits stay equal)
        positions = torch.arange(width)[None].repeat(len(rows), 1)
    with torch.no_grad():
        padded = native(ids, position_ids=positions, attention_mask=mask).logits
        for i, row in enumerate(rows):
            alone = hf(input_ids=row[None]).logits[0]
            assert torch.isfinite(padded[i]).all()
            torch.testing.assert_close(padded[i, width - len(row) :], alone, atol=1e-5, rtol=1e-5)


def test_dense_mask_leaves_no_query_without_a_key():
    # a fully masked row is NaN in some SDPA kernels, and a NaN output of a padding query reaches real
    # tokens in the next layer (0 attention weight times a NaN value is NaN)
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    dense = llama.dense_attention_mask(positions, mask)
    assert dense.shape == (2, 1, 5, 5)
    assert dense.any(-1).all()
    assert not dense[0, 0, 2:, :2].any()  # real tokens never see padding
    assert torch.equal(dense[1, 0], torch.ones(5, 5, dtype=torch.bool).tril())


@pytest.mark.parametrize("family", FAMILIES)
def test_training_step_loss_and_gradients_equal_transformers(family):
    hf, native = _pair(family)
    ids = _batch()
    positions = _packed_positions(2, [10, 14])
    labels = ids.clone()
    labels[:, :6] = -100  # a prompt without loss, as SFT has
    hf_loss = hf(input_ids=ids, position_ids=positions, labels=labels).loss
    hf_loss.backward()
    # a chunk size that does not divide the 48 tokens, so several chunks and a ragged last one run
    out = native(ids, position_ids=positions, labels=labels, loss_chunk_size=20)
    out.loss.backward()
    assert out.logits is None
    torch.testing.assert_close(out.loss, hf_loss, atol=1e-5, rtol=1e-5)
    hf_grads = dict(hf.named_parameters())
    for name, param in native.named_parameters():
        torch.testing.assert_close(param.grad, hf_grads[name].grad, atol=1e-5, rtol=1e-4, msg=name)


def test_loss_divides_by_the_token_count_given_and_sums_on_request():
    _, native = _pair("llama")
    ids = _batch()
    labels = ids.clone()
    labels[0, :10] = -100
    count = int((labels[:, 1:] != -100).sum())
    with torch.no_grad():
        summed = native(ids, labels=labels, loss_reduction="sum").loss
        mean = native(ids, labels=labels).loss
        over_batch = native(ids, labels=labels, num_items_in_batch=torch.tensor(3 * count)).loss
        logits = native(ids).logits
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), reduction="sum")
    torch.testing.assert_close(summed, expected)
    torch.testing.assert_close(mean, expected / count)
    torch.testing.assert_close(over_batch, expected / (3 * count))


def test_row_losses_keep_each_rows_loss_from_the_training_forward_on_native_and_hf_models():
    from prime_train.engine.evaluate import row_losses, token_losses

    hf, native = _pair("llama")
    ids = _batch(batch=3)
    labels = ids.clone()
    labels[0, :10] = -100
    labels[2] = -100  # a row without labels sums to 0
    positions = torch.arange(ids.shape[1])[None].repeat(3, 1)
    for model in (native, hf):
        total, rows = row_losses(model, ids, positions, labels)
        assert rows.shape == (3,) and not rows.requires_grad and rows[2] == 0
        torch.testing.assert_close(total, token_losses(model, ids, positions, labels)[0])
        torch.testing.assert_close(rows.sum(), total.detach())
        with torch.no_grad():  # each row's loss is the loss of that row alone
            alone = [token_losses(model, ids[i : i + 1], positions[i : i + 1], labels[i : i + 1])[0] for i in (0, 1)]
        torch.testing.assert_close(rows[:2], torch.stack(alone), rtol=1e-5, atol=1e-5)
        total.backward()  # the gradient flows through the sum as through token_losses'
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
        model.zero_grad(set_to_none=True)


def test_exported_native_model_loads_in_automodel_and_generates_the_same_greedy_tokens(tmp_path):
    config = _configs()["llama-tied"]
    native = llama.from_config(config, seed=3).eval()
    to_hf(native).save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    prompt = _batch(1, 6)
    generated = loaded.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0)
    ids = prompt
    with torch.no_grad():
        for _ in range(10):
            ids = torch.cat([ids, native(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert generated.tolist() == ids.tolist()
    # and back: the directory loads strictly into a native model with the same logits
    reloaded = llama.from_pretrained(tmp_path)
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids).logits, native(ids).logits)


def test_to_hf_shares_the_native_parameters():
    _, native = _pair("qwen2")
    hf = to_hf(native)
    assert native.model.layers[1].self_attn.q_proj.bias is hf.model.layers[1].self_attn.q_proj.bias
    with torch.no_grad():
        ids = _batch()
        torch.testing.assert_close(hf(input_ids=ids).logits, native(ids).logits, atol=1e-5, rtol=1e-5)
        # export of a sharded model passes the gathered full tensors instead: the HF model holds those
        gathered = {name: t.clone() for name, t in native.state_dict().items()}
        from_gathered = to_hf(native, gathered)
        assert from_gathered.lm_head.weight.data_ptr() == gathered["lm_head.weight"].data_ptr()
        torch.testing.assert_close(from_gathered(input_ids=ids).logits, native(ids).logits, atol=1e-5, rtol=1e-5)


def test_supports_refuses_what_the_native_model_does_not_compute():
    assert supports(_configs()["llama"]) is None
    assert "model_type 'gpt2'" in supports(GPT2Config())
    dynamic = LlamaConfig(**SHAPE, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0})
    assert "rope type 'dynamic'" in supports(dynamic)
    mistral = MistralConfig(**{**SHAPE, "max_position_embeddings": 8192}, sliding_window=4096)
    assert "sliding-window" in supports(mistral)
    # a window at least as long as the run's sequences never masks anything
    assert supports(mistral, max_seq_len=4096) is None
    qwen = Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=16, max_window_layers=0)
    assert "sliding-window" in supports(qwen)
    assert "hidden_act" in supports(LlamaConfig(**SHAPE, hidden_act="gelu"))
    with pytest.raises(ValueError, match="rope type 'dynamic'"):
        NativeCausalLM(dynamic)


def _head_inputs(seed: int):
    """Hidden states (2, 23, 16) and an output weight (50, 16), both trained, and labels whose first row starts with
    9 ignored positions (with chunk_size 1 and 7 some chunks are all ignored)."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 23, 16, generator=generator, requires_grad=True)
    weight = torch.randn(50, 16, generator=generator, requires_grad=True)
    labels = torch.randint(0, 50, (2, 23), generator=generator)
    labels[0, :9] = -100
    return hidden, weight, labels, generator


@pytest.mark.parametrize("num_items", [None, 37])
@pytest.mark.parametrize("chunk_size", [1, 7, 64])
def test_chunked_cross_entropy_loss_and_gradients_equal_f_cross_entropy(chunk_size, num_items):
    hidden, weight, labels, _ = _head_inputs(0)
    loss = chunked_cross_entropy(hidden, weight, labels, num_items=num_items, chunk_size=chunk_size)
    grads = torch.autograd.grad(loss, (hidden, weight))
    logits = (hidden @ weight.T).reshape(-1, 50)
    expected = F.cross_entropy(logits, labels.reshape(-1), ignore_index=-100, reduction="sum")
    expected = expected / (num_items or int((labels != -100).sum()))
    expected_grads = torch.autograd.grad(expected, (hidden, weight))
    torch.testing.assert_close(loss, expected)
    for got, want in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(got, want)
    with torch.no_grad():
        torch.testing.assert_close(chunked_cross_entropy(hidden, weight, labels, num_items=num_items), expected)


@pytest.mark.parametrize("vocab", [32_000, 128_256])
def test_the_default_chunk_holds_at_most_256_mib_of_fp32_logits_and_gives_the_reference_values(monkeypatch, vocab):
    """At Llama 3's vocabulary a 1024-token chunk's fp32 logits are 501 MiB, held three or four at a time; by default
    the loss and the log-probs take 512 tokens there (1024 up to a 64k vocabulary), through the native forward too."""
    from prime_train.engine import loss as fused

    seen = []
    real = fused._chunk_target_log_probs

    def recorded(hidden, weight, *args):
        seen.append(hidden.shape[0] * weight.shape[0])
        return real(hidden, weight, *args)

    monkeypatch.setattr(fused, "_chunk_target_log_probs", recorded)
    generator = torch.Generator().manual_seed(3)
    tokens, width = 1500, 4
    hidden = torch.randn(tokens, width, generator=generator, requires_grad=True)
    weight = (torch.randn(vocab, width, generator=generator) * 0.5).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=generator)
    loss = chunked_cross_entropy(hidden, weight, labels)
    log_probs, _ = chunked_token_log_probs(hidden, weight, labels)
    chunk = 1024 if vocab == 32_000 else 512

    def chunks(n):
        return [min(chunk, n - start) * vocab for start in range(0, n, chunk)]

    assert seen == chunks(tokens) * 2 and max(seen) * 4 <= 256 * 2**20
    with torch.no_grad():
        logits = hidden @ weight.T
        torch.testing.assert_close(loss, F.cross_entropy(logits, labels))
        torch.testing.assert_close(log_probs, torch.log_softmax(logits, -1).gather(-1, labels[:, None])[:, 0])

    seen.clear()
    config = LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512)  # fmt: skip
    ids = torch.randint(0, vocab, (3, 400), generator=generator)
    model = NativeCausalLM(config)
    model(ids, labels=ids).loss.backward()  # the fused loss: its gradients formed in forward
    model(ids, labels=ids, token_log_probs=True).log_probs.sum().backward()  # each chunk again in backward
    assert seen == chunks(ids.numel()) * 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_weights_gradient_is_summed_over_chunks_in_one_fp32_buffer_and_no_fp32_copy_of_a_product(dtype):
    """lm_head's gradient is a sum over chunks, kept in fp32. Each chunk's product must not get an fp32 copy of its
    own (vocab x hidden x 4 bytes: 2 GiB at Llama 3 8B, beside the sum), nor, in fp32, a product buffer at all."""
    from torch.utils._python_dispatch import TorchDispatchMode

    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(100, 16, generator=generator).to(dtype).requires_grad_()
    weight = torch.randn(50, 16, generator=generator).to(dtype).requires_grad_()
    labels = torch.randint(0, 50, (100,), generator=generator)
    made = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor) and tuple(t.shape) == (50, 16) and not func.is_view:
                    made.append((func.__name__.split(".")[0], t.dtype))
            return out

    with Record():
        chunked_cross_entropy(hidden, weight, labels, chunk_size=10).backward()
    fused = list(made)
    made.clear()
    weight.grad = hidden.grad = None
    with Record():
        chunked_token_log_probs(hidden, weight, labels, chunk_size=10)[0].sum().backward()
    for calls in (fused, made):
        sums = [call for call in calls if call == ("zeros", torch.float32)]
        # besides the sum and the additions into it, the fused loss scales it once by backward's upstream gradient
        copies = [call for call in calls if call[1] == torch.float32 and call[0] not in ("zeros", "add_", "addmm_")]
        assert len(sums) == 1 and copies in ([], [("mul", torch.float32)]), str(calls)
        if dtype == torch.float32:  # added by addmm_ straight into the sum
            assert not [call for call in calls if call[0] in ("mm", "add_")], calls


@pytest.mark.parametrize("chunk_size", [7, 64])
def test_soft_capped_logits_give_the_loss_log_probs_and_gradients_of_the_capped_whole_logits(chunk_size):
    """Gemma 2's final_logit_softcapping: logits = c * tanh(z / c), then the loss or the tempered log-probs."""
    hidden, weight, labels, generator = _head_inputs(6)
    cap, upstream = 2.0, torch.randn(2, 23, generator=generator)

    def capped():  # |z| reaches 10 here: far from the identity
        return cap * torch.tanh(hidden @ weight.T / cap)

    want = F.cross_entropy(capped().reshape(-1, 50), labels.reshape(-1), ignore_index=-100)
    got = chunked_cross_entropy(hidden, weight, labels, chunk_size=chunk_size, softcap=cap)
    for a, b in zip(
        torch.autograd.grad(got, (hidden, weight)), torch.autograd.grad(want, (hidden, weight)), strict=True
    ):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(got, want)
    all_logp = torch.log_softmax(capped() / 0.7, -1)
    want_logp = torch.where(labels != -100, all_logp.gather(-1, labels.clamp(min=0)[..., None])[..., 0], 0.0)
    got_logp, entropy = chunked_token_log_probs(
        hidden, weight, labels, temperature=0.7, chunk_size=chunk_size, entropy=True, softcap=cap
    )
    torch.testing.assert_close(got_logp, want_logp)
    torch.testing.assert_close(entropy, -(all_logp.exp() * all_logp).sum(-1).detach())
    got_grads = torch.autograd.grad((got_logp * upstream).sum(), (hidden, weight))
    for a, b in zip(got_grads, torch.autograd.grad((want_logp * upstream).sum(), (hidden, weight)), strict=True):
        torch.testing.assert_close(a, b)
    with torch.no_grad():
        torch.testing.assert_close(chunked_cross_entropy(hidden, weight, labels, softcap=cap), want)


def test_chunked_cross_entropy_sum_matches_the_reference_and_scales_with_the_upstream_gradient():
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(40, 8, generator=generator, requires_grad=True)
    weight = torch.randn(30, 8, generator=generator, requires_grad=True)
    labels = torch.randint(0, 30, (40,), generator=generator)
    loss = chunked_cross_entropy(hidden, weight, labels, reduction="sum", chunk_size=16)
    reference = reference_cross_entropy(hidden, weight, labels, reduction="sum")
    (2.5 * loss).backward()
    got = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    (2.5 * reference).backward()
    torch.testing.assert_close(loss, reference)
    torch.testing.assert_close(got[0], hidden.grad)
    torch.testing.assert_close(got[1], weight.grad)


def test_chunked_cross_entropy_with_a_frozen_weight_gives_the_hidden_gradient_alone():
    # lm_head under LoRA: no gradient of the weight is formed, the hidden states' is the reference's
    generator = torch.Generator().manual_seed(5)
    hidden = torch.randn(40, 8, generator=generator, requires_grad=True)
    weight = torch.randn(30, 8, generator=generator)
    labels = torch.randint(0, 30, (40,), generator=generator)
    (got,) = torch.autograd.grad(chunked_cross_entropy(hidden, weight, labels, chunk_size=16), hidden)
    (want,) = torch.autograd.grad(reference_cross_entropy(hidden, weight, labels), hidden)
    torch.testing.assert_close(got, want)
    assert weight.grad is None


def test_chunked_cross_entropy_under_bf16_autocast_matches_the_plain_loss_to_bf16_precision():
    # the path a bf16 run takes: bf16 matmuls, fp32 log-probabilities, the weight's gradient summed in fp32
    generator = torch.Generator().manual_seed(2)
    hidden = torch.randn(40, 16, generator=generator, requires_grad=True)
    weight = torch.randn(30, 16, generator=generator, requires_grad=True)
    labels = torch.randint(0, 30, (40,), generator=generator)
    labels[:5] = -100
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = chunked_cross_entropy(hidden, weight, labels, chunk_size=16)
        reference = reference_cross_entropy(hidden, weight, labels)
    assert loss.dtype == torch.float32
    got, want = torch.autograd.grad(loss, (hidden, weight)), torch.autograd.grad(reference, (hidden, weight))
    torch.testing.assert_close(loss, reference, atol=1e-2, rtol=1e-2)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, w, atol=2e-3, rtol=2e-2)


def _whole_logit_log_probs(hidden, weight, labels, temperature):
    """What chunked_token_log_probs must equal: the whole logits, log_softmax, gather; and the entropy."""
    all_logp = torch.log_softmax((hidden @ weight.T).float() / temperature, dim=-1)
    valid = labels != -100
    picked = all_logp.gather(-1, torch.where(valid, labels, 0)[..., None]).squeeze(-1)
    return torch.where(valid, picked, 0.0), -(all_logp.exp() * all_logp).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [1, 7, 64])
def test_chunked_token_log_probs_and_their_gradients_equal_the_whole_logits(chunk_size, temperature):
    # each token gets its own upstream gradient (a DPO pair's weight, a GRPO advantage): backward forms each
    # chunk's logits again and must give what autograd through the whole logits gives
    hidden, weight, labels, generator = _head_inputs(3)
    upstream = torch.randn(2, 23, generator=generator)
    got, entropy = chunked_token_log_probs(
        hidden, weight, labels, temperature=temperature, chunk_size=chunk_size, entropy=True
    )
    want, want_entropy = _whole_logit_log_probs(hidden, weight, labels, temperature)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(entropy, want_entropy.detach())
    assert not entropy.requires_grad
    got_grads = torch.autograd.grad((got * upstream).sum(), (hidden, weight))
    want_grads = torch.autograd.grad((want * upstream).sum(), (hidden, weight))
    for g, w in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(g, w)
    with torch.no_grad():
        again, none = chunked_token_log_probs(hidden, weight, labels, temperature=temperature)
    torch.testing.assert_close(again, want.detach())
    assert none is None


def test_chunked_token_log_probs_skip_a_frozen_weights_gradient_and_keep_bf16_precision():
    generator = torch.Generator().manual_seed(4)
    hidden = torch.randn(40, 16, generator=generator, requires_grad=True)
    weight = torch.randn(30, 16, generator=generator)  # frozen, as lm_head under LoRA
    labels = torch.randint(0, 30, (40,), generator=generator)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, _ = chunked_token_log_probs(hidden, weight, labels, chunk_size=16)
        want = torch.log_softmax(F.linear(hidden, weight).float(), -1).gather(1, labels[:, None]).squeeze(1)
    assert got.dtype == torch.float32
    (g,) = torch.autograd.grad(got.sum(), hidden)
    (w,) = torch.autograd.grad(want.sum(), hidden)
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(g, w, atol=2e-3, rtol=2e-2)
    with pytest.raises(ValueError, match="temperature must be positive"):
        chunked_token_log_probs(hidden, weight, labels, temperature=0.0)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_native_token_log_probs_equal_transformers_logits(family):
    # the native forward's token_log_probs against HF's whole logits of the same weights: values, entropy,
    # gradients of every parameter under a per-token upstream gradient, and the final hidden states PPO reads
    hf, native = _pair(family)
    ids = _batch()
    labels = ids.clone()
    labels[:, :5] = -100
    out = native(ids, labels=labels, token_log_probs=True, temperature=0.8, return_entropy=True, loss_chunk_size=16)
    assert out.loss is None and out.logits is None
    logits = hf(ids).logits[:, :-1].float() / 0.8
    all_logp = torch.log_softmax(logits, -1)
    targets = labels[:, 1:]
    want = torch.where(targets != -100, all_logp.gather(-1, ids[:, 1:, None]).squeeze(-1), 0.0)
    torch.testing.assert_close(out.log_probs[:, :-1], want, atol=1e-5, rtol=1e-4)
    assert torch.equal(out.log_probs[:, -1], torch.zeros(2))
    torch.testing.assert_close(out.entropy[:, :-1], -(all_logp.exp() * all_logp).sum(-1).detach(), atol=1e-5, rtol=1e-4)
    weights = torch.linspace(-1, 1, want.numel()).view(want.shape)
    got_grads = torch.autograd.grad((out.log_probs[:, :-1] * weights).sum(), list(native.parameters()))
    want_grads = dict(zip(
        [n for n, _ in hf.named_parameters()],
        torch.autograd.grad((want * weights).sum(), list(hf.parameters())), strict=True,
    ))  # fmt: skip
    for (name, _), got in zip(native.named_parameters(), got_grads, strict=True):
        torch.testing.assert_close(got, want_grads[name], atol=1e-5, rtol=1e-4)
    assert out.hidden_states.shape == (2, ids.shape[1], SHAPE["hidden_size"])


def test_whole_native_model_with_loss_compiles_fullgraph_and_matches_eager():
    _, native = _pair("qwen3")
    ids = _batch()
    positions = _packed_positions(2, [10, 14])
    labels = ids.clone()

    def step(model, position_ids):
        return model(ids, position_ids=position_ids, labels=labels, loss_chunk_size=16).loss

    # plain rows (is_causal, no mask tensor) are one graph with no break
    explained = torch._dynamo.explain(step)(native, None)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    eager = step(native, positions)
    eager_grads = torch.autograd.grad(eager, list(native.parameters()))
    # packed rows (dense document mask) under fullgraph=True, which raises at any graph break. aot_eager: dynamo
    # and AOTAutograd (what inductor compiles) without CPU code generation, which takes a minute per graph here
    compiled = torch.compile(native, fullgraph=True, backend="aot_eager")
    loss = step(compiled, positions)
    grads = torch.autograd.grad(loss, list(native.parameters()))
    torch.testing.assert_close(loss, eager)
    for got, want in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_native_token_log_probs_compile_fullgraph_and_match_eager():
    # what DPO and GRPO run under train.compile: the chunked log-probs' autograd function, with its backward that
    # forms each chunk's logits again, traced whole
    _, native = _pair("qwen3")
    ids = _batch()
    labels = ids.clone()
    labels[:, :4] = -100

    def step(model):
        out = model(ids, labels=labels, token_log_probs=True, temperature=0.8, return_entropy=True, loss_chunk_size=16)
        return out.log_probs, out.entropy

    explained = torch._dynamo.explain(step)(native)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    weights = torch.linspace(-1, 1, ids.numel()).view(ids.shape)
    eager, eager_entropy = step(native)
    eager_grads = torch.autograd.grad((eager * weights).sum(), list(native.parameters()))
    got, got_entropy = step(torch.compile(native, fullgraph=True, backend="aot_eager"))
    grads = torch.autograd.grad((got * weights).sum(), list(native.parameters()))
    torch.testing.assert_close(got, eager)
    torch.testing.assert_close(got_entropy, eager_entropy)
    for g, e in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(g, e, atol=1e-6, rtol=1e-5)
