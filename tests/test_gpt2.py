"""The native GPT-2 (engine/gpt2.py, model.arch = "gpt2") against transformers' GPT2LMHeadModel, and trained by the
engine: FSDP over two gloo ranks, a DCP checkpoint, final/ that transformers loads as GPT2LMHeadModel."""

from __future__ import annotations

import pytest
import torch
from enginetools import run_train
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from prime_train.engine.gpt2 import NativeGPT2, supports
from prime_train.engine.llama import to_hf
from prime_train.engine.model import native_supports

VOCAB = 96
CONFIG = dict(
    vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, attn_pdrop=0.0, resid_pdrop=0.0, embd_pdrop=0.0
)


def pair(activation: str = "gelu_new"):
    """transformers' GPT-2 with every weight perturbed (biases and LayerNorms too), and a native copy."""
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(**CONFIG, activation_function=activation)).eval()
    with torch.no_grad():
        for param in hf.parameters():
            param.add_(torch.randn_like(param) * 0.1)
    native = NativeGPT2(hf.config).eval()
    native.load_state_dict(hf.state_dict(), strict=True)
    return hf, native


@pytest.mark.parametrize("activation", ["gelu", "gelu_new"])
def test_native_gpt2_gives_transformers_logits_and_loss(activation):
    hf, native = pair(activation)
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids, labels=ids)
        logits = native(ids).logits
        loss = native(ids, labels=ids).loss
    torch.testing.assert_close(logits, expected.logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss, expected.loss, atol=1e-5, rtol=1e-5)


def test_packed_rows_attend_within_their_document_at_their_own_positions():
    _, native = pair()
    ids = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(2))
    positions = torch.cat([torch.arange(12), torch.arange(8)])[None]
    with torch.no_grad():
        packed = native(ids, position_ids=positions).logits
        alone = torch.cat([native(ids[:, :12]).logits, native(ids[:, 12:]).logits], dim=1)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)


def test_whole_native_gpt2_with_loss_compiles_as_one_graph_for_plain_and_packed_rows():
    """Issue 35: graph breaks cost the compiled step on GPU. Plain rows (is_causal) and packed ones (the dense
    document mask) are each one graph with the fused loss; compiled under fullgraph it matches eager."""
    _, native = pair()
    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(3))
    positions = torch.cat([torch.arange(10), torch.arange(14)]).expand(2, 24)

    def step(model, position_ids):
        return model(ids, position_ids=position_ids, labels=ids, loss_chunk_size=16).loss

    for position_ids in (None, positions):
        explained = torch._dynamo.explain(step)(native, position_ids)
        assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
        eager = step(native, position_ids)
        eager_grads = torch.autograd.grad(eager, list(native.parameters()))
        torch._dynamo.reset()
        compiled = torch.compile(native, fullgraph=True, backend="aot_eager")  # dynamo + AOTAutograd, no codegen
        loss = step(compiled, position_ids)
        grads = torch.autograd.grad(loss, list(native.parameters()))
        torch.testing.assert_close(loss, eager)
        for got, want in zip(grads, eager_grads, strict=True):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_to_hf_shares_the_parameters_and_transformers_computes_the_same_logits():
    _, native = pair()
    hf = to_hf(native).eval()
    assert isinstance(hf, GPT2LMHeadModel)
    assert hf.transformer.h[0].attn.c_attn.weight is native.transformer.h[0].attn.c_attn.weight
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, native(ids).logits, atol=1e-5, rtol=1e-5)


def test_configs_the_native_gpt2_cannot_run_say_why():
    assert supports(GPT2Config(**CONFIG)) is None
    assert "dropout" in native_supports(GPT2Config(**{**CONFIG, "resid_pdrop": 0.1}))
    assert "scale_attn_by_inverse_layer_idx" in supports(GPT2Config(**CONFIG, scale_attn_by_inverse_layer_idx=True))
    assert "activation_function" in supports(GPT2Config(**CONFIG, activation_function="relu"))


@pytest.mark.slow
def test_engine_trains_gpt2_with_fsdp_on_two_ranks_and_exports_what_transformers_loads(tmp_path):
    run = run_train(
        tmp_path,
        "gpt2",
        **{
            "model.arch": "gpt2",
            "model.implementation": "native",
            "train.max_steps": 6,
            "ckpt.interval": 3,
            "distributed.nproc_per_node": 2,
            "distributed.strategy": "fsdp",
        },
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "native gpt2 decoder" in run.stdout + run.stderr
    run_dir = tmp_path / "gpt2"
    # a DCP checkpoint of two shards under HF's names (its bytes read, never unpickled)
    assert b"transformer.h.0.attn.c_attn.weight" in (run_dir / "checkpoints" / "step-3" / ".metadata").read_bytes()
    hf = AutoModelForCausalLM.from_pretrained(run_dir / "final").eval()
    assert isinstance(hf, GPT2LMHeadModel)
    native = NativeGPT2(hf.config).eval()
    native.load_state_dict(hf.state_dict(), strict=True)
    ids = torch.randint(0, hf.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(native(ids).logits, hf(ids).logits, atol=1e-5, rtol=1e-5)
