"""Token budgets and RL gotchas: lint errors and warnings with the numbers, preflight checks, secrets kept out."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from prime_train.config.schema import Config
from prime_train.rl.budget import (
    check_gotchas,
    check_token_budget,
    percentile,
)
from prime_train.validator.lint import lint_files
from prime_train.validator.param_count import count_parameters
from prime_train.validator.preflight import run_preflight
from prime_train.validator.rl_checks import rl_preflight_checks


def rl_config(tmp_path, **sections) -> Config:
    data = {"run": {"job": "rl", "output_dir": str(tmp_path / "runs")}}
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return Config.model_validate(data)


def write_toml(tmp_path, body: str):
    path = tmp_path / "rl.toml"
    path.write_text(textwrap.dedent(body).replace("OUT", str(tmp_path / "runs")))
    return path


def test_percentile_is_nearest_rank():
    assert percentile(list(range(1, 101)), 0.99) == 99
    assert percentile([5], 0.99) == 5
    assert percentile([1] * 98 + [50, 60], 0.99) == 50


def test_tiny_rl_defaults_have_no_budget_problem(tmp_path):
    assert check_token_budget(rl_config(tmp_path)) == []
    assert check_gotchas(rl_config(tmp_path), environ={}, vllm_version=None) == []


def test_budget_is_not_checked_for_sft_runs(tmp_path):
    cfg = Config.model_validate({"rl": {"max_tokens": 10_000}})
    assert check_token_budget(cfg) == []
    assert rl_preflight_checks(cfg) == []


def test_over_budget_is_an_error_with_every_number(tmp_path):
    # reverse-text prompts are "reverse <3-6 letters>=": 12-15 bytes, p99 15 with the byte tokenizer
    cfg = rl_config(tmp_path, rl={"max_tokens": 500, "budget_margin_tokens": 8})
    [(severity, message, key)] = check_token_budget(cfg)
    assert (severity, key) == ("error", "rl.max_tokens")
    assert "rl.max_tokens (500) + p99 prompt length (15" in message
    assert "margin (8) = 523 exceeds inference.max_model_len (512)" in message
    assert "raise inference.max_model_len or lower rl.max_tokens" in message


def test_tight_budget_is_a_warning_under_ten_percent_of_a_short_context(tmp_path):
    cfg = rl_config(tmp_path, rl={"max_tokens": 470})  # 15 + 470 + 8 = 493: 19 tokens of 512 left
    [(severity, message, key)] = check_token_budget(cfg)
    assert (severity, key) == ("warning", "inference.max_model_len")
    assert "leaves 19 of inference.max_model_len (512) free" in message
    # 60 tokens left is above 10 % of 512 (51.2): a short context does not apply the 500-token rule
    assert check_token_budget(rl_config(tmp_path, rl={"max_tokens": 429})) == []


def test_long_context_warns_under_five_hundred_tokens_of_slack(tmp_path):
    # 15 + 32_300 + 8 = 32_323 leaves 445 of 32_768: under 500 tokens, though far under 10 % too
    cfg = rl_config(tmp_path, rl={"max_tokens": 32_300}, inference={"max_model_len": 32_768})
    [(severity, message, _)] = check_token_budget(cfg)
    assert severity == "warning" and "leaves 445 of inference.max_model_len (32768)" in message
    # 1745 tokens left: above the 500-token floor, which governs long contexts instead of 10 % (3277)
    assert check_token_budget(rl_config(tmp_path, rl={"max_tokens": 31_000}, inference={"max_model_len": 32_768})) == []


def test_a_given_tokenizer_is_used_for_prompt_lengths(tmp_path):
    cfg = rl_config(tmp_path, rl={"max_tokens": 100}, inference={"max_model_len": 512})
    assert check_token_budget(cfg, tokenizer=lambda text: 300) == []
    [(severity, message, _)] = check_token_budget(cfg, tokenizer=lambda text: 390)
    assert severity == "warning" and "p99 prompt length (390" in message and "leaves 14 " in message
    [(severity, message, _)] = check_token_budget(cfg, tokenizer=lambda text: 450)
    assert severity == "error" and "p99 prompt length (450" in message


def test_local_tokenizer_json_is_read_without_transformers(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    # a word-level tokenizer: "reverse abc=" is two tokens, far fewer than its 12 bytes
    tok = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    (tmp_path / "tok").mkdir()
    tok.save(str(tmp_path / "tok" / "tokenizer.json"))
    cfg = rl_config(tmp_path, rl={"max_tokens": 500}, model={"tokenizer": str(tmp_path / "tok")})
    # 2 + 500 + 8 = 510 fits 512 (tightly); counted in bytes it would not
    [(severity, message, _)] = check_token_budget(cfg)
    assert severity == "warning" and "p99 prompt length (2, " in message and "tokenizer.json" in message


def test_unavailable_tokenizer_is_a_warning_that_the_budget_was_not_checked(tmp_path):
    cfg = rl_config(tmp_path, model={"path": "some-org/not-downloaded-model"})
    [(severity, message, _)] = check_token_budget(cfg)
    assert severity == "warning" and "token budget not checked" in message and "not-downloaded-model" in message


def test_lint_is_quiet_about_a_model_directory_an_earlier_run_will_write(tmp_path):
    cfg = rl_config(tmp_path, model={"path": str(tmp_path / "runs" / "sft" / "final")})
    assert check_token_budget(cfg, pending_ok=True) == []
    [(severity, message, _)] = check_token_budget(cfg)  # preflight, run when it should exist, still says so
    assert severity == "warning" and "token budget not checked" in message


def test_bad_environment_is_a_lint_error_at_rl_environment(tmp_path):
    path = write_toml(
        tmp_path,
        """
        [run]
        job = "rl"
        output_dir = "OUT"

        [rl]
        environment = "missing_pkg.envs:load_environment"
        """,
    )
    problems, _ = lint_files([str(path)])
    [problem] = problems
    assert (problem.severity, problem.key, problem.line) == ("error", "rl.environment", 7)
    assert "cannot import 'missing_pkg.envs'" in problem.message


def test_lint_reports_over_budget_at_the_max_tokens_line_with_the_bad_input_code(tmp_path):
    path = write_toml(
        tmp_path,
        """
        [run]
        job = "rl"
        output_dir = "OUT"

        [inference]
        max_model_len = 256

        [rl]
        max_tokens = 300
        """,
    )
    done = subprocess.run(
        [sys.executable, "-m", "prime_train", "lint", "--json", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 78, done.stdout + done.stderr  # bad input, as for every command (cli/errors.py)
    assert "= 323 exceeds inference.max_model_len (256)" in done.stdout
    report = json.loads(done.stdout)
    problems = report if isinstance(report, list) else [p for f in report.values() for p in f]
    [problem] = [p for p in problems if p["key"] == "rl.max_tokens"]
    assert problem["line"] == 10 and problem["severity"] == "error"


# ---------------------------------------------------------------- gotchas

TOOL_MODULE = """
class ToolEnv:
    name = "tools"
    uses_tools = True

    def prompts(self, split, n, seed):
        from prime_train.environments import Prompt

        return [Prompt("call the tool", "ok", {}) for _ in range(n)]

    def reward(self, prompt, completion):
        return 0.0


def load_environment():
    return ToolEnv()
"""


def test_remote_executor_with_a_tool_environment_warns_with_the_added_time(tmp_path, monkeypatch):
    (tmp_path / "tool_env_mod.py").write_text(textwrap.dedent(TOOL_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = rl_config(
        tmp_path,
        rl={"environment": "tool_env_mod:load_environment", "tool_executor": "remote", "prompts_per_step": 8},
    )
    [(severity, message, key)] = check_gotchas(cfg, environ={})
    assert (severity, key) == ("warning", "rl.tool_executor")
    assert "about 32 s added per step (8 prompts × 8 completions × 0.5 s" in message
    assert "set rl.tool_executor = 'local'" in message
    # a built-in environment calls no tools: remote costs nothing there
    assert check_gotchas(rl_config(tmp_path, rl={"tool_executor": "remote"}), environ={}) == []


def test_colocated_trainer_without_room_gets_a_suggested_utilization(tmp_path):
    # Qwen2.5-0.5B-sized config: 494M params × 16 B ≈ 7.9 GB + 2 GiB, against 10 % of an 80 GB GPU
    model_dir = tmp_path / "qwen"
    model_dir.mkdir()
    hf = {
        "model_type": "qwen2",
        "hidden_size": 896,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "intermediate_size": 4864,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    }
    (model_dir / "config.json").write_text(json.dumps(hf))
    base = {"model": {"path": str(model_dir)}}
    cfg = rl_config(tmp_path, inference={"colocate": True, "gpu_memory_utilization": 0.9}, **base)
    params = count_parameters(hf)
    [(severity, message, key)] = check_gotchas(cfg, environ={}, gpu_memory_bytes=80e9, num_params=params)
    assert (severity, key) == ("warning", "inference.gpu_memory_utilization")
    assert "leaves 8.0 GB of a 80 GB GPU to the trainer, which needs about 10.1 GB (494.0M params" in message
    assert "set inference.gpu_memory_utilization = 0.85" in message
    unknown = check_gotchas(cfg, environ={}, gpu_memory_bytes=None, num_params=params)
    assert "(assumed: NVML unavailable)" in unknown[0][1]
    roomy = rl_config(tmp_path, inference={"colocate": True, "gpu_memory_utilization": 0.8}, **base)
    assert check_gotchas(roomy, environ={}, gpu_memory_bytes=80e9, num_params=params) == []
    small_gpu = check_gotchas(cfg, environ={}, gpu_memory_bytes=8e9, num_params=params)
    assert "set inference.colocate = false" in small_gpu[0][1]
    # one GPU with colocate unset: the placement shares it all the same, and the same check applies
    shared = rl_config(tmp_path, inference={"gpu_memory_utilization": 0.9}, **base)
    assert check_gotchas(shared, environ={}, gpu_memory_bytes=80e9, num_params=params) == []
    assert check_gotchas(shared, environ={}, gpu_memory_bytes=80e9, num_params=params, colocated=True)


def test_vllm_use_v1_warns_by_name_and_never_prints_its_value(tmp_path):
    secret = "sk-live-do-not-print-0123456789"
    cfg = rl_config(tmp_path)
    [(severity, message, _)] = check_gotchas(cfg, environ={"VLLM_USE_V1": secret}, vllm_version=(0, 11))
    assert severity == "warning" and "VLLM_USE_V1 is set but does nothing (vLLM 0.11" in message
    assert secret not in message
    # before 0.11 the variable still chose the engine
    assert check_gotchas(cfg, environ={"VLLM_USE_V1": "1"}, vllm_version=(0, 10)) == []


def test_preflight_gains_token_budget_and_rl_gotcha_checks(tmp_path, monkeypatch):
    secret = "hunter2-secret-value"
    monkeypatch.setenv("VLLM_USE_V1", secret)
    cfg = rl_config(tmp_path, rl={"max_tokens": 600})
    results = {r.name: r for r in run_preflight(cfg, gpu_probe=lambda n: {})}
    assert results["token budget"].status == "fail"
    assert "exceeds inference.max_model_len (512)" in results["token budget"].message
    assert results["rl gotchas"].status == "warn" and "VLLM_USE_V1" in results["rl gotchas"].message
    assert secret not in json.dumps([r.to_dict() for r in results.values()], default=str)
    sft = Config.model_validate({"run": {"output_dir": str(tmp_path / "runs")}})
    assert not {"token budget", "rl gotchas"} & {r.name for r in run_preflight(sft, gpu_probe=lambda n: {})}
