"""The vLLM rollout worker: its argv from the config, the backend choice, and the weight-reload path.

vLLM cannot run on this machine (no GPU; its wheels bring a CUDA torch), so the parts that run inside
vLLM are tested around it: the argv it is given, the safetensors it reads, the extension method on a
torch module with vLLM's `load_weights(weights=...)` interface, and the routes over an engine client
with vLLM's two calls.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest
import torch

from prime_train.config.schema import Config
from prime_train.rl.vllm_server import (
    EXTENSION,
    WeightReloadExtension,
    WeightRoutes,
    iter_safetensors,
    version_warning,
    vllm_args,
)
from prime_train.rl.workers import gpu_plan, inference_specs, resolve_backend


def rl_config(**inference) -> Config:
    return Config.model_validate(
        {"run": {"job": "rl", "name": "grpo"}, "model": {"path": "Qwen/Qwen2.5-1.5B-Instruct"}, "inference": inference}
    )


def test_backend_choice():
    auto = rl_config()
    assert resolve_backend(auto, 0, have_vllm=True) == "embedded"  # no GPU
    assert resolve_backend(auto, 8, have_vllm=False) == "embedded"  # no vllm
    assert resolve_backend(auto, 8, have_vllm=True) == "vllm"
    asked = rl_config(backend="vllm")
    with pytest.raises(ValueError, match="needs CUDA GPUs"):
        resolve_backend(asked, 0, have_vllm=True)
    with pytest.raises(ValueError, match="pip install vllm"):
        resolve_backend(asked, 4, have_vllm=False)
    assert resolve_backend(rl_config(backend="embedded"), 8, have_vllm=True) == "embedded"


def test_vllm_workers_are_launched_with_the_server_module_on_their_gpus():
    cfg = rl_config(backend="vllm", num_workers=2, gpus_per_worker=2)
    specs = inference_specs(cfg, "run/config.toml", gpu_plan(cfg, [str(i) for i in range(8)]), have_vllm=True)
    assert [s.argv[2] for s in specs] == ["prime_train.rl.vllm_server"] * 2
    assert specs[1].argv[-4:] == ["--config", "run/config.toml", "--index", "1"]
    assert [s.env["CUDA_VISIBLE_DEVICES"] for s in specs] == ["0,1", "2,3"]
    assert all(s.env["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn" for s in specs)


def test_vllm_args_come_from_the_run_config():
    cfg = rl_config(
        backend="vllm", base_port=9000, max_model_len=4096, max_num_seqs=32, gpu_memory_utilization=0.5,
        gpus_per_worker=2, tool_call_parser="hermes", extra_args=["--enforce-eager"],
    )  # fmt: skip
    args = vllm_args(cfg, 1)
    pairs = dict(zip(args[::2], args[1::2], strict=False))
    assert pairs["--model"] == "Qwen/Qwen2.5-1.5B-Instruct" and pairs["--served-model-name"] == "grpo"
    assert pairs["--port"] == "9001" and pairs["--max-model-len"] == "4096" and pairs["--max-num-seqs"] == "32"
    assert pairs["--gpu-memory-utilization"] == "0.5" and pairs["--tensor-parallel-size"] == "2"
    assert args[args.index("--worker-extension-cls") + 1] == EXTENSION
    assert args[args.index("--tool-call-parser") + 1] == "hermes" and "--enable-auto-tool-choice" in args
    assert args[-1] == "--enforce-eager"
    with pytest.raises(ValueError, match=r"model\.path"):
        vllm_args(Config.model_validate({"inference": {"backend": "vllm"}}), 0)


def test_versions_outside_the_written_range_are_warned():
    assert version_warning((0, 11, 0)) is None and version_warning((0, 10, 2)) is None
    assert "0.9.2" in version_warning((0, 9, 2))
    assert "pin vllm" in version_warning((0, 13, 1))
    assert "not installed" in version_warning(None)


def _tiny_model(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, tie_word_embeddings=False)  # fmt: skip
    return LlamaForCausalLM(cfg)


class ServedModel(torch.nn.Module):
    """Stands in for a vLLM model (which needs a GPU): the same `load_weights(weights=iterable)` interface."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def load_weights(self, weights):
        params = dict(self.inner.named_parameters())
        for name, tensor in weights:
            params[name].data.copy_(tensor)


class Worker(WeightReloadExtension):
    def __init__(self, model):
        self.model_runner = type("Runner", (), {"get_model": lambda _self: model})()


def test_the_extension_loads_sharded_safetensors_in_place(tmp_path):
    new = _tiny_model(1)
    new.save_pretrained(tmp_path / "step-3", max_shard_size="20KB")  # several shards and an index
    assert len(list((tmp_path / "step-3").glob("*.safetensors"))) > 1
    names = {name for name, _ in iter_safetensors(tmp_path / "step-3")}
    assert names == set(new.state_dict())

    served = ServedModel(_tiny_model(2))
    before = served.inner.model.layers[0].self_attn.q_proj.weight.clone()
    loaded = Worker(served).prime_train_load_weights(str(tmp_path / "step-3"))
    assert loaded == len(names)
    for name, p in served.inner.named_parameters():
        assert torch.equal(p, new.state_dict()[name]), name
    assert not torch.equal(before, served.inner.model.layers[0].self_attn.q_proj.weight)
    with pytest.raises(FileNotFoundError, match=r"no \*\.safetensors"):
        next(iter_safetensors(tmp_path))


class Engine:
    """vLLM's EngineClient calls used by the routes, recorded."""

    def __init__(self):
        self.calls = []

    async def collective_rpc(self, method, args=()):
        self.calls.append((method, args))

    async def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache", ()))


def test_update_weights_route_loads_then_resets_the_prefix_cache(tmp_path):
    routes, engine = WeightRoutes(), Engine()
    status, body = asyncio.run(routes.update_weights(engine, {"path": str(tmp_path), "step": 7}))
    assert (status, body) == (200, {"step": 7})
    assert engine.calls == [("prime_train_load_weights", (str(tmp_path),)), ("reset_prefix_cache", ())]
    assert asyncio.run(routes.weights_step()) == (200, {"step": 7})
    status, body = asyncio.run(routes.update_weights(engine, {"path": str(tmp_path / "nope"), "step": 8}))
    assert status == 400 and "does not exist" in body["error"]["message"]
    assert asyncio.run(routes.update_weights(engine, {"step": 8}))[0] == 400
    assert len(engine.calls) == 2, "a refused update touches nothing"


def test_without_vllm_the_server_exits_78_and_says_how_to_install(tmp_path):
    pytest.importorskip("torch")
    if __import__("importlib").util.find_spec("vllm") is not None:
        pytest.skip("vllm is installed here")
    from prime_train.config.loader import dump_toml

    path = tmp_path / "config.toml"
    path.write_text(dump_toml(rl_config(backend="vllm")))
    result = subprocess.run(
        [sys.executable, "-m", "prime_train.rl.vllm_server", "--config", str(path)],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 78 and "pip install vllm" in result.stderr
