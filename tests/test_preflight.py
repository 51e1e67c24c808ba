"""Preflight: each check's pass / warn / fail, with recorded probes and with the real ones where they run here."""

from __future__ import annotations

import json
import os
import resource
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from prime_train.config.schema import Config
from prime_train.validator import preflight
from prime_train.validator.model_shape import model_shape
from prime_train.validator.param_count import count_parameters
from prime_train.validator.preflight import (
    FAIL,
    PASS,
    WARN,
    check_cuda,
    check_memory_fit,
    check_open_files,
    check_output_dir,
    check_ports,
    check_secrets,
    estimate_memory,
    inference_workers,
    open_files_needed,
    preflight_command,
    probe_gpus,
    run_preflight,
)
from prime_train.validator.storage_checks import check_disk, check_shared_memory, checkpoint_disk_need

GIB = 1 << 30
CHECK_NAMES = ["open_files", "model_source", "cuda", "output_dir", "disk", "ports", "secrets", "memory_fit"]

# config.json fields of public models; the totals are the parameter counts transformers reports (FACTS.md)
QWEN25_7B = {
    "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944, "num_hidden_layers": 28,
    "num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152064, "tie_word_embeddings": False,
}  # fmt: skip
QWEN25_05B = {
    "model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
    "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True,
}  # fmt: skip
LLAMA31_8B = {
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "tie_word_embeddings": False,
}  # fmt: skip
MISTRAL_7B = {**LLAMA31_8B, "model_type": "mistral", "vocab_size": 32000}


@pytest.fixture(autouse=True)
def cpu_machine(monkeypatch):
    """No GPU visible unless a test says otherwise (the check reads CUDA_VISIBLE_DEVICES before NVML)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


def make_config(tmp_path, **sections) -> Config:
    sections.setdefault("run", {})
    sections["run"] = {"output_dir": str(tmp_path / "runs"), **sections["run"]}
    return Config.model_validate(sections)


def disk_with(free: float):
    return lambda path: SimpleNamespace(total=10 * free, used=9 * free, free=free)


def healthy_probe(count: int, memory_mib: float = 81559.0, nvml_count: int | None = None):
    def probe(requested: int) -> dict:
        devices = [
            {"index": i, "ok": True, "error": None, "name": "NVIDIA H100 80GB HBM3",
             "total_memory_mib": memory_mib, "free_memory_mib": memory_mib * 0.99}
            for i in range(min(requested, count))
        ]  # fmt: skip
        return {"error": None, "torch_version": "2.13.0+cu128", "cuda_version": "12.8", "cuda_available": True,
                "device_count": count, "devices": devices,
                "nvml_count": count if nvml_count is None else nvml_count, "nvml_error": None}  # fmt: skip

    return probe


# ---------------------------------------------------------------- open files


def test_open_files_soft_limit_is_raised_to_the_hard_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 4096:
        pytest.skip(f"hard open-files limit {hard} is below what the trainer needs")
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
    try:
        result = check_open_files()
        now = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        assert result.status == PASS
        assert now == (hard if hard != resource.RLIM_INFINITY else 4096)
        assert result.details["soft_before"] == 1024 and "raised from 1024" in result.message
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def _open_files_check_under_hard_limit(hard: int, needed: int, recommended: int) -> dict:
    # a lowered hard limit cannot be raised again by a normal user: do it in a child process
    script = textwrap.dedent(f"""
        import json, resource
        resource.setrlimit(resource.RLIMIT_NOFILE, ({hard}, {hard}))
        from prime_train.validator.preflight import check_open_files
        print(json.dumps(check_open_files({needed}, {recommended}).to_dict()))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_open_files_below_need_fails_with_the_ulimit_command_and_limits_conf_line():
    result = _open_files_check_under_hard_limit(2048, 4096, 4096)
    assert result["status"] == FAIL
    assert "`ulimit -n 4096`" in result["fix"]
    assert "* hard nofile 4096" in result["fix"] and "/etc/security/limits.conf" in result["fix"]
    assert result["details"] == {"soft_before": 2048, "soft": 2048, "hard": 2048, "needed": 4096, "recommended": 4096}


def test_rl_open_files_follow_the_backend():
    # preflight used to pass 0 workers whatever the config said, so RL never reached vLLM's 65536
    embedded = Config.model_validate({"run": {"job": "rl"}, "inference": {"num_workers": 2, "backend": "embedded"}})
    vllm = Config.model_validate({"run": {"job": "rl"}, "inference": {"num_workers": 2, "backend": "vllm"}})
    assert inference_workers(embedded) == 2 and inference_workers(Config()) == 0
    assert inference_workers(Config.model_validate({"run": {"job": "rl"}, "job": {"command": ["x"]}})) == 0
    assert open_files_needed(embedded) == (4096, 4096)
    assert open_files_needed(vllm) == (4096, 65536)  # vLLM raises its own limit to 65535


def test_below_vllms_open_files_target_is_a_warning_with_the_command_not_a_failure():
    # many hosts cap the hard limit below 65536 (20000 on this machine); vLLM only warns there itself
    result = _open_files_check_under_hard_limit(8192, 4096, 65536)
    assert result["status"] == WARN and result["details"]["recommended"] == 65536
    assert "`ulimit -n 65536`" in result["fix"] and "Too many open files" in result["message"]


# ---------------------------------------------------------------- CUDA


def test_no_gpu_asked_for_on_a_cpu_machine_passes(tmp_path):
    def no_probe(requested):
        raise AssertionError("a CPU run must not start the CUDA probe")

    result = check_cuda(make_config(tmp_path), gpu_probe=no_probe)
    assert result.status == PASS and "CPU run" in result.message


def test_all_requested_gpus_usable_and_seen_by_nvml_pass(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    asked = []
    probe = healthy_probe(2)
    result = check_cuda(make_config(tmp_path), gpu_probe=lambda n: asked.append(n) or probe(n))
    assert asked == [2]  # one GPU per local rank, nproc_per_node unset
    assert result.status == PASS and "2 GPU(s) usable" in result.message and "H100" in result.message


def test_fewer_gpus_than_nproc_per_node_fails_naming_the_key(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    cfg = make_config(tmp_path, distributed={"nproc_per_node": 4})
    result = check_cuda(cfg, gpu_probe=healthy_probe(1))
    assert result.status == FAIL and "4 GPU(s) requested" in result.message and "torch sees 1" in result.message
    assert "distributed.nproc_per_node = 1" in result.fix


def test_a_gpu_that_refuses_a_context_fails_with_its_error(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")

    def probe(requested):
        out = healthy_probe(2)(requested)
        out["devices"][1] = {"index": 1, "ok": False, "error": "CUDA error: uncorrectable ECC error encountered"}
        return out

    result = check_cuda(make_config(tmp_path), gpu_probe=probe)
    assert result.status == FAIL and "cuda:1: CUDA error: uncorrectable ECC error" in result.message


def test_nvml_seeing_fewer_gpus_than_torch_fails(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    result = check_cuda(make_config(tmp_path), gpu_probe=healthy_probe(2, nvml_count=1))
    assert result.status == FAIL and "NVML sees 1" in result.message and "nvidia-ml-py" in result.fix


def test_a_hung_probe_fails_instead_of_hanging(tmp_path, monkeypatch):
    # the real probe subprocess, replaced by one that never finishes, killed at the timeout
    monkeypatch.setattr(preflight, "_PROBE_SCRIPT", "import time\ntime.sleep(120)")
    probe = probe_gpus(1, timeout_s=1.0)
    assert "did not finish within 1 s" in probe["error"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    result = check_cuda(make_config(tmp_path), gpu_probe=lambda n: probe)
    assert result.status == FAIL and "hung driver" in result.message


def test_real_probe_reports_no_cuda_cleanly_on_this_cpu_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # pretend a GPU was asked for: the real probe runs
    result = check_cuda(make_config(tmp_path))
    probe = result.details["probe"]
    assert probe["error"] is None and probe["cuda_available"] is False and probe["torch_version"]
    assert "NVMLError" in probe["nvml_error"]
    assert result.status == FAIL and "CUDA is not usable" in result.message and "finds no GPU" in result.message


def test_config_that_needs_a_gpu_fails_on_a_cpu_machine_naming_the_key(tmp_path):
    cfg = make_config(tmp_path, model={"attn_implementation": "flash_attention_2"})
    no_cuda = {"error": None, "torch_version": "2.13.0+cpu", "cuda_version": None, "cuda_available": False}
    result = check_cuda(cfg, gpu_probe=lambda n: no_cuda)
    assert result.status == FAIL and "model.attn_implementation = 'flash_attention_2'" in result.message
    assert "model.attn_implementation = 'sdpa'" in result.fix


# ---------------------------------------------------------------- model size and disk


@pytest.mark.parametrize(
    ("hf", "expected"),
    [(QWEN25_7B, 7_615_616_512), (QWEN25_05B, 494_032_768), (LLAMA31_8B, 8_030_261_248), (MISTRAL_7B, 7_241_732_096)],
)
def test_parameter_count_matches_transformers_for_public_models(hf, expected):
    assert count_parameters(hf) == expected


@pytest.mark.parametrize(
    "model",
    [
        {"arch": "llama"},
        {"arch": "qwen2", "hidden_size": 96, "num_heads": 6, "num_kv_heads": 2, "tie_embeddings": False},
        {"arch": "llama", "hidden_size": 64, "num_layers": 3, "intermediate_size": 176, "vocab_multiple": 128},
    ],
)
def test_random_init_parameter_count_matches_the_model_the_engine_builds(tmp_path, model):
    pytest.importorskip("transformers")
    from prime_train.engine.model import build_model, num_parameters
    from prime_train.engine.tokenizer import build_byte_tokenizer, padded_vocab_size

    cfg = make_config(tmp_path, model=model)
    hf, source = model_shape(cfg)
    built = build_model(cfg.model, padded_vocab_size(build_byte_tokenizer(), cfg.model.vocab_multiple))
    assert count_parameters(hf) == num_parameters(built)
    assert source == f"random-initialised {cfg.model.arch}"


def test_model_path_without_config_json_leaves_the_size_unknown(tmp_path):
    cfg = make_config(tmp_path, model={"path": str(tmp_path / "nowhere")})
    result = check_disk(cfg, disk_usage=disk_with(1e12))
    assert result.status == WARN and "size unknown" in result.message and "no local config.json" in result.message


def test_checkpoints_kept_are_keep_last_plus_the_one_being_written():
    cfg = Config.model_validate({"train": {"max_steps": 1000}, "ckpt": {"interval": 100, "keep_last": 2}})
    need = checkpoint_disk_need(cfg, num_params=1_000_000)
    assert need["checkpoints"] == 3
    assert need["checkpoint_bytes"] == 12_000_000 and need["export_bytes"] == 4_000_000
    assert need["total_bytes"] == 3 * 12_000_000 + 4_000_000
    keep_all = Config.model_validate({"train": {"max_steps": 1000}, "ckpt": {"interval": 100, "keep_last": None}})
    assert checkpoint_disk_need(keep_all, 1)["checkpoints"] == 10


def test_disk_passes_warns_and_fails_against_free_space(tmp_path):
    model_dir = tmp_path / "qwen"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(QWEN25_05B))
    cfg = make_config(tmp_path, model={"path": str(model_dir)}, ckpt={"keep_last": 2})
    need = checkpoint_disk_need(cfg, 494_032_768)["total_bytes"]
    assert check_disk(cfg, disk_usage=disk_with(2 * need)).status == PASS
    warn = check_disk(cfg, disk_usage=disk_with(1.2 * need))
    assert warn.status == WARN and "headroom" in warn.message
    fail = check_disk(cfg, disk_usage=disk_with(0.5 * need))
    assert fail.status == FAIL and "ckpt.keep_last (now 2)" in fail.fix and "run.output_dir" in fail.fix
    assert fail.details["num_params"] == 494_032_768


def test_the_process_writer_needs_one_saves_state_in_dev_shm_per_node(tmp_path):
    model_dir = tmp_path / "qwen"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(QWEN25_05B))
    per_checkpoint = checkpoint_disk_need(make_config(tmp_path, model={"path": str(model_dir)}), 494_032_768)
    one = per_checkpoint["checkpoint_bytes"]

    def cfg(**distributed):
        ckpt = {"async_writer": "process"}
        return make_config(tmp_path, model={"path": str(model_dir)}, ckpt=ckpt, distributed=distributed)

    assert check_shared_memory(make_config(tmp_path, model={"path": str(model_dir)})) is None  # the thread writer
    assert check_shared_memory(cfg(), shm_usage=disk_with(2 * one)).status == PASS
    # Docker's default 64 MiB holds no half-billion-parameter model's state: refused before the run, with the fix
    docker = check_shared_memory(cfg(), shm_usage=disk_with(64 << 20))
    assert docker.status == FAIL and "--shm-size" in docker.fix and "ckpt.async_writer = 'thread'" in docker.fix
    assert docker.details["need_bytes"] == one
    # four DDP ranks on the node each stage the whole state; four FSDP ranks a quarter each
    ddp = check_shared_memory(cfg(nproc_per_node=4, strategy="ddp"), shm_usage=disk_with(2 * one))
    assert ddp.status == FAIL and ddp.details["need_bytes"] == 4 * one
    fsdp = check_shared_memory(cfg(nproc_per_node=4, strategy="fsdp"), shm_usage=disk_with(2 * one))
    assert fsdp.status == PASS and fsdp.details["need_bytes"] == one
    two_nodes = check_shared_memory(cfg(nproc_per_node=4, nnodes=2, strategy="fsdp"), shm_usage=disk_with(2 * one))
    assert two_nodes.details["need_bytes"] == one // 2
    assert "shared memory" in [r.name for r in preflight.run_preflight(cfg(), shm_usage=disk_with(64 << 20))]


# ---------------------------------------------------------------- output directory


def test_output_dir_check_leaves_no_run_directory_behind(tmp_path):
    # an empty run directory left by a check would read as a run that never started (`status`, `run` again)
    cfg = make_config(tmp_path, run={"name": "exp1"})
    result = check_output_dir(cfg)
    assert result.status == PASS and "is writable" in result.message
    assert list(tmp_path.iterdir()) == []


def test_output_dir_check_of_an_existing_run_leaves_it_as_it_was(tmp_path):
    run = tmp_path / "runs" / "exp1"
    run.mkdir(parents=True)
    (run / "events.jsonl").write_text("{}\n")
    assert check_output_dir(make_config(tmp_path, run={"name": "exp1"})).status == PASS
    assert [p.name for p in run.iterdir()] == ["events.jsonl"]


def test_preflight_command_creates_no_run_directory(tmp_path):
    from typer.testing import CliRunner

    from prime_train.cli import app

    config = Path(preflight.__file__).resolve().parents[1] / "configs" / "tiny-sft.toml"
    out = tmp_path / "runs"
    result = CliRunner().invoke(app, ["preflight", str(config), "--run.output_dir", str(out), "--json"])
    assert result.exit_code == 0, result.output
    assert "output_dir" in {c["name"] for c in json.loads(result.stdout)}
    assert not out.exists(), "preflight checks the machine; it must not change it"


def test_unwritable_output_dir_fails_naming_the_key(tmp_path):
    # a path under a regular file cannot be created, even by root
    (tmp_path / "a-file").write_text("x")
    cfg = Config.model_validate({"run": {"output_dir": str(tmp_path / "a-file" / "runs")}})
    result = check_output_dir(cfg)
    assert result.status == FAIL and "cannot write the run directory" in result.message
    assert "run.output_dir" in result.fix


# ---------------------------------------------------------------- ports


def test_rendezvous_port_held_by_a_socket_fails_naming_the_process(tmp_path):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        cfg = make_config(tmp_path, distributed={"nnodes": 2, "node_rank": 0, "master_port": port})
        result = check_ports(cfg)
        assert result.status == FAIL and f"port {port} (distributed.master_port) is in use" in result.message
        assert f"pid {os.getpid()}" in result.message
        assert "set distributed.master_port to a free port" in result.fix
    assert check_ports(cfg).status == PASS


def test_single_node_binds_no_fixed_port(tmp_path):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        cfg = make_config(tmp_path, distributed={"nproc_per_node": 2, "master_port": held.getsockname()[1]})
        result = check_ports(cfg)
    assert result.status == PASS and "torchrun picks its own port" in result.message


def test_worker_node_does_not_bind_the_rendezvous_port_of_another_host(tmp_path):
    cfg = make_config(tmp_path, distributed={"nnodes": 2, "node_rank": 1, "rdzv_endpoint": "10.254.254.1:29400"})
    assert preflight.ports_to_bind(cfg) == []


def test_a_node_other_than_0_on_node_0s_host_passes_while_node_0_holds_the_rendezvous_port(tmp_path):
    # two node ranks on one machine: node 1 (re)started while node 0's agent serves the store only connects to it
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        endpoint = f"127.0.0.1:{held.getsockname()[1]}"
        node1 = make_config(tmp_path, distributed={"nnodes": 2, "node_rank": 1, "rdzv_endpoint": endpoint})
        node0 = make_config(tmp_path, distributed={"nnodes": 2, "node_rank": 0, "rdzv_endpoint": endpoint})
        assert check_ports(node1).status == PASS
        assert check_ports(node0).status == FAIL


# ---------------------------------------------------------------- secrets


def test_missing_secrets_are_named_and_present_values_never_printed(tmp_path, monkeypatch, capsys):
    secret = "sk-do-not-print-4f9a1c"
    monkeypatch.setenv("HF_TOKEN", secret)
    monkeypatch.delenv("S3_SECRET", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    cfg = make_config(
        tmp_path,
        supervisor={"required_env": ["HF_TOKEN", "S3_SECRET"]},
        logging={"wandb_project": "demo", "tensorboard": False},
    )
    result = check_secrets(cfg)
    assert result.status == FAIL
    assert result.details["missing"] == ["S3_SECRET", "WANDB_API_KEY"]
    assert "S3_SECRET (supervisor.required_env)" in result.message and "HF_TOKEN" not in result.message
    assert "wandb login" in result.fix

    assert preflight_command(cfg, as_json=True) == 78
    assert preflight_command(cfg, as_json=False) == 78
    out = capsys.readouterr()
    assert secret not in out.out + out.err
    assert secret not in json.dumps(result.to_dict())


def test_wandb_key_is_not_needed_with_a_netrc_entry_or_offline(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    netrc_file = tmp_path / "netrc"
    netrc_file.write_text("machine api.wandb.ai\n  login user\n  password not-a-real-key\n")
    netrc_file.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc_file))
    assert check_secrets(make_config(tmp_path, logging={"wandb_project": "demo"})).status == PASS
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    offline = make_config(tmp_path, logging={"wandb_project": "demo", "wandb_mode": "offline"})
    assert check_secrets(offline).message == "no secrets required"


# ---------------------------------------------------------------- memory fit


def test_memory_fit_passes_warns_and_fails_against_available_ram(tmp_path):
    cfg = make_config(tmp_path)
    hf, _ = model_shape(cfg)
    need = estimate_memory(cfg, hf, on_gpu=False)["per_rank_bytes"]
    assert check_memory_fit(cfg, available_ram=4 * need).status == PASS
    assert check_memory_fit(cfg, available_ram=need / 0.9).status == WARN
    fail = check_memory_fit(cfg, available_ram=need / 2)
    assert fail.status == FAIL and "model.activation_checkpointing" in fail.fix and "train.micro_batch_size" in fail.fix


def test_fsdp_divides_model_states_by_world_size_and_ddp_does_not(tmp_path):
    ddp = make_config(tmp_path, distributed={"nproc_per_node": 8, "strategy": "ddp"})
    fsdp = make_config(tmp_path, distributed={"nproc_per_node": 8, "strategy": "fsdp"})
    n = count_parameters(LLAMA31_8B)
    # fp32 master weights 4 + gradients 4 + AdamW 8, autocast's bf16 weight copy 2, DDP's bucket copy 4
    assert estimate_memory(ddp, LLAMA31_8B, on_gpu=True)["states_bytes"] == n * 22
    sharded = estimate_memory(fsdp, LLAMA31_8B, on_gpu=True)
    # FSDP shards the 16 bytes over 8 ranks; the gathered units (root with embeddings and lm_head, two layers,
    # one unit's gradient, in bf16) come on top: less than a byte per parameter, and far below DDP's 22
    assert sharded["state_shards"] == 8 and n * 16 // 8 < sharded["states_bytes"] < n * 16 // 8 + n
    # preflight reports exactly what `prime-train memory` says
    from prime_train.validator.memory import estimate, inputs_from_config

    report = estimate(inputs_from_config(ddp, model=LLAMA31_8B, gpus_per_node=8, strategy="ddp", gpus=[]))
    est = estimate_memory(ddp, LLAMA31_8B, on_gpu=True)
    assert est["states_bytes"] + est["activation_bytes"] + est[
        "logits_bytes"
    ] == report.trainer.total - report.trainer.get("runtime")


def test_an_8b_model_fails_on_one_80gb_gpu_with_ddp_and_fits_with_fsdp_over_8(tmp_path):
    model_dir = tmp_path / "llama"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(LLAMA31_8B))
    common = {"model": {"path": str(model_dir)}, "data": {"seq_len": 2048}, "train": {"micro_batch_size": 1}}
    gpu = 80 * GIB
    ddp = make_config(tmp_path, distributed={"nproc_per_node": 8, "strategy": "ddp"}, **common)
    assert check_memory_fit(ddp, gpu_run=True, gpu_memory_bytes=gpu).status == FAIL
    fsdp = make_config(tmp_path, distributed={"nproc_per_node": 8, "strategy": "fsdp"}, **common)
    result = check_memory_fit(fsdp, gpu_run=True, gpu_memory_bytes=gpu)
    assert result.status == PASS and "fsdp" in result.message
    assert check_memory_fit(fsdp, gpu_run=True, gpu_memory_bytes=None).status == WARN


def test_activation_checkpointing_lowers_the_estimate(tmp_path):
    plain = make_config(tmp_path, data={"seq_len": 512})
    ac = make_config(tmp_path, data={"seq_len": 512}, model={"activation_checkpointing": True})
    hf, _ = model_shape(plain)
    assert (
        estimate_memory(ac, hf, on_gpu=False)["activation_bytes"]
        < estimate_memory(plain, hf, on_gpu=False)["activation_bytes"]
    )


# ---------------------------------------------------------------- the whole preflight


def test_preflight_on_the_tiny_config_passes_with_exit_0_and_one_line_per_check(tmp_path, capsys):
    cfg = make_config(tmp_path)
    assert preflight_command(cfg, as_json=False) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert [line.split(":")[0] for line in lines[:-1]] == [f"✓ {name}" for name in CHECK_NAMES]
    assert lines[-1] == "preflight: 8 passed, 0 warning(s), 0 failed"


def test_preflight_json_is_a_list_of_checks_and_a_fail_exits_78(tmp_path, capsys):
    (tmp_path / "a-file").write_text("x")
    cfg = Config.model_validate({"run": {"output_dir": str(tmp_path / "a-file")}})
    assert preflight_command(cfg, as_json=True) == 78
    checks = json.loads(capsys.readouterr().out)
    assert [c["name"] for c in checks] == CHECK_NAMES
    assert all(set(c) == {"name", "status", "message", "fix", "details"} for c in checks)
    by_name = {c["name"]: c for c in checks}
    assert by_name["output_dir"]["status"] == FAIL and "run.output_dir" in by_name["output_dir"]["fix"]
    assert all(c["fix"] for c in checks if c["status"] == FAIL)


def test_quiet_pass_prints_only_problems(tmp_path, capsys):
    (tmp_path / "a-file").write_text("x")
    cfg = Config.model_validate({"run": {"output_dir": str(tmp_path / "a-file")}})
    assert preflight_command(cfg, quiet_pass=True) == 78
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("✗ output_dir: ") and "→ set run.output_dir" in lines[0]
    assert not any(line.startswith("✓") for line in lines)


def test_run_preflight_uses_the_injected_probe_for_gpu_memory(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    results = run_preflight(
        make_config(tmp_path), gpu_probe=healthy_probe(1, memory_mib=1.0), disk_usage=disk_with(1e12)
    )
    by_name = {r.name: r for r in results}
    assert by_name["cuda"].status == PASS
    # the tiny model does not fit a 1 MiB GPU: the memory check read the probe's figure, not host RAM
    assert by_name["memory_fit"].status == FAIL and "one GPU's memory" in by_name["memory_fit"].message


def cache_hub_files(cache: Path, repo_id: str, *names: str) -> None:
    """Lay out `names` of `repo_id` in an HF hub cache as huggingface_hub stores them (refs/main -> snapshot)."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    for name in names:
        (snapshot / name).write_text("{}")


@pytest.mark.parametrize("key", ["path", "tokenizer"])
def test_an_uncached_hub_model_fails_preflight_offline_in_seconds(tmp_path, monkeypatch, key):
    from prime_train.validator.preflight import check_model_source

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    result = check_model_source(Config.model_validate({"model": {key: "Qwen/Qwen2.5-0.5B"}}))
    assert result.status == FAIL
    assert (
        f"model.{key} = 'Qwen/Qwen2.5-0.5B'" in result.message
        and "not in the local Hugging Face cache" in result.message
    )
    # a single-name hub id (gpt2) is a hub id: looked up, not refused as a malformed path
    result = check_model_source(Config.model_validate({"model": {key: "gpt2"}}))
    assert result.status == FAIL and "not a hub id" not in result.message and "HF_HUB_OFFLINE" in result.message
    cache_hub_files(tmp_path / "hub", "gpt2", "config.json", "tokenizer_config.json")
    assert check_model_source(Config.model_validate({"model": {key: "gpt2"}})).status == PASS


def test_model_source_that_does_not_exist_fails_with_the_key_and_the_working_directory(tmp_path, monkeypatch):
    from prime_train.validator.preflight import check_model_source

    monkeypatch.chdir(tmp_path)
    missing = Config.model_validate({"model": {"path": "runs/tiny-sft/final"}})
    result = check_model_source(missing)
    assert result.status == FAIL
    assert "model.path = 'runs/tiny-sft/final' does not exist" in result.message and str(tmp_path) in result.fix
    # a hub id in the local HF cache passes, offline too; an existing directory passes
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    cache_hub_files(tmp_path / "hub", "Qwen/Qwen2.5-0.5B", "config.json")
    assert check_model_source(Config.model_validate({"model": {"path": "Qwen/Qwen2.5-0.5B"}})).status == PASS
    (tmp_path / "m").mkdir()
    # an empty directory is not a model: the engine's from_pretrained would refuse it after start-up
    empty = check_model_source(Config.model_validate({"model": {"path": "m"}}))
    assert empty.status == FAIL and "without config.json" in empty.message
    (tmp_path / "m" / "config.json").write_text("{}")
    assert "without weights" in check_model_source(Config.model_validate({"model": {"path": "m"}})).message
    (tmp_path / "m" / "model.safetensors").write_bytes(b"")
    assert check_model_source(Config.model_validate({"model": {"path": "m"}})).status == PASS
    (tmp_path / "f").write_text("x")
    assert check_model_source(Config.model_validate({"model": {"tokenizer": "f"}})).status == FAIL


# ---------------------------------------------------------------- hostile sizes and names


def run_preflight_cli(tmp_path, toml: str) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "hostile.toml"
    path.write_text(toml)  # relative run directories land in tmp_path, the working directory
    # a hang (the parameter count looping over 10**18 layers) shows as TimeoutExpired
    return subprocess.run(
        [sys.executable, "-m", "prime_train", "preflight", str(path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )


@pytest.mark.parametrize(
    ("toml", "key", "says"),
    [
        ("[model]\nnum_layers = 1000000000000000000\n", "model.num_layers", "less than or equal to 4096"),
        ("[model]\nhidden_size = 1099511627776\nnum_heads = 1\n", "model.hidden_size", "less than or equal to"),
        ('[run]\nname = "a\\u0000b"\n', "run.name", "NUL character"),
        ('[run]\noutput_dir = "runs\\u0000x"\n', "run.output_dir", "NUL character"),
        (f'[run]\nname = "{"é" * 200}"\n', "run.name", "400 bytes long; a directory name has at most 255"),
        (f'[run]\noutput_dir = "{"d" * 300}/runs"\n', "run.output_dir", "directory name of 300 bytes"),
    ],
    ids=["layers_1e18", "hidden_1e12", "nul_in_name", "nul_in_output_dir", "name_over_255_bytes", "dir_over_255"],
)
def test_preflight_refuses_hostile_sizes_and_names_naming_the_key(tmp_path, toml, key, says):
    result = run_preflight_cli(tmp_path, toml)
    output = result.stdout + result.stderr
    assert result.returncode == 78, output
    assert "Traceback" not in output and "unexpected" not in output, output
    assert says in result.stderr
    assert f"`{key}`" in result.stderr or key in result.stderr


def test_parameter_count_of_a_config_claiming_absurd_layers_is_refused_at_once(tmp_path):
    from prime_train.validator.param_count import MAX_LAYERS, count_model_parameters

    one = count_parameters({**LLAMA31_8B, "num_hidden_layers": 1})
    two = count_parameters({**LLAMA31_8B, "num_hidden_layers": 2})
    # layers are counted by formula: the largest count allowed is as quick as one layer
    assert count_parameters({**LLAMA31_8B, "num_hidden_layers": MAX_LAYERS}) == one + (MAX_LAYERS - 1) * (two - one)
    for layers in (MAX_LAYERS + 1, 10**12, 10**18, float("inf"), float("nan"), -1):
        with pytest.raises(TypeError, match="num_hidden_layers"):
            count_model_parameters({**LLAMA31_8B, "num_hidden_layers": layers})
    with pytest.raises(TypeError, match="decoder_sparse_step"):
        count_model_parameters({**LLAMA31_8B, "model_type": "qwen2_moe", "num_experts": 4, "decoder_sparse_step": 0})
    # a hub config.json of that kind leaves the size unknown, with the reason, instead of hanging preflight
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({**LLAMA31_8B, "num_hidden_layers": 10**18}))
    hf, why = model_shape(make_config(tmp_path, model={"path": str(tmp_path / "m")}))
    assert hf is None and "num_hidden_layers" in why


def test_sparse_layer_count_by_formula_equals_transformers_with_a_step_and_dense_layers():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from prime_train.validator.param_count import count_model_parameters

    hf = {
        "model_type": "qwen2_moe", "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 7,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 64, "num_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24,
        "decoder_sparse_step": 2, "mlp_only_layers": [3, 4, 99], "tie_word_embeddings": False,
    }  # fmt: skip
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen2MoeConfig(**hf))
    built = {id(p): p.numel() for p in model.parameters()}
    count = count_model_parameters(hf)
    assert count.total == sum(built.values())
    # layers 1 and 5 are sparse (every 2nd, 3 is listed dense): two layers of 4 experts × 3 matrices of 32 × 16
    assert count.parts["experts"] == 2 * 4 * 3 * 32 * 16


# ---------------------------------------------------------------- LoRA


def _packages(monkeypatch, **present: bool) -> None:
    """Which of peft / bitsandbytes the [lora] checks find here (find_spec, never an import)."""
    from prime_train.validator import lora_checks

    real = lora_checks.installed
    monkeypatch.setattr(lora_checks, "installed", lambda m: present.get(m, real(m)))


def _gpu_cuda(monkeypatch, cfg):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    return check_cuda(cfg, gpu_probe=healthy_probe(8))


def test_lora_check_passes_with_peft_and_reports_the_trainable_share(tmp_path):
    from prime_train.validator.lora_checks import check_lora

    cfg = make_config(tmp_path, lora={"rank": 4})
    result = check_lora(cfg, check_cuda(cfg), "none")
    assert result.status == PASS
    assert result.details["trainable_params"] == 23_552 and result.details["total_params"] == 589_440
    assert "23,552 trainable of 589,440 parameters (3.996 %)" in result.message
    assert check_lora(make_config(tmp_path), check_cuda(cfg), "none") is None  # LoRA off: no check
    names = [r.name for r in run_preflight(cfg, disk_usage=disk_with(1e12))]
    assert names == [*CHECK_NAMES[:3], "lora", *CHECK_NAMES[3:]]


def test_lora_without_peft_fails_preflight_with_exit_78_naming_the_extra(tmp_path, monkeypatch, capsys):
    _packages(monkeypatch, peft=False)
    cfg = make_config(tmp_path, lora={"rank": 8})
    by_name = {r.name: r for r in run_preflight(cfg, disk_usage=disk_with(1e12))}
    lora = by_name["lora"]
    assert lora.status == FAIL and "needs the peft package" in lora.message
    assert lora.fix == "pip install 'prime-train[lora]'"
    assert preflight_command(cfg, as_json=True) == 78
    assert any(c["name"] == "lora" and c["status"] == FAIL for c in json.loads(capsys.readouterr().out))


def test_nf4_is_refused_without_cuda_then_without_bitsandbytes_then_sharded(tmp_path, monkeypatch):
    from prime_train.validator.lora_checks import check_lora

    nf4 = {"rank": 16, "quantize": "nf4"}
    cfg = make_config(tmp_path, lora=nf4)
    _packages(monkeypatch, peft=True, bitsandbytes=True)
    on_cpu = check_lora(cfg, check_cuda(cfg), "none")  # this CPU machine: the cuda check's verdict
    assert on_cpu.status == FAIL and "needs a CUDA GPU" in on_cpu.message and "run on a CUDA GPU" in on_cpu.fix
    gpu = _gpu_cuda(monkeypatch, cfg)  # eight healthy H100s, as a replayed inventory would show them
    assert gpu.status == PASS
    assert check_lora(cfg, gpu, "none").status == PASS
    assert check_lora(cfg, gpu, "ddp").status == PASS
    sharded = check_lora(cfg, gpu, "fsdp")
    assert sharded.status == FAIL and "distributed.strategy = 'fsdp'" in sharded.message
    _packages(monkeypatch, peft=True, bitsandbytes=False)
    missing = check_lora(cfg, gpu, "none")
    assert missing.status == FAIL and "bitsandbytes" in missing.message and "prime-train[qlora]" in missing.fix
    # run_preflight resolves the strategy as the engine does: FSDP over one process shards nothing
    _packages(monkeypatch, peft=True, bitsandbytes=True)
    one = make_config(tmp_path, lora=nf4, distributed={"strategy": "fsdp", "nproc_per_node": 1})
    results = {r.name: r for r in run_preflight(one, gpu_probe=healthy_probe(1), disk_usage=disk_with(1e12))}
    assert results["lora"].status == PASS, results["lora"].message


def test_lora_checkpoints_hold_the_adapters_only():
    cfg = Config.model_validate({"lora": {"rank": 16}, "ckpt": {"interval": 100, "keep_last": 2},
                                 "train": {"max_steps": 1000}})  # fmt: skip
    n, adapters = 8_030_261_248, 41_943_040
    whole = checkpoint_disk_need(cfg, n)
    lora = checkpoint_disk_need(cfg, n, adapters)
    assert lora["checkpoints"] == whole["checkpoints"] == 3
    assert lora["checkpoint_bytes"] == adapters * 12 and whole["checkpoint_bytes"] == n * 12
    assert lora["export_bytes"] == (n + adapters) * 4  # the merged model and the adapter beside it
    alone = cfg.model_copy(update={"lora": cfg.lora.model_copy(update={"merge_on_export": False})})
    assert checkpoint_disk_need(alone, n, adapters)["export_bytes"] == adapters * 4


def test_memory_fit_counts_lora_and_offers_it_when_the_whole_model_does_not_fit(tmp_path):
    model_dir = tmp_path / "llama"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(LLAMA31_8B))
    common = {"model": {"path": str(model_dir), "activation_checkpointing": True}, "data": {"seq_len": 2048},
              "train": {"micro_batch_size": 1}}  # fmt: skip
    whole = check_memory_fit(make_config(tmp_path, **common), gpu_run=True, gpu_memory_bytes=80 * GIB)
    assert whole.status == FAIL and "--lora.rank 16: about" in whole.fix
    lora = check_memory_fit(make_config(tmp_path, lora={"rank": 16}, **common), gpu_run=True, gpu_memory_bytes=80 * GIB)
    assert lora.status == PASS and "LoRA: 41.9M trainable" in lora.message
    assert lora.details["trainable_params"] == 41_943_040
    assert lora.details["states_bytes"] < whole.details["states_bytes"] / 3


def test_the_shipped_lora_example_passes_the_memory_check_on_one_80gb_gpu(tmp_path):
    from prime_train.config.loader import load_config

    repo = Path(__file__).resolve().parents[1]
    qwen = repo / "tests" / "data" / "model_configs" / "Qwen2.5-7B-Instruct"  # its hub config.json
    example = str(repo / "configs" / "examples" / "qwen2.5-7b-lora-1gpu.toml")
    cfg = load_config([example], ["--model.path", str(qwen), "--run.output_dir", str(tmp_path)])
    for gpu in (80 * GIB, 81559 * 2**20 * 0.99):  # nominal, and what an H100's probe reports free
        result = check_memory_fit(cfg, gpu_run=True, gpu_memory_bytes=gpu)
        assert result.status == PASS, result.message
    whole = cfg.model_copy(update={"lora": cfg.lora.model_copy(update={"rank": 0})})
    assert check_memory_fit(whole, gpu_run=True, gpu_memory_bytes=80 * GIB).status == FAIL
