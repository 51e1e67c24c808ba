"""Continual learning ([continual]): replay mixed into the loader's order, EWC's Fisher and penalty, the previous
data's eval, and a real run that resumes with its EWC anchor."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from enginetools import TINY, WIDE, cli, env, metrics, tiny_llama, tiny_overrides

from prime_train.config.schema import Config, DataConfig, DatasetConfig
from prime_train.engine.continual import ElasticWeights
from prime_train.engine.data import _replay_probs, build_train_loader
from prime_train.engine.evaluate import token_losses
from prime_train.engine.packing import Batch


def test_replay_scales_this_runs_mix_to_1_minus_replay_and_the_previous_datasets_by_size():
    assert _replay_probs(None, [300, 100, 50, 150], 2, 0.2) == pytest.approx([0.6, 0.2, 0.05, 0.15])
    assert _replay_probs([0.5, 0.5], [300, 100, 10], 2, 0.1) == pytest.approx([0.45, 0.45, 0.1])


def test_replay_needs_previous_datasets():
    with pytest.raises(ValueError, match=r"need continual\.previous"):
        Config.model_validate({"continual": {"replay": 0.2}})


def test_the_loader_draws_the_replayed_fraction_of_every_epoch_from_the_previous_data(byte_tokenizer):
    data = DataConfig(datasets=[DatasetConfig(task="reverse-text", num_examples=500)], seq_len=64)
    previous = [DatasetConfig(task="arithmetic", num_examples=500)]
    args = dict(job="sft", micro_batch_size=8, rank=0, world_size=1, seed=3, device=torch.device("cpu"))
    loader = build_train_loader(data, byte_tokenizer, replayed=previous, replay=0.25, **args)
    order = loader._dataset.order
    assert abs(order.quotas[1] - 0.25 * order.length) <= 1  # a quarter of every epoch's sequences
    # and the rows read are arithmetic's (they hold '+') in that proportion over an epoch
    rows = loader._dataset.rows
    seen = [bool((rows.ids[r] == ord("+")).any()) for r in order.rows(0)]
    assert sum(seen) == order.quotas[1]
    plain = build_train_loader(data, byte_tokenizer, replayed=previous, replay=0.0, **args)
    assert len(plain._dataset.order.quotas) == 1  # no replay: the previous data is not read at all


def _batch(seed: int) -> Batch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (2, 12), generator=g)
    return Batch(ids, ids.clone(), torch.arange(12).repeat(2, 1))


class _Batches:
    def __init__(self, seeds):
        self.items = iter([_batch(s) for s in seeds])

    def __next__(self):
        return next(self.items)


def test_fisher_is_the_mean_squared_gradient_and_the_penalty_gradient_is_lambda_f_times_the_drift():
    model = tiny_llama(seed=1).train()
    ewc = ElasticWeights(model, strength=50.0)
    ewc.estimate(model, _Batches([1, 2, 3]), 3, _nothing, torch.device("cpu"))
    assert all(p.grad is None for p in model.parameters())  # the estimate leaves no gradient behind
    assert all(torch.equal(ewc.anchor[n], p) for n, p in model.named_parameters())  # θ* = the weights it saw
    # by hand: the three batches' squared gradients, averaged
    expected = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for s in (1, 2, 3):
        model.zero_grad()
        b = _batch(s)
        loss_sum, count = token_losses(model, b.input_ids, b.position_ids, b.labels)
        (loss_sum / count).backward()
        for n, p in model.named_parameters():
            expected[n] += p.grad.pow(2) / 3
    for n in expected:
        torch.testing.assert_close(ewc.fisher[n], expected[n])
    # move the weights, then the penalty's gradient is λ F (θ - θ*)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    model.zero_grad(set_to_none=False)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    ewc.add_gradient()
    name = "model.layers.0.mlp.up_proj.weight"
    torch.testing.assert_close(ewc.params[name].grad, 50.0 * expected[name] * 0.01)
    penalty = 25.0 * sum(float((expected[n] * 0.01**2).sum()) for n in expected)
    assert float(ewc.local_penalty()) == pytest.approx(penalty, rel=1e-4)


def _nothing():
    import contextlib

    return contextlib.nullcontext()


def run(tmp_path: Path, name: str, *flags: str, **overrides) -> subprocess.CompletedProcess[str]:
    config = tmp_path / "continual.toml"  # the tiny default, then reverse-text as the previous data
    config.write_text(TINY.read_text() + '\n[[continual.previous]]\ntask = "reverse-text"\n')
    argv = cli("train", str(config), *tiny_overrides(tmp_path, name, **overrides), *flags)
    return subprocess.run(argv, env={**env(), **WIDE}, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_a_continual_run_evaluates_the_previous_data_and_resumes_with_its_ewc_anchor(tmp_path, sft_model):
    keys = {
        "model.path": str(sft_model), "data.datasets.0.task": "arithmetic",
        "continual.replay": 0.2, "continual.ewc_lambda": 100.0, "continual.fisher_batches": 2,
        "train.eval_interval": 5, "ckpt.interval": 5, "logging.log_interval": 1,
    }  # fmt: skip
    first = run(tmp_path, "cont", **keys, **{"train.max_steps": 5, "ckpt.resumable_final_save": "true"})
    out = first.stdout + first.stderr
    assert first.returncode == 0, out[-3000:]
    assert out.count("EWC: Fisher information") == 1
    rows = metrics(tmp_path / "cont")
    baseline = next(r for r in rows if r["step"] == 0)
    # the model starts from reverse-text: it knows the previous task (sft_model's exact match is ~0.8)
    assert baseline["eval_previous_exact_match"] > 0.5 and "eval_previous_loss" in baseline
    assert all(r["ewc_penalty"] > 0 for r in rows if r["step"] > 0)  # after each step: the weights left the anchor
    # trained on: the anchor comes back from the checkpoint, not from an estimate at step 5's weights
    more = run(tmp_path, "cont", "--resume", **keys, **{"train.max_steps": 8})
    out = more.stdout + more.stderr
    assert more.returncode == 0, out[-3000:]
    assert "resumed from" in out and "EWC: Fisher information" not in out


@pytest.mark.slow
def test_ewc_penalty_under_tensor_parallel_is_the_whole_models_as_in_one_process(tmp_path):
    # the column/row-parallel weights are cut in two and the norms replicated: the penalty sums the cuts and counts
    # each norm once (each rank used to report its own half)
    keys = {"continual.ewc_lambda": 1000.0, "continual.fisher_batches": 2, "train.max_steps": 3, "ckpt.interval": 3,
            "logging.log_interval": 1}  # fmt: skip
    penalties = {}
    for name, extra in (("one", {}), ("tp2", {"distributed.nproc_per_node": 2, "distributed.tp_size": 2})):
        result = run(tmp_path, name, **keys, **extra)
        assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
        penalties[name] = {r["step"]: r["ewc_penalty"] for r in metrics(tmp_path / name) if "ewc_penalty" in r}
    assert sorted(penalties["one"]) == sorted(penalties["tp2"]) == [1, 2, 3]
    for step, value in penalties["one"].items():
        assert value > 0
        # the drift from the anchor is a difference of nearly equal weights: its rounding differs at ~1e-4 relative
        assert penalties["tp2"][step] == pytest.approx(value, rel=1e-2), (step, penalties)
