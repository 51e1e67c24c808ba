"""transformers' models given the native decoders' chunked head (engine/hf_head.py)."""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM

from prime_train.engine import loss as fused_loss
from prime_train.engine.hf_head import (
    FUSED_MODEL_TYPES,
    ROUTED_MODEL_TYPES,
    fusable,
    fuse_head,
    has_fused_head,
    set_router_loss,
)

VOCAB = 101
SHAPE = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=8, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    tie_word_embeddings=False,
)  # fmt: skip


# the MoE families' experts, small
MOE = dict(num_local_experts=4, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
           shared_expert_intermediate_size=16)  # fmt: skip


def _model(model_type: str, seed: int = 0, **overrides):
    moe = MOE if model_type in ("mixtral", "qwen2_moe", "qwen3_moe") else {}
    config = AutoConfig.for_model(model_type, **{**SHAPE, **moe, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    return model.train()


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _batch(seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, 21), generator=generator)
    labels = ids.clone()
    labels[0, :7] = -100  # a prompt without loss
    return ids, labels, generator


# each listed family as transformers configures it, and the soft-capping ones with a cap their tiny logits reach
# (Gemma 2's default 30 is far above them: tanh would be the identity)
CASES = [(t, {}) for t in FUSED_MODEL_TYPES] + [
    ("gemma2", {"final_logit_softcapping": 0.1}), ("gemma3_text", {"final_logit_softcapping": 0.1}),
    ("granite", {"logits_scaling": 8.0}), ("cohere", {"logit_scale": 3.0}),
]  # fmt: skip
_CASE_IDS = [f"{t}{'-capped' if 'final_logit_softcapping' in o else '-scaled' if o else ''}" for t, o in CASES]


@pytest.mark.parametrize(("model_type", "overrides"), CASES, ids=_CASE_IDS)
def test_the_fused_head_gives_transformers_loss_log_probs_and_gradients_without_the_whole_logits(
    model_type, overrides, monkeypatch
):
    plain = _model(model_type, **overrides)
    assert fusable(plain) is None, fusable(plain)
    model = copy.deepcopy(plain)
    assert fuse_head(model) and has_fused_head(model) and not has_fused_head(plain)
    ids, labels, generator = _batch()

    # without labels: transformers' own forward, its logits
    torch.testing.assert_close(model(input_ids=ids).logits, plain(input_ids=ids).logits)

    # the loss: transformers' logits shifted, F.cross_entropy over labelled tokens
    logits = plain(input_ids=ids).logits
    want = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100)
    want.backward()
    want_grads = _grads(plain)
    out = model(input_ids=ids, labels=labels)
    assert out.logits is None
    out.loss.backward()
    torch.testing.assert_close(out.loss, want)
    got_grads = _grads(model)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, msg=lambda m, name=name: f"{name}: {m}")

    # each token's log-prob at temperature 0.7 and its entropy, under a different upstream gradient per token
    plain.zero_grad(set_to_none=True)
    model.zero_grad(set_to_none=True)
    upstream = torch.randn(2, 20, generator=generator)
    all_logp = torch.log_softmax(plain(input_ids=ids).logits[:, :-1].float() / 0.7, -1)
    target = labels[:, 1:]
    want_logp = torch.where(target != -100, all_logp.gather(-1, target.clamp(min=0)[..., None])[..., 0], 0.0)
    (want_logp * upstream).sum().backward()
    want_grads = _grads(plain)
    out = model(input_ids=ids, labels=labels, token_log_probs=True, temperature=0.7, return_entropy=True)
    (out.log_probs[:, :-1] * upstream).sum().backward()
    torch.testing.assert_close(out.log_probs[:, :-1], want_logp)
    torch.testing.assert_close(out.entropy[:, :-1], -(all_logp.exp() * all_logp).sum(-1).detach())
    got_grads = _grads(model)
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, msg=lambda m, name=name: f"{name}: {m}")

    # and it never held the whole logits: each projection of lm_head's weight is one chunk of tokens
    seen = []
    real = fused_loss._chunk_target_log_probs
    monkeypatch.setattr(
        fused_loss, "_chunk_target_log_probs", lambda h, w, *a: seen.append(h.shape[0]) or real(h, w, *a)
    )
    model(input_ids=ids, labels=labels, loss_chunk_size=8).loss.backward()
    assert seen == [8, 8, 8, 8, 8, 2]


def test_a_deep_copy_keeps_the_fused_head_bound_to_itself():
    # DPO's frozen reference is a deep copy of the starting model: its forward must run its own weights
    from prime_train.engine.model import chunked_head

    model = _model("llama")
    assert not chunked_head(model)
    fuse_head(model)
    assert chunked_head(model) and chunked_head(torch.compile(model))  # the engine's callers look through wrappers
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1)
    ids, labels, _ = _batch()
    assert has_fused_head(reference)
    with torch.no_grad():
        want = F.cross_entropy(
            reference(input_ids=ids).logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100
        )
        torch.testing.assert_close(reference(input_ids=ids, labels=labels).loss, want)
        assert not torch.allclose(model(input_ids=ids, labels=labels).loss, want)


@pytest.mark.parametrize(
    ("model_type", "overrides", "why"),
    [
        ("gpt_neox", {}, "not one the chunked loss is checked against"),
    ],
)
def test_heads_that_do_more_than_a_linear_projection_keep_transformers_forward(model_type, overrides, why):
    model = _model(model_type, **overrides)
    forward = model.forward
    assert why in fusable(model)
    assert not fuse_head(model) and not has_fused_head(model) and model.forward == forward


def test_a_listed_family_with_a_biased_head_is_not_fused_and_one_with_router_logits_on_is():
    assert fusable(_model("mixtral", output_router_logits=True)) is None  # the fused forward adds the router loss
    model = _model("llama")
    model.lm_head = torch.nn.Linear(32, VOCAB, bias=True)
    assert "without bias" in fusable(model)


def test_the_engines_loss_and_log_prob_callers_take_the_fused_head_and_get_transformers_values():
    """What the SFT step, the eval, DPO and GRPO/PPO call, on transformers' Gemma 3 with and without the head."""
    from prime_train.engine.evaluate import row_losses, token_losses
    from prime_train.engine.preference import PairBatch, sequence_logprobs
    from prime_train.rl.grpo import score_completions
    from prime_train.rl.ppo import ValueHead
    from prime_train.rl.rollouts import Sample

    plain = _model("gemma3_text")
    model = copy.deepcopy(plain)
    fuse_head(model)
    ids, labels, _ = _batch()
    positions = torch.arange(ids.shape[1]).expand_as(ids)
    head = ValueHead(32)
    torch.nn.init.normal_(head.proj.weight)

    def run(m):
        m.zero_grad(set_to_none=True)
        head.zero_grad(set_to_none=True)
        values = []
        total, count = token_losses(m, ids, positions, labels)
        values += [total, count]
        total, rows = row_losses(m, ids, positions, labels)
        values += [total, rows]
        pairs = PairBatch(ids, labels, positions, torch.zeros_like(ids, dtype=torch.bool))
        values += list(sequence_logprobs(m, pairs, contextlib.nullcontext))
        samples = [Sample([5, 6, 7], [8, 9], [0.0] * 2, 1.0), Sample([5, 6], [10, 11, 12], [0.0] * 3, 0.0)]
        scores = score_completions(m, samples, "cpu", 0.7, 0, entropy=True, value_head=head)
        values += [scores.logp, scores.entropy, scores.values]
        sum(v.float().sum() * (i + 1) for i, v in enumerate(values) if v.requires_grad).backward()
        return [v.detach() for v in values], _grads(m), head.proj.weight.grad.clone()

    got, want = run(model), run(plain)
    for a, b in zip(got[0], want[0], strict=True):
        torch.testing.assert_close(a, b)
    # six losses summed with weights up to 10: fp32 sums in another order, 1e-4 apart at most
    assert got[1].keys() == want[1].keys()
    for name, grad in want[1].items():
        torch.testing.assert_close(got[1][name], grad, rtol=1e-4, atol=1e-4, msg=lambda m, name=name: f"{name}: {m}")
    torch.testing.assert_close(got[2], want[2], rtol=1e-4, atol=1e-4)


def test_an_sft_run_of_a_saved_gemma3_model_trains_through_the_fused_head(tmp_path):
    """A transformers model the native decoder does not cover, loaded from model.path by the real engine."""
    import json

    from enginetools import run_train

    result = run_train(
        tmp_path, "gemma", timeout=300, **{"model.path": _saved(tmp_path, "gemma3_text"), "train.max_steps": 8,
                                           "ckpt.interval": 1000, "logging.log_interval": 1}
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Gemma3ForCausalLM takes its loss and log-probs one chunk of logits at a time" in result.stdout
    losses = [row["loss"] for row in map(json.loads, (tmp_path / "gemma" / "metrics.jsonl").read_text().splitlines())
              if "loss" in row]  # fmt: skip
    assert len(losses) == 8 and all(map(torch.isfinite, torch.tensor(losses))) and losses[-1] < losses[0]


def test_gemma2_from_a_path_names_the_attention_key_under_sdpa_and_trains_fused_under_eager(tmp_path):
    """transformers refuses SDPA for Gemma 2 (its attention logits are soft-capped too): the engine's error names
    the key to change, and with it changed the model takes the chunked head with its final-logit cap."""
    from prime_train.config.schema import ModelConfig
    from prime_train.engine.metrics import EngineConfigError
    from prime_train.engine.model import build_model

    _model("gemma2").save_pretrained(tmp_path / "gemma2")
    with pytest.raises(EngineConfigError, match=r"set model\.attn_implementation = 'eager'"):
        build_model(ModelConfig(path=str(tmp_path / "gemma2")), VOCAB, for_training=True)
    model = build_model(ModelConfig(path=str(tmp_path / "gemma2"), attn_implementation="eager"), VOCAB,
                        for_training=True)  # fmt: skip
    assert has_fused_head(model) and model.config.final_logit_softcapping == 30.0


@pytest.mark.parametrize("model_type", ROUTED_MODEL_TYPES)
def test_an_moe_router_loss_joins_the_fused_loss_as_transformers_adds_it(model_type):
    """transformers adds coef x load_balancing_loss_func to its loss under output_router_logits: the fused forward
    given the weight adds the same term, with its gradient into the routers, in training mode and to the loss only."""
    plain = _model(model_type, router_aux_loss_coef=0.3)
    model = copy.deepcopy(plain)
    assert fuse_head(model)
    unweighted = copy.deepcopy(model)
    set_router_loss(model, 0.3)
    ids, labels, _ = _batch()

    want = plain(input_ids=ids, labels=labels, output_router_logits=True)
    want.loss.backward()
    want_grads = _grads(plain)
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    torch.testing.assert_close(out.loss, want.loss)
    torch.testing.assert_close(out.router_loss, 0.3 * want.aux_loss.detach())
    got_grads = _grads(model)
    assert got_grads.keys() == want_grads.keys()
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, msg=lambda m, name=name: f"{name}: {m}")
    # the router's term moves the routers: without it their gradients differ
    plain_out = unweighted(input_ids=ids, labels=labels)
    assert plain_out.router_loss is None
    plain_out.loss.backward()
    routers = [n for n in want_grads if "gate.weight" in n and "proj" not in n and "shared" not in n]
    assert routers and not any(torch.allclose(_grads(unweighted)[n], want_grads[n]) for n in routers)

    # summed over tokens (the engine's reduction): the term weighs as many tokens as the loss sums
    labelled = int((labels[:, 1:] != -100).sum())
    summed = model(input_ids=ids, labels=labels, loss_reduction="sum")
    torch.testing.assert_close(summed.loss, want.loss.detach() * labelled)
    torch.testing.assert_close(summed.router_loss, 0.3 * want.aux_loss.detach() * labelled)
    halves = model(input_ids=ids, labels=labels, num_items_in_batch=2 * labelled)
    torch.testing.assert_close(halves.loss, want.loss.detach() / 2)

    # log-probs (DPO's) have no loss to take it: the term comes back with its gradient for the caller's objective;
    # a forward without gradients (a reference's) and evaluation take none
    log_probs = model(input_ids=ids, labels=labels, token_log_probs=True)
    torch.testing.assert_close(log_probs.router_loss.detach(), 0.3 * want.aux_loss.detach())
    assert log_probs.router_loss.requires_grad
    with torch.no_grad():
        assert model(input_ids=ids, labels=labels, token_log_probs=True).router_loss is None
    model.eval()
    evaluated = model(input_ids=ids, labels=labels)
    assert evaluated.router_loss is None
    torch.testing.assert_close(evaluated.loss, want.loss.detach() - 0.3 * want.aux_loss.detach())


def test_the_router_loss_is_refused_where_the_forward_would_not_add_it():
    with pytest.raises(ValueError, match="no router loss"):
        set_router_loss(_model("qwen3_moe"), 0.1)  # not fused
    model = _model("llama")
    fuse_head(model)
    with pytest.raises(ValueError, match="no router loss"):
        set_router_loss(model, 0.1)


def _saved(tmp_path, model_type="qwen3_moe", **config) -> str:
    """A tiny `model_type` saved for model.path, in the byte tokenizer's vocabulary (the engine's without one)."""
    from prime_train.engine.tokenizer import build_byte_tokenizer, padded_vocab_size

    vocab = padded_vocab_size(build_byte_tokenizer(), 64)
    moe = MOE if model_type in ROUTED_MODEL_TYPES else {}
    shape = {**SHAPE, **moe, "vocab_size": vocab, "max_position_embeddings": 512, **config}
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **shape)).save_pretrained(tmp_path / model_type)
    build_byte_tokenizer().save_pretrained(tmp_path / model_type)
    return str(tmp_path / model_type)


def test_an_sft_run_of_a_saved_moe_trains_with_its_router_loss_and_logs_it_apart(tmp_path):
    """The engine's step: the router's term joins each micro-batch's loss and is logged apart, normalised over the
    global batch's tokens as the loss is, so two DDP ranks log what one process accumulating over two micro-batches
    does (the two ranks also recompute their layers under activation checkpointing: the router logits transformers
    records in the forward are the ones the loss takes)."""
    import json

    from enginetools import run_train

    path = _saved(tmp_path)
    common = {"model.path": path, "model.router_aux_loss_coef": 0.5, "train.max_steps": 3, "ckpt.interval": 1000,
              "logging.log_interval": 1, "train.micro_batch_size": 8, "train.global_batch_size": 16}  # fmt: skip
    rows = {}
    two = {"distributed.nproc_per_node": 2, "model.activation_checkpointing": "full"}
    for name, extra in (("one", {}), ("two", two)):
        result = run_train(tmp_path, name, timeout=300, **common, **extra)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "load-balancing loss joins the loss with weight 0.5 (model.router_aux_loss_coef = 0.5)" in result.stdout
        assert " router " in result.stdout
        rows[name] = [row for row in map(json.loads, (tmp_path / name / "metrics.jsonl").read_text().splitlines())
                      if "loss" in row]  # fmt: skip
    assert len(rows["one"]) == len(rows["two"]) == 3
    for one, two in zip(rows["one"], rows["two"], strict=True):
        assert math.isclose(one["loss"], two["loss"], rel_tol=1e-4), (one, two)
        assert math.isclose(one["router_loss"], two["router_loss"], rel_tol=1e-4), (one, two)
        # coef x aux, with aux = experts x sum(share of assignments x mean router probability): top_k when balanced
        # (2 here), up to experts x top_k; the tokens' loss is logged without it (about ln(vocab) at the start)
        assert 0.5 * 1 < one["router_loss"] < 0.5 * 4 * 2, one
    assert abs(rows["one"][0]["loss"] - math.log(AutoConfig.from_pretrained(path).vocab_size)) < 0.3


def test_a_dpo_run_of_a_saved_moe_adds_the_router_loss_to_its_objective_and_logs_it_apart(tmp_path):
    """DPO has no token loss: the policy's log-prob forward hands back coef x aux and the step adds it, weighted by
    the micro-batch's pairs; the logged DPO loss is the pairs' alone (ln 2 at the first step, the policy being the
    reference)."""
    import json

    from enginetools import run_train

    result = run_train(
        tmp_path, "dpo", timeout=300, **{"run.job": "dpo", "model.path": _saved(tmp_path),
                                         "model.router_aux_loss_coef": 0.5, "train.max_steps": 3,
                                         "ckpt.interval": 1000, "logging.log_interval": 1,
                                         "data.datasets.0.num_examples": 400}
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert " router " in result.stdout
    rows = [row for row in map(json.loads, (tmp_path / "dpo" / "metrics.jsonl").read_text().splitlines())
            if "loss" in row]  # fmt: skip
    assert len(rows) == 3 and all(0.5 * 1 < row["router_loss"] < 0.5 * 4 * 2 for row in rows), rows
    assert math.isclose(rows[0]["loss"], math.log(2), rel_tol=1e-4), rows[0]


def test_the_router_loss_follows_the_key_then_config_json_and_refuses_what_it_cannot_apply(tmp_path, caplog):
    from prime_train.config.schema import Config
    from prime_train.engine.hf_head import _ROUTER
    from prime_train.engine.metrics import EngineConfigError
    from prime_train.engine.model import load_model_and_tokenizer

    on = _saved(tmp_path, output_router_logits=True, router_aux_loss_coef=0.02)

    def weight(job="sft", path=on, **model):
        cfg = Config.model_validate({"run": {"job": job}, "model": {"path": path, **model}})
        return getattr(load_model_and_tokenizer(cfg)[1], _ROUTER, None)

    assert weight() == 0.02  # config.json's output_router_logits and weight
    assert weight(router_aux_loss_coef=0.5) == 0.5
    assert weight(router_aux_loss_coef=0) is None
    assert weight("pretrain") == weight("dpo") == weight("rl") == 0.02
    with caplog.at_level("WARNING"):
        assert weight("reward") is None
    assert "not added: the reward job's objective does not take it" in caplog.text
    with pytest.raises(EngineConfigError, match=r"model.router_aux_loss_coef = 0.5: the reward job's objective"):
        weight("reward", router_aux_loss_coef=0.5)
    with pytest.raises(EngineConfigError, match=r"'llama' is not an MoE whose router loss the engine adds"):
        weight(path=_saved(tmp_path, "llama"), router_aux_loss_coef=0.5)


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_an_rl_run_of_a_saved_moe_adds_the_router_loss_to_its_objective_and_logs_it_apart(tmp_path, algorithm):
    """RL's policy forward returns log-probs: the step adds coef x aux weighted by the chunk's share of the samples,
    and logs it apart from the policy loss (PPO's value head reads the same forward's hidden states). The embedded
    worker loads the MoE's published weights, whose experts transformers saves one tensor each and runs fused."""
    import json
    import subprocess

    from enginetools import TINY_RL, cli, env, free_port

    args = {"run.output_dir": str(tmp_path), "run.name": "rl", "model.path": _saved(tmp_path),
            "model.router_aux_loss_coef": 0.5, "inference.base_port": free_port(), "logging.tensorboard": "false",
            "supervisor.poll_interval_s": 0.5, "train.max_steps": 2, "rl.prompts_per_step": 4, "rl.group_size": 4,
            "train.global_batch_size": 16, "rl.eval_prompts": 4, "train.eval_interval": 1000,
            "ckpt.interval": 1000, "logging.log_interval": 1,
            # the random model scores every group alike and runs to the token limit: learn from every sample anyway
            "rl.drop_zero_variance_groups": "false", "rl.mask_truncated": "false",
            "rl.algorithm": algorithm}  # fmt: skip
    argv = cli("run", str(TINY_RL), *[part for key, value in args.items() for part in (f"--{key}", str(value))])
    result = subprocess.run(argv, env=env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [row for row in map(json.loads, (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines())
            if "reward" in row]  # fmt: skip
    assert len(rows) == 2 and all(0.5 * 1 < row["router_loss"] < 0.5 * 4 * 2 for row in rows), rows
    # the worker served the trainer's weights: its log-probs of its samples are the trainer's
    assert all(row["logprob_mismatch"] < 1e-4 for row in rows), rows
    assert " router " in (tmp_path / "rl" / "logs" / "attempt-1" / "trainer.log").read_text()
