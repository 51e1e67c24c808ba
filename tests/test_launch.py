"""How the engine is started: argv planning and exit-code recovery (torch-free)."""

from __future__ import annotations

import re
import sys
import time

from prime_train.config.loader import ENV_CONFIG_SECRETS
from prime_train.config.schema import Config
from prime_train.contract import ENV_ATTEMPT, ENV_RUN_DIR, ENV_SUPERVISOR, Heartbeat
from prime_train.kit.redact import MaskedConfig
from prime_train.launch import job_environment, job_exit_code, masked_run_config, plan_engine_launch


def test_single_process_runs_python_module_without_torchrun():
    plan = plan_engine_launch(Config(), "runs/x/config.toml")
    assert plan.argv == [sys.executable, "-m", "prime_train.engine.train", "--config", "runs/x/config.toml"]
    assert not plan.uses_torchrun and plan.world_size == 1


def test_each_job_runs_as_its_own_module():
    rl = Config.model_validate({"run": {"job": "rl"}})
    assert plan_engine_launch(rl, "c.toml").argv[2] == "prime_train.rl.train"
    pretrain = Config.model_validate({"run": {"job": "pretrain"}})
    assert plan_engine_launch(pretrain, "c.toml").argv[2] == "prime_train.engine.train"


def test_two_processes_use_standalone_torchrun_with_console_from_rank0_only():
    cfg = Config.model_validate({"distributed": {"nproc_per_node": 2}})
    plan = plan_engine_launch(cfg, "c.toml", log_dir="logs/x")
    assert plan.argv[1:4] == ["-m", "torch.distributed.run", "--nproc-per-node=2"]
    assert "--standalone" in plan.argv
    assert "--local-ranks-filter=0" in plan.argv
    assert "--log-dir=logs/x" in plan.argv
    assert plan.argv[-3:] == ["prime_train.engine.train", "--config", "c.toml"]
    assert plan.world_size == 2 and plan.uses_torchrun


def test_multi_node_rendezvous_comes_from_skypilot_environment(monkeypatch):
    monkeypatch.setenv("SKYPILOT_NODE_IPS", "10.0.0.7\n10.0.0.8\n")
    monkeypatch.setenv("SKYPILOT_NODE_RANK", "1")
    monkeypatch.setenv("SKYPILOT_TASK_ID", "sky-task-42")
    cfg = Config.model_validate({"distributed": {"nproc_per_node": 8, "nnodes": 2, "master_port": 29511}})
    plan = plan_engine_launch(cfg, "c.toml")
    assert "--standalone" not in plan.argv
    assert "--nnodes=2" in plan.argv
    assert "--node-rank=1" in plan.argv
    assert "--rdzv-backend=static" in plan.argv
    assert "--rdzv-endpoint=10.0.0.7:29511" in plan.argv
    assert "--rdzv-id=sky-task-42" in plan.argv
    assert plan.world_size == 16


def test_config_rendezvous_wins_over_skypilot(monkeypatch):
    monkeypatch.setenv("SKYPILOT_NODE_IPS", "10.0.0.7")
    cfg = Config.model_validate(
        {"distributed": {"nproc_per_node": 1, "nnodes": 2, "node_rank": 0, "rdzv_endpoint": "head:1234"}}
    )
    plan = plan_engine_launch(cfg, "c.toml")
    assert "--rdzv-endpoint=head:1234" in plan.argv and "--node-rank=0" in plan.argv


# What each rank reports: its global rank, and the node it was started on (the NODE variable its torchrun got)
REPORT_RANK = (
    "import json, os, sys, torch.distributed as dist\n"
    "dist.init_process_group('gloo')\n"
    "out = {'rank': dist.get_rank(), 'node': int(os.environ['NODE']), 'local': int(os.environ['LOCAL_RANK'])}\n"
    "dist.barrier()\n"
    "print('RANK ' + json.dumps(out), flush=True)\n"
    "dist.destroy_process_group()\n"
)


def test_global_rank_0_is_on_node_0_whichever_node_arrives_first(tmp_path):
    """Two nodes on one machine (two torchruns on 127.0.0.1), node 1 started well before node 0: c10d would have
    made node 1 hold rank 0; the plan's rendezvous numbers ranks by node rank."""
    import os
    import subprocess

    from enginetools import free_port

    script = tmp_path / "report_rank.py"
    script.write_text(REPORT_RANK)
    port = free_port()
    procs = []
    for node in (1, 0):
        cfg = Config.model_validate(
            {"distributed": {"nproc_per_node": 2, "nnodes": 2, "node_rank": node, "join_timeout_s": 60,
                             "rdzv_endpoint": f"127.0.0.1:{port}"}}
        )  # fmt: skip
        argv = plan_engine_launch(cfg, "c.toml").argv
        argv = [a for a in argv[: argv.index("-m", 2)] if a != "--local-ranks-filter=0"] + [str(script)]
        env = dict(os.environ, NODE=str(node), OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        if node == 1:
            time.sleep(3)  # node 1 is first at the rendezvous
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    import json

    # two local ranks share torchrun's stdout: one's line can land inside the other's, so match, don't split
    seen = [json.loads(found) for out in outputs for found in re.findall(r"RANK (\{[^}]*\})", out)]
    assert sorted(r["rank"] for r in seen) == [0, 1, 2, 3], outputs
    for r in seen:
        assert r["rank"] == r["node"] * 2 + r["local"], seen


def test_gpu_count_follows_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    plan = plan_engine_launch(Config(), "c.toml")
    assert "--nproc-per-node=3" in plan.argv


def test_torchrun_exit_1_is_read_back_as_the_jobs_own_code():
    start = time.time()

    def hb(phase: str, code: int, when: float) -> Heartbeat | None:
        return Heartbeat.from_dict({"step": None, "phase": phase, "exit_code": code, "time": when})

    assert job_exit_code(1, hb("stopped", 75, start + 1), start) == 75
    assert job_exit_code(1, hb("failed", 78, start + 1), start) == 78
    # a heartbeat from an earlier attempt is not evidence
    assert job_exit_code(1, hb("stopped", 75, start - 10), start) == 1
    assert job_exit_code(-9, None, start) == -9
    assert job_exit_code(0, hb("failed", 78, start + 1), start) == 0


# ---------------------------------------------------------------- the job's environment


def test_a_jobs_environment_holds_the_contracts_variables_and_the_config_secrets(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONUNBUFFERED", "0")  # the job's output must reach its log as written, whatever was set
    secret = "served-api-key-1234567"
    cfg = Config.model_validate(
        {"run": {"output_dir": "runs", "name": "env"}, "inference": {"extra_args": ["--api-key", secret]}}
    )
    env = job_environment(cfg, cfg.layout, attempt=3, supervisor_token="123:456.5", launch_env={})
    assert env[ENV_RUN_DIR] == str(tmp_path / "runs" / "env")  # absolute: a job may run in another directory
    assert env[ENV_ATTEMPT] == "3" and env[ENV_SUPERVISOR] == "123:456.5"
    assert env["PYTHONUNBUFFERED"] == "1"
    # the real values of config.toml's ***, exactly as the config file the child reads was masked
    assert env[ENV_CONFIG_SECRETS] == masked_run_config(cfg).env[ENV_CONFIG_SECRETS]
    assert secret in env[ENV_CONFIG_SECRETS]
    # the supervisor masks with its own redactor: the environment restores what that one masked
    unmasked = MaskedConfig(text="", secrets=[])
    assert ENV_CONFIG_SECRETS not in job_environment(
        cfg, cfg.layout, attempt=1, supervisor_token="1:2.0", launch_env={}, masked=unmasked
    )


def test_the_launch_plans_variables_yield_to_the_users_and_to_extra(tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # exported by the user: kept
    monkeypatch.delenv("MALLOC_ARENA_MAX", raising=False)
    monkeypatch.setenv("CUDA_DEVICE_ORDER", "FASTEST_FIRST")  # GPU numbers are NVML's, as CUDA_VISIBLE_DEVICES's
    cfg = Config.model_validate({"run": {"output_dir": str(tmp_path), "name": "env"}})
    launch = {"OMP_NUM_THREADS": "8", "MALLOC_ARENA_MAX": "2", "PYTHONUNBUFFERED": "0", "GIVEN": "plan"}
    extra = {"GIVEN": "extra", "CUDA_VISIBLE_DEVICES": "4,5"}
    env = job_environment(cfg, cfg.layout, attempt=1, supervisor_token="1:2.0", launch_env=launch, extra=extra)
    assert env["OMP_NUM_THREADS"] == "3" and env["MALLOC_ARENA_MAX"] == "2"
    assert env["PYTHONUNBUFFERED"] == "1" and env["GIVEN"] == "extra" and env["CUDA_VISIBLE_DEVICES"] == "4,5"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert ENV_CONFIG_SECRETS not in env  # no secret in this config: nothing to restore
    chosen = job_environment(
        cfg, cfg.layout, attempt=1, supervisor_token="1:2.0", launch_env={}, extra={"CUDA_DEVICE_ORDER": "X"}
    )
    assert chosen["CUDA_DEVICE_ORDER"] == "X"


def test_an_external_command_gets_no_launch_plan_variables(tmp_path):
    cfg = Config.model_validate({"run": {"output_dir": str(tmp_path), "name": "env"}})
    env = job_environment(cfg, cfg.layout, attempt=2, supervisor_token="1:2.0", launch_env=None, extra={"A": "b"})
    assert set(env) == {"PYTHONUNBUFFERED", ENV_RUN_DIR, ENV_ATTEMPT, ENV_SUPERVISOR, "A"}


def test_cpu_threads_are_the_cores_free_at_launch_unless_the_user_says(monkeypatch):
    # the trial: at load average 5 on 2 cores torch's 2 threads a process tripled the CPU time of a step
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(8)), raising=False)
    monkeypatch.setattr("os.getloadavg", lambda: (5.2, 4.0, 3.0))
    one = plan_engine_launch(Config(), "c.toml")
    assert one.env["OMP_NUM_THREADS"] == "3" and one.threads[1].startswith("3 of 8 cores free (load average 5.2)")
    two = plan_engine_launch(Config.model_validate({"distributed": {"nproc_per_node": 2}}), "c.toml")
    assert two.env["OMP_NUM_THREADS"] == "1" and "split between 2 processes" in two.threads[1]
    monkeypatch.setattr("os.getloadavg", lambda: (40.0, 40.0, 40.0))  # a saturated machine: one thread, never 0
    assert plan_engine_launch(Config(), "c.toml").env["OMP_NUM_THREADS"] == "1"
    monkeypatch.setattr("os.getloadavg", lambda: (0.0, 0.0, 0.0))
    assert plan_engine_launch(Config(), "c.toml").env["OMP_NUM_THREADS"] == "8"
    # chosen for the run: its trainers share them with other runs' (prime_train/cpu_share.py); else the user's
    assert plan_engine_launch(Config(), "c.toml").env["PRIME_TRAIN_THREADS"] == "auto"
    chosen = plan_engine_launch(Config.model_validate({"train": {"threads": 2}}), "c.toml")
    assert (chosen.env["OMP_NUM_THREADS"], chosen.threads[1]) == ("2", "train.threads")
    assert "PRIME_TRAIN_THREADS" not in chosen.env
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert plan_engine_launch(Config(), "c.toml").threads == (5, "OMP_NUM_THREADS=5 exported")
    assert "PRIME_TRAIN_THREADS" not in plan_engine_launch(Config(), "c.toml").env
