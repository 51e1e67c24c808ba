"""PPO (rl.algorithm = "ppo"): GAE, the clipped value loss, the value head on the shared trunk, its lint rules, a run
that learns on the CPU, and kill -9 and resume with the value head restored."""

from __future__ import annotations

import re
import subprocess

import psutil
import pytest
import torch
from enginetools import TINY_RL, cli, env, kill_group, metrics, start, tiny_llama, wait_for
from test_rl import rl_args

from prime_train.config.schema import Config
from prime_train.contract import read_json
from prime_train.engine import safe_dcp
from prime_train.kit.events import read_events
from prime_train.rl.budget import check_algorithm
from prime_train.rl.grpo import grpo_loss, score_completions
from prime_train.rl.ppo import ValueHead, clipped_value_loss, explained_variance_from_sums, gae, whiten
from prime_train.rl.rollouts import Sample

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


# ---------------------------------------------------------------- GAE


def test_gae_matches_a_hand_computed_example_with_values():
    # row 0: three tokens, reward 1 on the last; row 1: one token (the rest is padding, whatever its values)
    values = torch.tensor([[0.2, 0.5, 0.4], [0.3, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    adv, ret = gae(values, mask, torch.tensor([1.0, 0.5]), gamma=0.9, lam=0.5)
    # delta_2 = 1 - 0.4 = 0.6; delta_1 = 0.9 * 0.4 - 0.5 = -0.14; delta_0 = 0.9 * 0.5 - 0.2 = 0.25
    # A_2 = 0.6; A_1 = -0.14 + 0.45 * 0.6 = 0.13; A_0 = 0.25 + 0.45 * 0.13 = 0.3085
    assert adv[0].tolist() == pytest.approx([0.3085, 0.13, 0.6])
    assert ret[0].tolist() == pytest.approx([0.5085, 0.63, 1.0])
    # a one-token episode: A = r - V, and nothing off the mask
    assert adv[1].tolist() == pytest.approx([0.2, 0.0, 0.0]) and ret[1].tolist() == pytest.approx([0.5, 0.0, 0.0])


def test_gae_without_values_discounts_the_reward_back_by_gamma_lambda():
    mask = torch.ones(1, 3)
    adv, ret = gae(torch.zeros(1, 3), mask, torch.tensor([1.0]), gamma=0.9, lam=0.5)
    assert adv[0].tolist() == pytest.approx([0.45**2, 0.45, 1.0])  # (gamma lambda)^(n-1-t) R
    assert ret[0].tolist() == pytest.approx(adv[0].tolist())  # V = 0: the returns are the advantages
    # gamma = lambda = 1 with values: Monte Carlo, A_t = R - V_t
    mc, _ = gae(torch.tensor([[0.2, 0.5, 0.4]]), mask, torch.tensor([1.0]), gamma=1.0, lam=1.0)
    assert mc[0].tolist() == pytest.approx([0.8, 0.5, 0.6])
    # lambda = 0: one-step TD, A_t = r_t + gamma V_{t+1} - V_t
    td, _ = gae(torch.tensor([[0.2, 0.5, 0.4]]), mask, torch.tensor([1.0]), gamma=0.9, lam=0.0)
    assert td[0].tolist() == pytest.approx([0.25, -0.14, 0.6])


def test_whitening_uses_the_whole_batchs_sums_and_leaves_padding_at_zero():
    x = torch.tensor([[1.0, 3.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    out = whiten(x, mask, torch.tensor(4.0), torch.tensor(10.0), torch.tensor(2.0))  # mean 2, std 1
    assert out[0].tolist() == pytest.approx([-1.0, 1.0, 0.0])


def test_explained_variance_is_one_for_perfect_values_and_zero_for_the_mean():
    returns = torch.tensor([0.0, 1.0, 1.0, 0.0])

    def ev(values):
        d = returns - values
        return float(explained_variance_from_sums(torch.stack([
            torch.tensor(4.0), returns.sum(), (returns**2).sum(), d.sum(), (d**2).sum()
        ])))  # fmt: skip

    assert ev(returns) == pytest.approx(1.0)
    assert ev(torch.full((4,), 0.5)) == pytest.approx(0.0)
    assert ev(1 - returns) < 0  # worse than the mean


# ---------------------------------------------------------------- the value loss


def test_value_loss_clipping_stops_a_value_that_moved_past_the_clip_towards_its_return():
    old, ret, mask = torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1)
    # moved from 0 to 0.5 towards R = 1, beyond the clip 0.2: the clipped term (0.2 - 1)^2 is the larger, no gradient
    v = torch.full((1, 1), 0.5, requires_grad=True)
    loss, clipped = clipped_value_loss(v, old, ret, mask, clip=0.2)
    loss.sum().backward()
    assert float(loss.detach()) == pytest.approx(0.5 * 0.8**2) and float(clipped) == 1.0 and v.grad.item() == 0.0
    # moved away from R beyond the clip: the unclipped term is the larger and pulls it back
    away = torch.full((1, 1), -0.5, requires_grad=True)
    loss, clipped = clipped_value_loss(away, old, ret, mask, clip=0.2)
    loss.sum().backward()
    assert float(loss.detach()) == pytest.approx(0.5 * 1.5**2) and float(clipped) == 0.0 and away.grad.item() == -1.5
    # within the clip both terms agree: 0.5 (V - R)^2
    near = torch.full((1, 1), 0.1, requires_grad=True)
    loss, _ = clipped_value_loss(near, old, ret, mask, clip=0.2)
    loss.sum().backward()
    assert float(loss.detach()) == pytest.approx(0.5 * 0.81) and near.grad.item() == pytest.approx(-0.9)
    # rl.value_clip unset: no clip at all; padding weighs nothing
    free, _ = clipped_value_loss(
        torch.tensor([[0.5, 3.0]]), torch.zeros(1, 2), torch.ones(1, 2), torch.tensor([[1.0, 0.0]]), None
    )
    assert free[0].tolist() == pytest.approx([0.125, 0.0])


def test_token_advantages_go_through_the_same_clipped_ratio_loss():
    old = torch.zeros(1, 2)
    new = torch.zeros(1, 2, requires_grad=True)
    loss, _, _ = grpo_loss(new, old, torch.ones(1, 2), torch.tensor([[1.0, -2.0]]), clip_eps=0.2)
    loss.backward()
    assert new.grad.tolist() == [[-1.0, 2.0]]  # each token pushed by its own advantage


# ---------------------------------------------------------------- the value head on the policy's trunk


def test_value_head_reads_the_policys_final_hidden_states_in_the_same_forward():
    model = tiny_llama(0)
    head = ValueHead(32)
    torch.nn.init.normal_(head.proj.weight)
    samples = [Sample([1, 2, 3], [4, 5], [0.0, 0.0], 1.0), Sample([1, 2], [6, 7, 8], [0.0] * 3, 0.0)]
    scores = score_completions(model, samples, "cpu", 1.0, 0, value_head=head)
    assert scores.values.shape == scores.logp.shape == (2, 3)
    # token t's value is read where token t is predicted: the position before it
    hidden = model.model(input_ids=torch.tensor([[1, 2, 3, 4, 5]])).last_hidden_state
    expected = head(hidden)[0, 2:4]
    assert torch.allclose(scores.values[0, :2], expected, atol=1e-6)
    assert float(scores.values[0, 2].detach()) == 0.0  # padding
    # one trunk: the value's gradient reaches the policy's weights
    scores.values.sum().backward()
    assert model.model.layers[0].mlp.up_proj.weight.grad.abs().sum() > 0
    assert float(ValueHead(32)(hidden).detach().abs().sum()) == 0.0  # a fresh head says 0 everywhere


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_native_policy_scores_completions_in_chunks_as_transformers_does_with_whole_logits(temperature):
    # the native decoder gives log-probs, entropy and the value head's hidden states from its chunked path
    # (engine/loss.py); transformers' model from whole logits and a hook on lm_head: the same numbers and gradients
    from prime_train.engine.llama import NativeCausalLM

    hf = tiny_llama(0)
    native = NativeCausalLM(hf.config)
    native.load_state_dict(hf.state_dict())
    samples = [Sample([1, 2, 3], [4, 5], [0.0, 0.0], 1.0), Sample([1, 2], [6, 7, 8], [0.0] * 3, 0.0)]
    results = []
    for model in (hf, native):
        head = ValueHead(32)
        torch.nn.init.normal_(head.proj.weight, generator=torch.Generator().manual_seed(0))
        scores = score_completions(model, samples, "cpu", temperature, 0, entropy=True, value_head=head)
        weights = torch.tensor([[1.0, -2.0, 0.0], [0.5, 1.5, -1.0]])
        ((scores.logp * weights).sum() + scores.values.sum()).backward()
        grads = {n: p.grad for n, p in model.named_parameters()}
        results.append((scores, grads))
    (want, want_grads), (got, got_grads) = results
    for field in ("logp", "mask", "entropy", "values"):
        torch.testing.assert_close(getattr(got, field), getattr(want, field), atol=1e-5, rtol=1e-4, msg=field)
    assert not got.entropy.requires_grad
    for name, grad in got_grads.items():
        torch.testing.assert_close(grad, want_grads[name], atol=1e-5, rtol=1e-4, msg=name)


# ---------------------------------------------------------------- lint


def test_group_size_one_is_refused_for_grpo_naming_the_key_and_allowed_for_ppo():
    grpo = Config.model_validate({"run": {"job": "rl"}, "rl": {"group_size": 1}})
    [(severity, message, key)] = check_algorithm(grpo)
    assert severity == "error" and key == "rl.group_size" and "rl.group_size = 1" in message and "ppo" in message
    ppo = Config.model_validate({"run": {"job": "rl"}, "rl": {"group_size": 1, "algorithm": "ppo"}})
    assert check_algorithm(ppo) == []
    # GRPO's keys that PPO does not use are said to do nothing
    grpo_keys = {"algorithm": "ppo", "drop_zero_variance_groups": True, "scale_rewards": "none"}
    ignored = check_algorithm(Config.model_validate({"run": {"job": "rl"}, "rl": grpo_keys}))
    assert [(s, k) for s, _, k in ignored] == [
        ("warning", "rl.drop_zero_variance_groups"), ("warning", "rl.scale_rewards")
    ]  # fmt: skip


def test_lint_refuses_a_grpo_group_of_one_with_file_and_line(tmp_path):
    config = tmp_path / "rl.toml"
    config.write_text('[run]\njob = "rl"\n\n[rl]\ngroup_size = 1\n')
    result = subprocess.run(cli("lint", str(config)), env=env(), capture_output=True, text=True, timeout=120)
    said = result.stdout + result.stderr
    assert result.returncode != 0 and "rl.group_size" in said and f"{config.name}:5" in said, said
    ppo = tmp_path / "ppo.toml"
    ppo.write_text('[run]\njob = "rl"\n\n[rl]\nalgorithm = "ppo"\ngroup_size = 1\n')
    result = subprocess.run(cli("lint", str(ppo)), env=env(), capture_output=True, text=True, timeout=120)
    assert "group_size" not in result.stdout + result.stderr, result.stdout + result.stderr


# ---------------------------------------------------------------- PPO on the CPU


def value_head_of(checkpoint) -> dict[str, torch.Tensor]:
    """The value head a checkpoint holds (the tiny model's hidden size is 128)."""
    sd = {"value_head": {"proj.weight": torch.zeros(1, 128), "proj.bias": torch.zeros(1)}}
    safe_dcp.load(sd, checkpoint, no_dist=True)
    return sd["value_head"]


@pytest.fixture(scope="module")
def ppo_run(tmp_path_factory, half_trained_sft_model):
    """configs/tiny-rl.toml with rl.algorithm = "ppo", from the 60-step SFT model, run once for the tests below."""
    out = tmp_path_factory.mktemp("ppo")
    result = subprocess.run(
        cli("run", str(TINY_RL), *rl_args(out, half_trained_sft_model, "ppo", **{"rl.algorithm": "ppo"})),
        env=env(), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    rows = {r["step"]: r for r in metrics(out / "ppo") if "reward" in r}
    assert sorted(rows) == list(range(1, 41))
    return result, out / "ppo", rows


@pytest.mark.slow
def test_a_ppo_run_shows_its_reward_live_logs_its_value_and_exports_the_policy_alone(ppo_run):
    result, run_dir, rows = ppo_run
    # the live view: once the first logging step (5) is read, every status line shows the reward and the loss,
    # those of the rollout wait and of the training after it alike (issue 33, item 12)
    live = [m for m in re.finditer(r"^attempt 1 \| step (\d+)/40 \|.*$", result.stdout + result.stderr, re.M)]
    later = [m.group(0) for m in live if int(m.group(1)) > 5]
    assert later and all("| reward " in line and "| loss " in line for line in later), later
    for key in ("value_loss", "explained_variance", "kl", "clip_fraction", "value_mean"):
        assert all(key in rows[s] for s in rows), key
    # the value head learnt the reward's level (it starts at 0)
    assert rows[40]["value_mean"] > 0.1, rows[40]["value_mean"]
    # the value head lives in the checkpoint, never in the exported model
    from safetensors import safe_open

    for f in (run_dir / "final").glob("*.safetensors"):
        with safe_open(str(f), "pt") as sf:
            assert not [k for k in sf.keys() if "value" in k]  # noqa: SIM118 (safe_open has no __iter__)


@pytest.mark.slow
def test_ppo_raises_the_reward_of_a_half_trained_model(ppo_run):
    """Issue 29's bar, +0.1 sampled reward (first 10 steps against the last 10), at PPO's default rl.gae_lambda of 1.
    Ten seeds gave +0.101 to +0.227 here (README's PPO section); at 0.95 this seed once gave +0.076 and seed 2
    -0.196, a policy that stopped ending its answers."""
    _, _, rows = ppo_run
    first = sum(rows[s]["reward"] for s in range(1, 11)) / 10
    last = sum(rows[s]["reward"] for s in range(31, 41)) / 10
    ev = rows[40]["explained_variance"]
    print(f"\nPPO sampled reward {first:.3f} -> {last:.3f}; explained variance at the end {ev:.3f}")
    assert last >= first + 0.1, (first, last)


def past_export(beat: dict, step: int) -> bool:
    return (beat.get("step") or 0) >= step and beat.get("phase") in ("step", "rollout_wait")


@pytest.mark.slow
def test_kill_9_of_a_ppo_trainer_resumes_with_its_value_head(tmp_path, sft_model):
    """The PPO trainer killed after a checkpoint: the resumed attempt loads the value head and its optimizer with
    the policy, so the lost steps replay bit for bit (values feed the advantages and the loss: a fresh head would
    change every figure from the first replayed step)."""
    steps = {
        "rl.algorithm": "ppo", "train.max_steps": 8, "ckpt.interval": 4, "ckpt.keep_last": 3,
        "ckpt.resumable_final_save": "true",
        "rl.max_async_level": 0, "rl.eval_prompts": 0, "rl.prompts_per_step": 16, "rl.group_size": 4,
        "train.global_batch_size": 64, "rl.optimizer_steps": 2, "supervisor.backoff_initial_s": 0.5,
    }  # fmt: skip
    straight = subprocess.run(
        cli("run", str(TINY_RL), *rl_args(tmp_path, sft_model, "straight", **steps)),
        env=env(), capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert straight.returncode == 0, straight.stdout[-4000:] + straight.stderr[-2000:]

    run_dir = tmp_path / "killed"
    proc = start(cli("run", str(TINY_RL), *rl_args(tmp_path, sft_model, "killed", **steps)))
    try:
        # killed past step 6's weight publish: a kill inside the export's first fsync leaves a weights/step-N.tmp the
        # next attempt's export refuses (engine/export.py; GRPO's kill test has the same window)
        wait_for(lambda: past_export(read_json(run_dir / "progress.json") or {}, 6), 600, "PPO step 6")
        assert (run_dir / "checkpoints" / "step-4").is_dir()
        trainer = next(
            e["pid"] for e in read_events(run_dir / "events.jsonl")
            if e["event"] == "process_started" and e["process"] == "trainer"
        )  # fmt: skip
        psutil.Process(trainer).kill()
        out, _ = proc.communicate(timeout=900)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out[-4000:]
    events = read_events(run_dir / "events.jsonl")
    resumed = [e for e in events if e["event"] == "attempt_started" and e["attempt"] == 2]
    assert resumed and resumed[0]["resume_from"] == 4, resumed

    # the value head saved at step 4 is a trained one (not the zero it starts as), the same in both runs
    saved = value_head_of(run_dir / "checkpoints" / "step-4")
    assert saved["proj.weight"].abs().sum() > 0
    for name, tensor in value_head_of(tmp_path / "straight" / "checkpoints" / "step-4").items():
        assert torch.equal(tensor, saved[name]), name

    def by_step(run, key: str) -> dict[int, float]:
        return {r["step"]: r[key] for r in metrics(run) if key in r}

    # step 5's value_mean and explained_variance are the restored head's outputs before any update: equal bitwise
    # only if the head resumed with the saved weights; the later steps need its optimizer state too
    for key in ("value_mean", "explained_variance", "value_loss", "reward", "loss", "grad_norm"):
        a, b = by_step(tmp_path / "straight", key), by_step(run_dir, key)
        assert sorted(a) == sorted(b) == list(range(1, 9)), key
        for step in range(5, 9):
            assert a[step] == b[step], (key, step, a[step], b[step])  # bitwise on CPU
    # and the head at the end is the uninterrupted run's
    end_a = value_head_of(tmp_path / "straight" / "checkpoints" / "step-8")
    end_b = value_head_of(run_dir / "checkpoints" / "step-8")
    for name in end_a:
        assert torch.equal(end_a[name], end_b[name]), name
    assert not torch.equal(end_b["proj.weight"], saved["proj.weight"])  # it trained on after the resume
