"""The commands a new user reaches for first: `runs`, `ckpt list | rm`, `generate`, `chat`, `eval`, `data inspect`.

The model commands read the session's tiny SFT run (conftest.sft_model: 120 steps of reverse-text, a checkpoint at
step 60), trained once; the checkpoint commands read checkpoint directories laid out here.
"""

from __future__ import annotations

import json
import random
import shutil
import string
import subprocess
import sys
from pathlib import Path

import pytest
from enginetools import REPO, env
from typer.testing import CliRunner

from prime_train.contract import ExitCode
from prime_train.tasks import ReverseTextTask

CONFIG = int(ExitCode.CONFIG)


def invoke(*args: str):
    from prime_train.cli import app

    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200", "NO_COLOR": "1"})


def as_json(result) -> dict:
    """The command's JSON document (a library's stray line before it, in this process, is skipped)."""
    return json.loads(result.stdout[result.stdout.index("{") :])


# ---------------------------------------------------------------- runs, ckpt list | rm (no model needed)


def make_run(root: Path, name: str, steps: list[int], *, tmp: int | None = None, corrupt: int | None = None) -> Path:
    """A run directory as `train` leaves it: config, heartbeat, metrics with an eval, checkpoints step-N."""
    run = root / name
    (run / "checkpoints").mkdir(parents=True)
    (run / "config.toml").write_text('[run]\nname = "x"\njob = "sft"\n')
    (run / "progress.json").write_text(json.dumps({"step": 40, "phase": "done", "time": 1.7e9, "max_steps": 40}))
    (run / "metrics.jsonl").write_text(
        json.dumps({"step": 20, "loss": 1.0}) + "\n" + json.dumps({"step": 40, "eval_exact_match": 0.75}) + "\n"
    )
    for step in steps:
        (run / "checkpoints" / f"step-{step}").mkdir()
        (run / "checkpoints" / f"step-{step}" / "shard").write_bytes(b"x" * 1000)
    if tmp is not None:
        (run / "checkpoints" / f"step-{tmp}.tmp").mkdir()
    if corrupt is not None:
        (run / "checkpoints" / f"step-{corrupt}.corrupt").mkdir()
        (run / "checkpoints" / f"step-{corrupt}.corrupt" / "quarantine.json").write_text('{"reason": "bad crc"}')
    return run


def test_runs_lists_each_run_with_its_job_state_step_last_eval_and_size(tmp_path):
    make_run(tmp_path, "alpha", [20, 40])
    (tmp_path / "not-a-run").mkdir()
    result = invoke("runs", str(tmp_path), "--json")
    assert result.exit_code == 0, result.output
    (row,) = as_json(result)["runs"]
    assert (row["name"], row["job"], row["state"], row["step"], row["max_steps"]) == ("alpha", "sft", "done", 40, 40)
    assert row["last_eval"] == {"step": 40, "name": "eval_exact_match", "value": 0.75}
    assert row["bytes"] >= 2000  # the two checkpoints' shards at least
    text = invoke("runs", str(tmp_path))
    assert "alpha" in text.stdout and "exact_match 0.75" in text.stdout and "40/40" in text.stdout
    missing = invoke("runs", str(tmp_path / "nope"))
    assert missing.exit_code == CONFIG and "does not exist" in missing.output


def test_ckpt_list_shows_whole_partial_and_quarantined_checkpoints(tmp_path):
    run = make_run(tmp_path, "r", [20, 40], tmp=60, corrupt=10)
    result = invoke("ckpt", "list", str(run), "--json")
    assert result.exit_code == 0, result.output
    rows = as_json(result)["checkpoints"]
    assert [(r["step"], r["kind"]) for r in rows] == [
        (10, "quarantined"),
        (20, "whole"),
        (40, "whole"),
        (60, "partial"),
    ]
    assert rows[0]["reason"] == "bad crc" and rows[1]["bytes"] == 1000 and rows[1]["verified"] is None
    # --verify runs the engine's check: these hand-made directories have no DCP metadata
    verified = as_json(invoke("ckpt", "list", str(run), "--verify", "--json"))["checkpoints"]
    assert [r["verified"] for r in verified if r["kind"] == "whole"] == [False, False]
    assert "no DCP .metadata" in verified[1]["problem"]


def test_ckpt_rm_follows_the_retention_rules(tmp_path):
    run = make_run(tmp_path, "r", [20, 40], tmp=60, corrupt=10)
    ckpts = run / "checkpoints"
    newest = invoke("ckpt", "rm", str(run), "40")
    assert newest.exit_code == CONFIG and "newest whole checkpoint" in newest.output
    quarantined = invoke("ckpt", "rm", str(run), "10")
    assert quarantined.exit_code == CONFIG and "kept for inspection" in quarantined.output
    assert invoke("ckpt", "rm", str(run), "7").exit_code == CONFIG
    assert (ckpts / "step-40").is_dir() and (ckpts / "step-10.corrupt").is_dir()
    # a symlink named like a checkpoint is refused, and its target is left whole
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_text("mine")
    (ckpts / "step-5").symlink_to(outside)
    linked = invoke("ckpt", "rm", str(run), "5")
    assert linked.exit_code == CONFIG and (outside / "keep").read_text() == "mine"
    done = invoke("ckpt", "rm", str(run), "20", "--json")
    assert done.exit_code == 0 and as_json(done)["removed"] == [str(ckpts / "step-20")]
    assert not (ckpts / "step-20").exists() and (ckpts / "step-40").is_dir()
    assert invoke("ckpt", "rm", str(run), "60").exit_code == 0  # an unfinished save nobody is writing
    assert not (ckpts / "step-60.tmp").exists()


# ---------------------------------------------------------------- the model commands, on the trained tiny run


def test_generate_gives_the_reversed_word_from_final_and_from_a_checkpoint(sft_model):
    run = sft_model.parent
    result = invoke("generate", str(run), "-p", "reverse dwlk=", "-p", "reverse bve=", "--raw", "--temperature", "0",
                    "--json")  # fmt: skip
    assert result.exit_code == 0, result.output[-2000:]
    doc = as_json(result)
    assert doc["model"] == str(run / "final")
    assert [r["completion"] for r in doc["replies"]] == ["klwd", "evb"]
    # step-60 is converted on the fly (into a temporary directory: the run is not written to)
    before = sorted(p.name for p in run.iterdir())
    step = invoke("generate", str(run), "--step", "60", "-p", "reverse dwlk=", "--raw", "--temperature", "0", "--json")
    assert step.exit_code == 0, step.output[-2000:]
    assert as_json(step)["model"].startswith(str(run / "checkpoints" / "step-60"))
    assert as_json(step)["replies"][0]["completion"] != ""
    assert sorted(p.name for p in run.iterdir()) == before
    missing = invoke("generate", str(run), "--step", "7", "-p", "x")
    assert missing.exit_code == CONFIG and "no whole checkpoint step-7" in missing.output
    assert "Traceback" not in missing.output


def test_chat_reads_messages_from_a_pipe_and_answers_each(sft_model):
    from prime_train.cli import app

    result = CliRunner().invoke(
        app, ["chat", str(sft_model), "--raw", "--temperature", "0", "--json"], input="reverse abcd=\nreverse hello=\n"
    )
    assert result.exit_code == 0, result.output[-2000:]
    turns = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(turns) == 2 and turns[0]["assistant"] == "dcba"
    # --raw: each message goes to the model as typed, and is answered as generate answers it. The 120-step model's
    # reversal of a 5-letter word is not always right ('ollel' on this 2-core CPU, 'olleh' on CI's): what chat sends
    # and returns is what this test checks
    assert turns[1]["model_input"] == "reverse hello="
    single = invoke("generate", str(sft_model), "-p", turns[1]["model_input"], "--raw", "--temperature", "0", "--json")
    assert single.exit_code == 0, single.output[-2000:]
    assert turns[1]["assistant"] == as_json(single)["replies"][0]["completion"] != ""


# A chat template of the test's own, not the byte tokenizer's ChatML: it lower-cases every message (the tiny model
# only knows lowercase `reverse abc=` prompts, so a right answer to an upper-case message means the model saw the
# templated text) and ends each assistant turn with eos, the document boundary the model was trained with.
LOWER_TEMPLATE = (
    "{%- for m in messages if m['role'] != 'system' %}{{ m['content'] | lower }}"
    "{% if m['role'] == 'assistant' %}<|eos|>{% endif %}{% endfor %}"
)


def test_chat_and_generate_format_the_conversation_with_the_tokenizers_chat_template(sft_model, tmp_path):
    from prime_train.cli import app

    model = tmp_path / "templated"
    shutil.copytree(sft_model, model)
    (model / "chat_template.jinja").write_text(LOWER_TEMPLATE)
    args = ["chat", str(model), "--temperature", "0", "--max-tokens", "12", "--json"]
    talk = "REVERSE ABCD=\nREVERSE HELLO=\n/reset\nREVERSE XYZ=\n"
    result = CliRunner().invoke(app, args, input=talk)
    assert result.exit_code == 0, result.output[-2000:]
    turns = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    # the second turn carries the first (its reply included); /reset drops them
    assert [t["model_input"] for t in turns] == [
        "reverse abcd=",
        f"reverse abcd={turns[0]['assistant']}<|eos|>reverse hello=",
        "reverse xyz=",
    ]
    assert (turns[0]["assistant"], turns[2]["assistant"]) == ("dcba", "zyx")
    # --raw: the message as typed, which the model cannot answer
    raw = CliRunner().invoke(app, [*args, "--raw"], input="REVERSE ABCD=\n")
    (raw_turn,) = [json.loads(line) for line in raw.stdout.splitlines() if line.startswith("{")]
    assert raw_turn["model_input"] == "REVERSE ABCD=" and raw_turn["assistant"] != "dcba"
    single = invoke("generate", str(model), "-p", "REVERSE DWLK=", "--temperature", "0", "--json")
    assert single.exit_code == 0, single.output[-2000:]
    (reply,) = as_json(single)["replies"]
    assert (reply["model_input"], reply["completion"]) == ("reverse dwlk=", "klwd")


def test_generate_loads_a_lora_adapter_on_the_base_its_config_names(sft_model, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(sft_model)
    # lora_B starts at zero: the adapted model answers as its base does, which proves the base under it is that one
    adapted = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    adapted.peft_config["default"].base_model_name_or_path = str(sft_model)
    adapted.save_pretrained(tmp_path / "adapter")
    result = invoke("generate", str(tmp_path / "adapter"), "-p", "reverse dwlk=", "--raw", "--temperature", "0",
                    "--json")  # fmt: skip
    assert result.exit_code == 0, result.output[-2000:]
    doc = as_json(result)
    assert doc["model"] == str(tmp_path / "adapter") and doc["replies"][0]["completion"] == "klwd"


def test_eval_reports_held_out_loss_exact_match_and_an_environments_reward(sft_model):
    result = invoke("eval", str(sft_model.parent), "--examples", "16", "--environment", "reverse-text",
                    "--rl.eval_prompts", "16", "--json")  # fmt: skip
    assert result.exit_code == 0, result.output[-2000:]
    metrics = as_json(result)["metrics"]
    assert metrics["eval_examples"] == 16 and metrics["eval_exact_match"] >= 0.5
    assert metrics["eval_loss"] < 1.0 and metrics["eval_ppl"] == pytest.approx(2.718281828 ** metrics["eval_loss"])
    assert metrics["eval_env_prompts"] == 16 and metrics["eval_env_pass_rate"] >= 0.5


def test_eval_of_a_model_directory_without_a_config_or_harness_is_a_clear_78(sft_model, monkeypatch, tmp_path):
    no_config = invoke("eval", str(sft_model))
    assert no_config.exit_code == CONFIG and "no config.toml" in no_config.output
    missing_yaml = invoke("eval", str(sft_model), "--tasks", str(tmp_path / "nope.yaml"))
    assert missing_yaml.exit_code == CONFIG and "nope.yaml: no such task YAML file" in missing_yaml.output
    not_a_dir = invoke("eval", str(sft_model), "--tasks", "x", "--include-path", str(tmp_path / "nope"))
    assert not_a_dir.exit_code == CONFIG and "not a directory of task YAML files" in not_a_dir.output
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # as if it were not installed: its import fails
    harness = invoke("eval", str(sft_model.parent), "--tasks", "hellaswag")
    assert harness.exit_code == CONFIG and "pip install 'prime-train[lm-eval]'" in harness.output
    assert "Traceback" not in harness.output


def reverse_task(path: Path, name: str, *, label_right: bool) -> Path:
    """An lm-eval multiple-choice task on a local JSONL file (no download): pick the reversal of a word among four
    strings. With label_right the target is the reversal, else a wrong string; the dataset cache stays in the test."""
    rng = random.Random(0)
    docs = []
    for _ in range(20):
        example = ReverseTextTask().generate(rng)
        word, right = example.prompt.removeprefix("reverse ").removesuffix("="), example.answer
        choices = [right]
        while len(choices) < 4:
            other = "".join(rng.choice(string.ascii_lowercase) for _ in right)
            choices += [other] if other not in choices else []
        rng.shuffle(choices)
        target = choices.index(right) if label_right else (choices.index(right) + 1) % 4
        docs.append({"word": word, "choices": choices, "label": target})
    path.mkdir(parents=True, exist_ok=True)
    (path / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    config = {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(path / f"{name}.jsonl")}, "cache_dir": str(path / "cache")},
        "test_split": "test",
        "output_type": "multiple_choice",
        "doc_to_text": "reverse {{word}}=",
        "doc_to_choice": "{{choices}}",
        "doc_to_target": "label",
        "target_delimiter": "",  # the model was trained on `reverse abc=cba`, no space before the answer
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
    }
    (path / f"{name}.yaml").write_text(json.dumps(config))  # JSON is YAML
    return path / f"{name}.yaml"


def test_eval_runs_lm_eval_on_local_task_files_and_reports_their_accuracy(sft_model, tmp_path):
    pytest.importorskip("lm_eval")  # in the dev extra; the test above covers its absence
    reverse_task(tmp_path / "tasks", "reverse_right", label_right=True)
    wrong = reverse_task(tmp_path, "reverse_wrong", label_right=False)
    # one task found in --include-path by its name, one named as a file; the run's config is not needed
    result = invoke("eval", str(sft_model.parent), "--tasks", f"reverse_right,{wrong}", "--include-path",
                    str(tmp_path / "tasks"), "--json")  # fmt: skip
    assert result.exit_code == 0, result.output[-3000:]
    scores = as_json(result)["lm_eval"]
    assert scores.keys() == {"reverse_right", "reverse_wrong"}
    # the trained model scores the reversal above the three random strings: right when it is the target, wrong
    # when a random string is (chance is 0.25)
    assert scores["reverse_right"]["sample_len"] == 20 and scores["reverse_right"]["acc"] >= 0.9, scores
    assert scores["reverse_wrong"]["sample_len"] == 20 and scores["reverse_wrong"]["acc"] <= 0.1, scores
    assert "acc_stderr" in scores["reverse_right"]
    # a model directory with no config.toml, as text: the same accuracy
    text = invoke("eval", str(sft_model), "--tasks", str(tmp_path / "tasks" / "reverse_right.yaml"))
    assert text.exit_code == 0, text.output[-3000:]
    assert f"reverse_right: sample_len 20, acc {scores['reverse_right']['acc']:.4g}," in text.stdout
    # a task file that does not parse is the user's to fix: exit 78 with its line, no traceback
    (tmp_path / "bad.yaml").write_text("task: [reverse\n")
    bad = invoke("eval", str(sft_model), "--tasks", str(tmp_path / "bad.yaml"))
    assert bad.exit_code == CONFIG and f'"{tmp_path / "bad.yaml"}", line 1' in bad.output, bad.output[-2000:]


def test_an_unknown_lm_eval_task_is_named_before_any_model_loads(tmp_path):
    pytest.importorskip("lm_eval")
    # the directory holds no model: had the model loaded first, the error would be about it, after its load
    (tmp_path / "run").mkdir()
    result = invoke("eval", str(tmp_path / "run"), "--tasks", "no_such_task_xyz")
    assert result.exit_code == CONFIG, result.output[-2000:]
    assert "--tasks no_such_task_xyz: no such task in lm-eval's registry" in result.output, result.output[-2000:]
    assert "Traceback" not in result.output


def test_data_inspect_shows_the_loss_mask_packing_and_warnings():
    result = invoke("data", "inspect", "-n", "1", "--limit", "200", "--json")
    assert result.exit_code == 0, result.output[-2000:]
    doc = as_json(result)
    (record,) = doc["records"]
    prompt, answer = record["marked"].split("[[")
    assert prompt.startswith("reverse ") and prompt.endswith("=")
    assert answer == prompt.removeprefix("reverse ").removesuffix("=")[::-1] + "<|eos|>]]"  # the completion trains
    assert record["num_trained"] == len(prompt) - len("reverse =") + 1 and len(record["ids"]) == record["num_tokens"]
    assert doc["packing_stats"]["documents"] == 200 and 0.5 < doc["packing_stats"]["efficiency"] <= 1.0
    assert sum(b["count"] for b in doc["histogram"]) == 200 and doc["warnings"] == []
    # a seq_len shorter than the records: the cut is counted and warned about; the text view shows the marker form
    short = invoke("data", "inspect", "-n", "1", "--limit", "50", "--data.seq_len", "12")
    assert short.exit_code == 0, short.output[-2000:]
    assert "[[" in short.stdout and "longer than data.seq_len = 12" in short.stderr


def test_the_command_tree_imports_no_heavy_library():
    # the new commands load torch, transformers, peft and huggingface_hub inside themselves: --help stays fast
    heavy = ("torch", "transformers", "peft", "huggingface_hub")
    probe = f"import sys; from prime_train.cli import app; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, env=env())
    assert out.stdout.strip() == "[]", out.stderr
