"""GRPO's pieces: advantages, the clipped loss, the prompt order; rollout workers' placement and health."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest
import torch

from prime_train.config.schema import Config, RLConfig
from prime_train.rl.grpo import grpo_loss, token_weights
from prime_train.rl.rollouts import PromptCursor, Sample, group_advantages
from prime_train.rl.train import loss_samples
from prime_train.rl.workers import GpuPlan, InferenceHealthWatcher, gpu_plan, inference_specs


def test_advantages_are_normalised_within_each_group():
    rewards = [1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 0.5]
    adv = group_advantages(rewards, 4)
    assert adv[0] > 0 and all(a < 0 for a in adv[1:4])
    assert abs(sum(adv[:4])) < 1e-6
    assert adv[4:] == [0.0, 0.0, 0.0, 0.0]  # a group that all agree teaches nothing


def test_on_policy_loss_gradient_raises_good_tokens_and_lowers_bad_ones():
    old = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]]))
    new = old.clone().requires_grad_(True)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    loss, kl, clipped = grpo_loss(new, old, mask, adv, clip_eps=0.2)
    loss.backward()
    assert new.grad[0].tolist() == [-1.0, -1.0]  # descending the loss raises these logprobs
    assert new.grad[1].tolist() == [1.0, 0.0]  # and lowers this one; the masked token gets nothing
    assert float(clipped) == 0 and float(kl) == 0


def test_ratio_beyond_the_clip_stops_the_gradient_in_the_advantage_direction():
    old = torch.zeros(1, 1)
    new = torch.full((1, 1), 0.5, requires_grad=True)  # ratio e^0.5 = 1.65 > 1.2
    loss, _, clipped = grpo_loss(new, old, torch.ones(1, 1), torch.tensor([1.0]), clip_eps=0.2)
    loss.backward()
    assert new.grad.item() == 0.0 and float(clipped) == 1.0


def test_kl_penalty_is_zero_at_the_reference_and_positive_away_from_it():
    ref = torch.log(torch.tensor([[0.3, 0.7]]))
    _, kl_same, _ = grpo_loss(ref.clone(), ref.clone(), torch.ones(1, 2), torch.zeros(1), 0.2, ref, kl_coef=0.1)
    _, kl_away, _ = grpo_loss(ref + 0.3, ref + 0.3, torch.ones(1, 2), torch.zeros(1), 0.2, ref, kl_coef=0.1)
    assert float(kl_same) == pytest.approx(0.0, abs=1e-7) and float(kl_away) > 0


def test_without_std_scaling_a_near_tie_weighs_less_than_right_against_wrong():
    near_tie, decisive = [0.60, 0.61], [0.0, 1.0]
    scaled = group_advantages(near_tie + decisive, 2, "group")
    assert scaled[1] == pytest.approx(scaled[3], abs=0.05)  # GRPO: a 0.01 difference is worth as much as 1.0
    unscaled = group_advantages(near_tie + decisive, 2, "none")  # Dr. GRPO: advantages in reward units
    assert unscaled == pytest.approx([-0.005, 0.005, -0.5, 0.5])
    batch = group_advantages(near_tie + decisive, 2, "batch")
    assert batch[3] / batch[1] == pytest.approx(100.0, rel=1e-3)  # one divisor for all: relative weights kept
    with pytest.raises(ValueError, match=r"rl\.scale_rewards"):
        group_advantages([1.0, 0.0], 2, "std")


def test_loss_norms_weigh_tokens_as_grpo_dapo_and_dr_grpo_do():
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])  # a 4-token and a 1-token completion
    token = token_weights(mask, "token", tokens=5, samples=2, max_tokens=8)
    assert token[0, 0] == token[1, 0] == pytest.approx(1 / 5) and float(token.sum()) == pytest.approx(1.0)
    sequence = token_weights(mask, "sequence", tokens=5, samples=2, max_tokens=8)
    assert sequence.sum(-1).tolist() == pytest.approx([0.5, 0.5])  # each completion weighs the same in total
    constant = token_weights(mask, "constant", tokens=5, samples=2, max_tokens=8)
    assert constant[0, 0] == constant[1, 0] == pytest.approx(1 / 16)  # neither length nor token count rescales
    assert float((constant * (1 - mask)).sum()) == 0.0 and float((sequence * (1 - mask)).sum()) == 0.0
    with pytest.raises(ValueError, match=r"rl\.loss_norm"):
        token_weights(mask, "mean", tokens=5, samples=2, max_tokens=8)


def test_clip_higher_lets_an_unlikely_good_token_keep_growing():
    old = torch.zeros(1, 1)
    new = torch.full((1, 1), 0.22, requires_grad=True)  # ratio e^0.22 = 1.25: beyond 1.2, within 1.28
    loss, _, clipped = grpo_loss(new, old, torch.ones(1, 1), torch.tensor([1.0]), clip_eps=0.2, clip_eps_high=0.28)
    loss.backward()
    assert new.grad.item() < 0 and float(clipped) == 0.0
    symmetric = new.detach().clone().requires_grad_(True)
    loss, _, clipped = grpo_loss(symmetric, old, torch.ones(1, 1), torch.tensor([1.0]), clip_eps=0.2)
    loss.backward()
    assert symmetric.grad.item() == 0.0 and float(clipped) == 1.0
    # a bad token whose ratio went up is never clipped: its loss keeps pushing it down
    bad = new.detach().clone().requires_grad_(True)
    _, _, clipped = grpo_loss(bad, old, torch.ones(1, 1), torch.tensor([-1.0]), clip_eps=0.2)
    assert float(clipped) == 0.0


def test_zero_variance_groups_and_truncated_completions_leave_the_loss_when_asked():
    def sample(std: float, truncated: bool) -> Sample:
        return Sample([1], [2], [-0.1], 0.5, truncated=truncated, group_std=std)

    samples = [sample(0.0, False), sample(0.2, False), sample(0.2, True)]
    assert loss_samples(samples, RLConfig()) == samples
    assert loss_samples(samples, RLConfig(drop_zero_variance_groups=True)) == samples[1:]
    assert loss_samples(samples, RLConfig(drop_zero_variance_groups=True, mask_truncated=True)) == samples[1:2]


def test_prompt_cursor_splits_one_order_between_ranks_and_resumes():
    prompts = list(range(10))
    alone = PromptCursor(prompts, seed=3, rank=0, world_size=1)
    ranks = [PromptCursor(prompts, seed=3, rank=r, world_size=2) for r in range(2)]
    for _ in range(3):  # crosses an epoch boundary
        step = alone.take(4)
        parts = [r.take(4) for r in ranks]
        assert sorted(parts[0] + parts[1]) == sorted(step) and not set(parts[0]) & set(parts[1])
    resumed = PromptCursor(prompts, seed=3, rank=0, world_size=1)
    resumed.load_state_dict(alone.state_dict())
    assert resumed.take(5) == alone.take(5)


def test_workers_take_the_first_gpus_and_the_trainer_the_rest():
    cfg = Config.model_validate({"run": {"job": "rl"}, "inference": {"num_workers": 2, "gpus_per_worker": 2}})
    plan = gpu_plan(cfg, [str(i) for i in range(8)])
    assert plan.workers == [["0", "1"], ["2", "3"]] and plan.trainer == ["4", "5", "6", "7"] and not plan.colocated
    specs = inference_specs(cfg, "c.toml", plan)
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["0,1", "2,3"]
    assert specs[1].argv[-4:] == ["--config", "c.toml", "--index", "1"] and specs[1].role == "inference"
    colocated = Config.model_validate({"inference": {"num_workers": 1, "colocate": True}})
    assert gpu_plan(colocated, ["0", "1"]) == GpuPlan(["0", "1"], [["0"]], True)
    assert gpu_plan(cfg, []) == GpuPlan([], [[], []], False)


def test_one_gpu_rl_shares_it_instead_of_failing():
    # on an H100 this was a traceback: "inference needs 1 GPU(s) ... but 1 are visible"
    cfg = Config.model_validate({"run": {"job": "rl"}, "inference": {"num_workers": 1}})
    plan = gpu_plan(cfg, ["0"])
    assert plan.trainer == ["0"] and plan.workers == [["0"]] and plan.colocated
    assert "shares the trainer's GPUs" in plan.note


def test_the_users_gpu_names_are_kept():
    # CUDA_VISIBLE_DEVICES=4,5 must stay physical 4 and 5, never become 0 and 1
    cfg = Config.model_validate({"run": {"job": "rl"}, "inference": {"num_workers": 1}})
    plan = gpu_plan(cfg, ["4", "5"])
    assert plan.workers == [["4"]] and plan.trainer == ["5"]
    uuids = gpu_plan(cfg, ["GPU-aaa", "GPU-bbb", "GPU-ccc"])
    assert uuids.workers == [["GPU-aaa"]] and uuids.trainer == ["GPU-bbb", "GPU-ccc"]


class Health(BaseHTTPRequestHandler):
    state: ClassVar[dict] = {"mode": "ok"}

    def log_message(self, *args):
        pass

    def do_GET(self):
        mode = type(self).state["mode"]
        if mode == "hang":
            threading.Event().wait(2.0)  # wedged: accepts the connection, never answers in time
        code = 200 if mode == "ok" else 503
        self.send_response(code)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")


def test_a_worker_that_stops_answering_health_is_wedged_after_three_misses():
    handler = type("H", (Health,), {"state": {"mode": "ok"}})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        w = InferenceHealthWatcher({"inference-0": url}, timeout_s=0.3)
        assert w.poll().records()[0]["event"] == "inference_healthy"
        handler.state["mode"] = "hang"
        for _ in range(2):
            assert w.poll().records() == []
        events = w.poll().records()
        assert events and events[0]["event"] == "inference_wedged" and "inference-0" in w.wedged
        w.forget("inference-0")
        handler.state["mode"] = "ok"
        assert w.poll().records()[0]["event"] == "inference_healthy"
    finally:
        server.shutdown()


def test_a_worker_still_starting_is_not_wedged():
    w = InferenceHealthWatcher({"inference-0": "http://127.0.0.1:9"}, timeout_s=0.2)
    for _ in range(5):
        assert w.poll().records() == []
    assert not w.wedged
