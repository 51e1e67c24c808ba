"""`prime-train init`: flags alone (no terminal) write a config that lints clean and explains its choices."""

from __future__ import annotations

import subprocess
import sys

import pytest

from prime_train.config.loader import load_config
from prime_train.validator.lint import lint_files
from prime_train.validator.wizard import Answers, build_config, parse_hardware


def init(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "prime_train", "init", *args],
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "flags",
    [
        [],
        ["--job", "pretrain", "--max-steps", "50"],
        ["--job", "rl"],
        ["--job", "sft", "--hardware", "H100:8"],
        ["--job", "sft", "--hardware", "A100-80GB:4", "--nodes", "2"],
        ["--job", "rl", "--hardware", "H100:1"],
        ["--job", "rl", "--hardware", "H100:8", "--environment", "arithmetic"],
        ["--job", "meta"],
        ["--job", "meta", "--hardware", "H100:8"],
    ],
)
def test_flags_alone_write_a_config_that_lints_clean(tmp_path, flags):
    result = init(tmp_path, "-o", "run.toml", *flags)
    assert result.returncode == 0, result.stdout + result.stderr
    path = tmp_path / "run.toml"
    problems, cfg = lint_files([str(path)], [])
    assert problems == [] and cfg is not None
    text = path.read_text()
    assert "# " in text and "[train]" in text, "choices are explained in comments"
    assert text in result.stdout, "the config is shown before it is saved"
    if "--job" in flags:
        assert cfg.run.job == flags[flags.index("--job") + 1]


def test_gpu_choices_follow_the_hardware(tmp_path):
    assert init(tmp_path, "-o", "a.toml", "--hardware", "H100:8", "--nodes", "2").returncode == 0
    cfg = load_config([str(tmp_path / "a.toml")])
    assert cfg.distributed.nproc_per_node == 8 and cfg.distributed.nnodes == 2
    # checkpoints in a place every node mounts, one directory per run (lint refuses node-local ones above one node)
    assert cfg.ckpt.dir == f"~/prime-train-checkpoints/{cfg.run.name}"
    assert cfg.train.precision == "bf16"
    assert cfg.train.global_batch_size % (cfg.train.micro_batch_size * 16) == 0
    # RL on 8 GPUs: some serve rollouts, the rest train, and the batch is whole groups
    assert init(tmp_path, "-o", "rl.toml", "--job", "rl", "--hardware", "H100:8").returncode == 0
    rl = load_config([str(tmp_path / "rl.toml")])
    assert rl.inference.backend == "vllm"
    assert rl.distributed.nproc_per_node + rl.inference.num_workers * rl.inference.gpus_per_worker == 8
    assert rl.train.global_batch_size == rl.rl.prompts_per_step * rl.rl.group_size
    one = init(tmp_path, "-o", "one.toml", "--job", "rl", "--hardware", "H100:1")
    assert one.returncode == 0
    assert load_config([str(tmp_path / "one.toml")]).inference.colocate is True


def test_an_existing_file_is_not_overwritten_without_force(tmp_path):
    (tmp_path / "run.toml").write_text("keep me\n")
    result = init(tmp_path, "-o", "run.toml")
    assert result.returncode == 78 and "--force" in result.stderr
    assert (tmp_path / "run.toml").read_text() == "keep me\n"
    assert init(tmp_path, "-o", "run.toml", "--force").returncode == 0
    assert (tmp_path / "run.toml").read_text() != "keep me\n"


def test_bad_answers_are_named():
    with pytest.raises(ValueError, match="job 'kto': choose one of sft, pretrain, rl, ppo, dpo, reward"):
        build_config(Answers(job="kto"))
    with pytest.raises(ValueError, match="count after ':'"):
        parse_hardware("H100:eight")
    with pytest.raises(ValueError, match="environment 'nope'"):
        build_config(Answers(job="rl", environment="nope"))


def test_a_local_model_is_read_for_its_size(tmp_path):
    import json

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "architectures": ["LlamaForCausalLM"],
                "hidden_size": 4096,
                "num_hidden_layers": 32,
                "num_attention_heads": 32,
                "num_key_value_heads": 8,
                "intermediate_size": 14336,
                "vocab_size": 128256,
                "tie_word_embeddings": False,
                "max_position_embeddings": 131072,
            }
        )
    )
    text = build_config(Answers(job="sft", model=str(model), hardware="H100:8"))
    assert "8.03B parameters" in text
    assert "activation_checkpointing = true" in text and 'strategy = "fsdp"' in text


def test_a_model_of_unknown_size_is_never_said_to_fit(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    text = build_config(Answers(job="sft", model="some-org/not-cached-model", hardware="H100:8"))
    assert "size unknown here" in text
    assert "fits one GPU" not in text and 'strategy = "ddp"' in text, text


def test_gpu_memory_comes_from_the_shipped_table_and_decides_sharding(tmp_path):
    import json

    assert parse_hardware("H100:8").memory_gib > 70
    # a 0.98B model (under the 1B at which init always shards): its 16 bytes a parameter (~14.6 GiB) fit half an
    # 80 GB GPU, so DDP; not half a 24 GB one, so FSDP
    from prime_train.validator.param_count import count_parameters

    shape = {"model_type": "qwen2", "hidden_size": 1536, "num_hidden_layers": 16, "num_attention_heads": 12,
             "num_key_value_heads": 2, "intermediate_size": 8960, "vocab_size": 151936, "tie_word_embeddings": True,
             "max_position_embeddings": 32768}  # fmt: skip
    assert 0.9e9 < count_parameters(shape) < 1e9
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(shape))
    assert 'strategy = "ddp"' in build_config(Answers(job="sft", model=str(model), hardware="H100:8"))
    assert 'strategy = "fsdp"' in build_config(Answers(job="sft", model=str(model), hardware="L4:8"))


def test_init_knows_exactly_the_gpus_memory_and_cost_know(tmp_path):
    """One GPU table (validator/gpus.py) for every command: a T4 is sized and priced alike, and a GPU none of them
    knows is refused by init as by memory and cost, naming the known ones."""
    from prime_train.validator.cost import CostInputError, estimate_cost
    from prime_train.validator.gpus import load_gpus
    from prime_train.validator.memory_inputs import MemoryInputError

    table = load_gpus()
    for gpu in table.gpus:
        name = next(n for n in (gpu.name, *gpu.aliases) if " " not in n)  # as SkyPilot spells GPUs: no spaces
        hw = parse_hardware(f"{name}:2")
        assert hw.memory_gib == gpu.memory_bytes / 2**30
    t4 = parse_hardware("T4:4")
    assert (t4.memory_gib, t4.bf16) == (15, False)
    text = build_config(Answers(job="sft", hardware="T4:4"))
    assert 'precision = "fp32"   # the T4 has no bf16' in text, "a T4 cannot autocast to bf16"
    assert lint_files([str(_write(tmp_path / "t4.toml", text))], [])[0] == []
    with pytest.raises(CostInputError, match="T4 has no published bf16 peak"):
        estimate_cost(load_config([str(tmp_path / "t4.toml")]), gpu="T4")

    with pytest.raises(ValueError) as init_error:
        parse_hardware("Z80:2")
    with pytest.raises(MemoryInputError) as table_error:
        table.find("Z80")
    assert "unknown GPU 'Z80'" in str(init_error.value) and "H100 SXM" in str(init_error.value)
    assert str(table_error.value) in str(init_error.value)
    result = init(tmp_path, "-o", "z.toml", "--hardware", "Z80:2")
    assert result.returncode != 0 and "unknown GPU 'Z80'" in result.stdout + result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "z.toml").exists()


def _write(path, text: str):
    path.write_text(text)
    return path


def _llama_8b(tmp_path):
    import shutil
    from pathlib import Path

    model = tmp_path / "llama-8b"
    model.mkdir()
    shutil.copy(Path(__file__).parent / "data" / "model_configs" / "Llama-3.1-8B" / "config.json", model)
    return str(model)


def test_lora_is_written_when_full_fine_tuning_does_not_fit_the_gpus(tmp_path):
    model = _llama_8b(tmp_path)
    a = Answers(job="sft", model=model, hardware="H100:1")
    text = build_config(a)
    assert "\n[lora]\n" in text and "\nrank = 16" in text and '# quantize = "nf4"' in text
    # the figures behind the choice, from the memory calculator with the config's own settings
    # (LoRA's 44 GiB counts no gradient of the frozen lm_head: 128,256 x 4096 in fp32 and its cast, 3 GiB, were
    # counted before the fused loss stopped forming it; and since the loss takes 512 tokens a chunk at a 128k
    # vocabulary, 0.7 GiB less of each figure)
    assert "full fine-tuning needs about 151 GiB a GPU" in text and "about 44 GiB" in text
    assert any("the config trains LoRA adapters (rank 16)" in n for n in a.notes)
    assert "lr = 0.0001" in text  # adapters take a higher rate
    path = tmp_path / "lora.toml"
    path.write_text(text)
    problems, cfg = lint_files([str(path)], [])
    assert problems == [] and cfg is not None and cfg.lora.rank == 16 and cfg.lora.quantize == "none"
    from prime_train.validator.memory import estimate, inputs_from_config

    assert estimate(inputs_from_config(cfg, gpus=["H100"])).gpus[0].trainer_fits
    # sharded over 8 GPUs the whole model fits: no [lora]; nor for the tiny model or on the CPU
    assert "[lora]" not in build_config(Answers(job="sft", model=model, hardware="H100:8"))
    assert "[lora]" not in build_config(Answers(job="sft", hardware="H100:1"))


def test_only_qlora_fits_the_share_of_a_gpu_rl_leaves_the_trainer(tmp_path, monkeypatch):
    """One GPU for RL: vLLM takes 40 %, and the 8B model with a full-precision base is over the rest."""
    from pathlib import Path

    from prime_train.cli.init import _lint_generated
    from prime_train.validator import lora_checks

    model = _llama_8b(tmp_path)
    text = build_config(Answers(job="rl", model=model, hardware="H100:1"))
    assert 'quantize = "nf4"' in text.replace('# quantize = "nf4"', "") and "one H100 leaves the trainer" in text
    # bitsandbytes missing where init runs is the training machine's to have: a warning, and the config is saved
    monkeypatch.setattr(lora_checks, "installed", lambda m: m != "bitsandbytes")
    problems = _lint_generated(text, Path("rl.toml"))
    [missing] = [p for p in problems if p.key == "lora.quantize"]
    assert missing.severity == "warning" and "install it where the run starts" in missing.message
    assert not [p for p in problems if p.severity == "error"]
