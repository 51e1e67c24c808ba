"""verify-model and the tested-model registry: exact parameter counts against transformers' own models (built on
the meta device from the same published config.json files), vLLM support from the shipped table, vision-language
detection, tool-calling readiness, the offline path, a local hub server for the online one, and the registry."""

from __future__ import annotations

import hashlib
import http.server
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import ClassVar

import pytest

from prime_train.validator import models, param_count, registry, vllm_compat
from prime_train.validator.model_files import ModelConfigNotFound
from prime_train.validator.models import MXFP4_BYTES_PER_PARAM, TRAIN_BYTES_PER_PARAM, render_report, verify_model
from prime_train.validator.param_count import count_model_parameters, count_parameters
from prime_train.validator.vllm_compat import vllm_support

CONFIGS = Path(__file__).resolve().parent / "data" / "model_configs"
FAMILIES = sorted(p.name for p in CONFIGS.iterdir() if (p / "config.json").is_file())
NO_VLLM = importlib.util.find_spec("vllm") is None

# Published parameter counts (FACTS.md: transformers' own count of each model from its config.json).
PUBLISHED = {
    "Qwen2.5-7B-Instruct": 7_615_616_512,
    "Qwen2.5-0.5B-Instruct": 494_032_768,
    "Llama-3.1-8B": 8_030_261_248,
    "Mistral-7B-v0.1": 7_241_732_096,
}

JSON_KEYS = {
    "architecture", "model_type", "num_parameters", "active_parameters", "vllm_supported", "vllm_min_version",
    "multimodal", "text_only_sibling", "tool_calling", "max_model_len", "dtype", "serve_memory_bytes",
    "train_memory_bytes", "known_issues", "tested", "problems", "ok",
}  # fmt: skip


def config_of(name: str) -> dict:
    return json.loads((CONFIGS / name / "config.json").read_text())


def model_dir(tmp_path: Path, name: str, *, tokenizer_config: dict | None = None, **files: str) -> Path:
    """A local model directory: a fixture's config.json, optionally a tokenizer_config.json and other files."""
    directory = tmp_path / name
    directory.mkdir(parents=True)
    shutil.copy(CONFIGS / name / "config.json", directory / "config.json")
    if tokenizer_config is not None:
        (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    for filename, text in files.items():
        (directory / filename.replace("__", ".")).write_text(text)
    return directory


# A chat template in the common shape: a system block that lists the tools when the request has some.
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these functions:\n{%- for t in tools %}{{ t | tojson }}"
    "{%- endfor %}<|im_end|>\n{%- endif %}{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "<|im_end|>\n{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)
PLAIN_TEMPLATE = (
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


# ---------------------------------------------------------------- parameter counts


@pytest.mark.parametrize(("name", "expected"), sorted(PUBLISHED.items()))
def test_counter_gives_the_published_parameter_counts(name, expected):
    hf = config_of(name)
    assert count_model_parameters(hf).total == expected
    assert count_parameters(hf) == expected  # the total preflight and the memory and cost calculators use


def _meta_model(directory: Path):
    """transformers' model for a config.json, built on the meta device (no memory, no download)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    cfg = transformers.AutoConfig.from_pretrained(str(directory))
    if getattr(cfg, "quantization_config", None) is not None:
        del cfg.quantization_config  # count the architecture, not a quantizer's packing
    with torch.device("meta"):
        try:
            return transformers.AutoModelForCausalLM.from_config(cfg)
        except ValueError:  # vision-language configs have no causal-LM class in transformers 5
            return transformers.AutoModelForImageTextToText.from_config(cfg)


def _unique_parameters(model) -> dict[int, tuple[str, int]]:
    """Parameters by identity, so tied embeddings count once."""
    return {id(p): (name, p.numel()) for name, p in model.named_parameters(remove_duplicate=False)}


@pytest.mark.parametrize("name", FAMILIES)
def test_counter_equals_a_transformers_model_built_from_the_same_config(name):
    model = _meta_model(CONFIGS / name)
    params = _unique_parameters(model)
    count = count_model_parameters(config_of(name))
    assert count.exact
    assert count.total == sum(n for _, n in params.values())
    # The routed experts alone, to check the part the active count is derived from.
    experts = sum(n for pname, n in params.values() if ".mlp.experts." in pname)
    assert count.parts["experts"] == experts


@pytest.mark.parametrize("name", [n for n in FAMILIES if "VL" not in n and n != "gemma-3-4b-it"])
def test_adapters_counted_equal_the_linear_layers_transformers_builds(name):
    """LoRA's adapters (r × (in + out) for each linear layer of the decoder blocks, as engine/lora.py finds them)
    and the linear weights NF4 would hold, counted from config.json alone, against transformers' own model."""
    torch = pytest.importorskip("torch")
    from prime_train.engine.model import decoder_layers

    model = _meta_model(CONFIGS / name)
    linears = [
        (lname, m) for layer in decoder_layers(model) for lname, m in layer.named_modules()
        if isinstance(m, torch.nn.Linear)
    ]  # fmt: skip
    count = param_count.count_adapters(config_of(name), 16)
    assert count.exact and not count.unmatched
    assert count.trainable == sum(16 * (m.in_features + m.out_features) for _, m in linears)
    assert count.linear_params == sum(m.in_features * m.out_features for _, m in linears)
    assert count.linear_names == sorted({lname.rsplit(".", 1)[-1] for lname, _ in linears})
    named = param_count.count_adapters(config_of(name), 8, ["o_proj"])
    assert named.trainable == sum(8 * (m.in_features + m.out_features) for n, m in linears if n.endswith(".o_proj"))


@pytest.mark.parametrize(
    ("name", "published_active_billions"),
    [("Mixtral-8x7B-v0.1", 12.9), ("Qwen3-30B-A3B", 3.3), ("Qwen1.5-MoE-A2.7B", 2.7), ("DeepSeek-V3", 37)],
)
def test_moe_active_parameters_match_the_published_figures(name, published_active_billions):
    count = count_model_parameters(config_of(name))
    assert count.moe and count.active < count.total
    # model cards round (Qwen3-30B-A3B: "3.3B activated", DeepSeek-V3: "37B activated")
    assert count.active / 1e9 == pytest.approx(published_active_billions, rel=0.02)


def test_gpt_oss_active_count_includes_the_input_embedding_that_openai_leaves_out():
    count = count_model_parameters(config_of("gpt-oss-20b"))
    # OpenAI's 3.6B active leaves out the embedding lookup; ours counts everything a token touches
    assert round((count.active - count.parts["embedding"]) / 1e9, 1) == 3.6
    assert count.parts["router"] == 24 * (32 * 2880 + 32)  # gpt-oss's router has a bias


def test_defaults_fill_fields_a_nested_text_config_leaves_out():
    hf = config_of("gemma-3-4b-it")
    assert "num_attention_heads" not in hf["text_config"] and "vocab_size" not in hf["text_config"]
    text = param_count.text_config(hf)
    assert (text["num_attention_heads"], text["num_key_value_heads"], text["vocab_size"]) == (8, 4, 262208)


@pytest.mark.parametrize("model_type", sorted(set(param_count._DEFAULTS) - {"qwen2_vl", "qwen2_5_vl"}))
def test_shipped_defaults_match_the_transformers_config_classes(model_type):
    """The defaults table is what transformers fills in; a new transformers release that changes one fails here."""
    transformers = pytest.importorskip("transformers")
    built = transformers.CONFIG_MAPPING[model_type]()
    derived = {
        "num_key_value_heads": built.num_attention_heads,
        "head_dim": built.hidden_size // built.num_attention_heads,
    }
    for key, value in param_count._DEFAULTS[model_type].items():
        # a field the class leaves unset (or lacks) is derived by the modeling code, as the counter derives it
        expected = getattr(built, key, None)
        if key in derived:
            value, expected = value or derived[key], expected or derived[key]
        if key == "tie_word_embeddings" and expected is None:  # a VL text stack: the outer model owns the head
            expected = transformers.CONFIG_MAPPING[model_type.removesuffix("_text")]().tie_word_embeddings
        assert value == expected, f"{model_type}.{key}"


def test_an_unknown_family_gets_a_flagged_estimate_and_a_config_without_sizes_raises():
    hf = {**config_of("Llama-3.1-8B"), "model_type": "my_llama", "architectures": ["MyLlamaForCausalLM"]}
    count = count_model_parameters(hf)
    assert not count.exact and "not one the counter mirrors" in count.notes[0]
    assert count.total == PUBLISHED["Llama-3.1-8B"]  # Llama-shaped, so the estimate is right here
    with pytest.raises(KeyError):
        count_model_parameters({"model_type": "bert_like", "vocab_size": 10})


# ---------------------------------------------------------------- vLLM support


BRIEF_ARCHITECTURES = [
    "LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM", "Qwen2MoeForCausalLM",
    "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "GemmaForCausalLM", "Gemma2ForCausalLM", "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration", "Phi3ForCausalLM", "GptOssForCausalLM", "DeepseekV3ForCausalLM",
    "Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration", "LlavaForConditionalGeneration",
]  # fmt: skip


def test_shipped_vllm_table_covers_the_common_architectures_with_versions_and_a_date():
    table = vllm_compat.load_vllm_table()
    assert table["checked"] and table["source"]
    for arch in BRIEF_ARCHITECTURES:
        support = vllm_support(arch)
        assert support.supported is True, arch
        assert support.min_version and support.source.startswith("shipped table"), arch
    assert vllm_support("Qwen3ForCausalLM").min_version == "0.8.4"
    mllama = vllm_support("MllamaForConditionalGeneration")
    assert mllama.supported is False and "0.10.2" in mllama.detail
    unknown = vllm_support("MadeUpForCausalLM")
    assert unknown.supported is None and "install vllm" in unknown.detail


def test_an_installed_vllm_registry_overrides_the_table():
    installed = ("0.11.0", {"LlamaForCausalLM", "Qwen2ForCausalLM"})
    assert vllm_support("Qwen2ForCausalLM", installed=installed).supported is True
    refused = vllm_support("GptOssForCausalLM", installed=installed)
    assert refused.supported is False and "vllm 0.11.0" in refused.detail
    assert refused.source == "vllm 0.11.0 (installed)"


@pytest.mark.skipif(not NO_VLLM, reason="vllm is installed: its own registry answers instead of the table")
def test_rl_fails_for_an_architecture_vllm_dropped_and_sft_does_not(tmp_path):
    directory = model_dir(tmp_path, "Llama-3.1-8B")
    hf = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**hf, "architectures": ["Phi3SmallForCausalLM"]}))
    rl = verify_model(str(directory), job="rl")
    assert not rl.ok and rl.vllm_supported is False
    assert any("vLLM does not serve Phi3SmallForCausalLM" in p and "0.9.2" in p for p in rl.problems)
    assert verify_model(str(directory), job="sft").ok


@pytest.mark.skipif(not NO_VLLM, reason="vllm is installed: its own registry answers instead of the table")
def test_an_unknown_architecture_warns_but_does_not_fail(tmp_path):
    directory = model_dir(tmp_path, "Qwen2.5-0.5B-Instruct", tokenizer_config={"chat_template": TOOL_TEMPLATE})
    hf = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**hf, "architectures": ["MyQwenForCausalLM"]}))
    report = verify_model(str(directory), job="rl")
    assert report.ok and report.vllm_supported is None
    assert any("vLLM support unknown" in w for w in report.warnings)


# ---------------------------------------------------------------- vision-language models


def test_a_vision_language_model_is_refused_for_text_rl_with_its_text_only_sibling(tmp_path):
    report = verify_model(str(model_dir(tmp_path, "Qwen2.5-VL-7B-Instruct")), job="rl")
    assert report.multimodal and report.text_only_sibling == "Qwen/Qwen2.5-7B-Instruct"
    assert not report.ok
    assert any("vision-language" in p and "Qwen/Qwen2.5-7B-Instruct" in p for p in report.problems)
    assert report.parameter_parts["vision"] > 0  # the tower is in the count and the memory


def test_gemma3_vision_checkpoint_says_what_to_use_when_no_sibling_exists(tmp_path):
    report = verify_model(str(model_dir(tmp_path, "gemma-3-4b-it")), job="sft")
    assert report.multimodal and report.text_only_sibling is None and not report.ok
    assert any("google/gemma-3-1b-it" in p for p in report.problems)


def test_text_models_are_not_flagged_as_vision_language(tmp_path):
    for name in ("Qwen2.5-7B-Instruct", "gemma-3-1b-it", "gpt-oss-20b"):
        report = verify_model(str(model_dir(tmp_path / name, name)), job="sft")
        assert not report.multimodal and report.text_only_sibling is None, name


# ---------------------------------------------------------------- tool calling


def test_a_template_that_renders_tools_is_tool_ready_with_the_family_parser(tmp_path):
    directory = model_dir(tmp_path, "Qwen2.5-0.5B-Instruct", tokenizer_config={"chat_template": TOOL_TEMPLATE})
    report = verify_model(str(directory), job="rl")
    assert report.chat_template_tools is True and report.tool_call_parser == "hermes"
    assert report.ok and not any("tools" in w for w in report.warnings)


def test_a_template_without_tools_warns_for_rl(tmp_path):
    directory = model_dir(tmp_path, "Qwen2.5-0.5B-Instruct", tokenizer_config={"chat_template": PLAIN_TEMPLATE})
    report = verify_model(str(directory), job="rl")
    assert report.chat_template_tools is False
    assert report.ok  # a warning: not every RL environment calls tools
    assert any("does not render `tools`" in w for w in report.warnings)


def test_a_chat_template_in_its_own_jinja_file_is_read(tmp_path):
    directory = model_dir(tmp_path, "Qwen3-8B", tokenizer_config={}, chat_template__jinja=TOOL_TEMPLATE)
    assert verify_model(str(directory), job="rl").chat_template_tools is True


def test_a_model_without_tokenizer_files_cannot_have_its_template_checked(tmp_path):
    report = verify_model(str(model_dir(tmp_path, "Mistral-7B-v0.1")), job="rl")
    assert report.chat_template_tools is None
    assert any("no tokenizer_config.json" in w for w in report.warnings)


@pytest.mark.parametrize(
    ("name", "parser"),
    [("Llama-3.1-8B", "llama3_json"), ("gpt-oss-20b", "openai"), ("Mistral-7B-v0.1", "mistral"),
     ("Qwen3-30B-A3B", "hermes"), ("DeepSeek-V3", "deepseek_v3"), ("gemma-2-2b", None)],
)  # fmt: skip
def test_tool_call_parser_by_family(name, parser):
    assert vllm_compat.suggest_tool_parser(config_of(name), name)[0] == parser


# ---------------------------------------------------------------- memory, context, dtype


def test_serve_and_train_memory_follow_dtype_and_quantization(tmp_path):
    qwen = verify_model(str(model_dir(tmp_path, "Qwen2.5-7B-Instruct")), job="sft")
    assert qwen.dtype == "bfloat16" and qwen.serve_memory_bytes == 2 * qwen.num_parameters
    assert qwen.train_memory_bytes == TRAIN_BYTES_PER_PARAM * qwen.num_parameters

    gemma = verify_model(str(model_dir(tmp_path, "gemma-2-2b")), job="sft")
    assert gemma.dtype == "float32" and gemma.serve_dtype == "bfloat16"  # vLLM serves fp32 in 16 bits
    assert gemma.serve_memory_bytes == 2 * gemma.num_parameters

    oss = verify_model(str(model_dir(tmp_path, "gpt-oss-20b")), job="sft")
    experts = oss.parameter_parts["experts"]
    assert oss.serve_memory_bytes == int(experts * MXFP4_BYTES_PER_PARAM + (oss.num_parameters - experts) * 2)
    assert 12 << 30 < oss.serve_memory_bytes < 14 << 30  # the ~13 GB of the published MXFP4 checkpoint
    assert oss.active_parameters is not None and oss.active_parameters < oss.num_parameters


def test_context_length_and_rope_scaling_are_reported(tmp_path):
    llama = verify_model(str(model_dir(tmp_path, "Llama-3.1-8B")), job="sft")
    assert llama.max_model_len == 131072 and llama.rope_scaling["rope_type"] == "llama3"
    oss = verify_model(str(model_dir(tmp_path, "gpt-oss-20b")), job="sft")
    assert any("YaRN rope scaling: 4096 × 32.0 = 131072" in n for n in oss.notes)


# ---------------------------------------------------------------- finding the config


def test_offline_without_a_local_copy_says_so_and_asks_for_a_path(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    # a registry model whose config.json prime-train does not ship (Qwen2.5-0.5B-Instruct's it does)
    with pytest.raises(ModelConfigNotFound) as err:
        verify_model("Qwen/Qwen2.5-1.5B-Instruct")
    message = str(err.value)
    assert "not in the local Hugging Face cache" in message and "offline" in message
    assert "local path" in message and str(tmp_path / "hf") in message


def test_offline_reads_a_model_from_the_hf_cache(tmp_path, monkeypatch):
    """A cache laid out as huggingface_hub writes it: refs/main names the snapshot holding the files."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    repo = tmp_path / "hf" / "hub" / "models--Qwen--Qwen3-8B"
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    shutil.copy(CONFIGS / "Qwen3-8B" / "config.json", snapshot / "config.json")
    (snapshot / "tokenizer_config.json").write_text(json.dumps({"chat_template": TOOL_TEMPLATE}))
    report = verify_model("Qwen/Qwen3-8B", job="rl")
    assert report.source.startswith("Hugging Face cache") and report.model_id == "Qwen/Qwen3-8B"
    assert report.num_parameters == 8_190_735_360 and report.chat_template_tools is True
    assert report.tested is not None and report.tested["model_id"] == "Qwen/Qwen3-8B"
    assert report.known_issues == report.tested["known_issues"] and report.known_issues


def test_bad_paths_are_named(tmp_path):
    with pytest.raises(ModelConfigNotFound, match="no directory"):
        verify_model(str(tmp_path / "missing" / "model"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelConfigNotFound, match=r"has no config\.json"):
        verify_model(str(tmp_path / "empty"))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigNotFound, match="not valid JSON"):
        verify_model(str(broken))
    with pytest.raises(ValueError, match="job must be one of sft, rl, pretrain, ppo, dpo, reward, meta, not 'kto'"):
        verify_model(str(model_dir(tmp_path, "Qwen3-0.6B")), job="kto")


class _MiniHub(http.server.BaseHTTPRequestHandler):
    """The two hub routes hf_hub_download uses (HEAD for metadata, GET for the body), for one repository."""

    files: ClassVar[dict[str, bytes]] = {}
    commit = "89abcdef0123456789abcdef0123456789abcdef"

    def _route(self) -> bytes | None:
        prefix = "/test-org/tiny-qwen/resolve/main/"
        if not self.path.startswith("/test-org/tiny-qwen/"):
            self.send_response(404)
            self.send_header("X-Error-Code", "RepoNotFound")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        body = self.files.get(self.path.removeprefix(prefix))
        if body is None:
            self.send_response(404)
            self.send_header("X-Error-Code", "EntryNotFound")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return None
        self.send_response(200)
        self.send_header("X-Repo-Commit", self.commit)
        self.send_header("ETag", '"' + hashlib.sha1(body).hexdigest() + '"')
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        return body

    def do_HEAD(self):
        self._route()

    def do_GET(self):
        body = self._route()
        if body is not None:
            self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_online_fetches_config_and_template_from_a_hub(tmp_path):
    """A hub on 127.0.0.1 (HF_ENDPOINT), in a fresh interpreter: huggingface_hub reads its endpoint at import."""
    _MiniHub.files = {
        "config.json": (CONFIGS / "Qwen2.5-0.5B-Instruct" / "config.json").read_bytes(),
        "tokenizer_config.json": json.dumps({"chat_template": TOOL_TEMPLATE}).encode(),
    }
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _MiniHub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        env = {**os.environ, "HF_ENDPOINT": f"http://127.0.0.1:{server.server_address[1]}",
               "HF_HOME": str(tmp_path / "hf"), "HF_HUB_DISABLE_TELEMETRY": "1", "HF_HUB_DISABLE_XET": "1"}  # fmt: skip
        for key in ("HF_HUB_OFFLINE", "HF_HUB_CACHE", "HF_TOKEN"):
            env.pop(key, None)
        script = (
            "import json, sys\n"
            "from prime_train.validator.models import verify_model, ModelConfigNotFound\n"
            "r = verify_model('test-org/tiny-qwen', job='rl')\n"
            "print(json.dumps(r.to_dict()))\n"
            "try:\n    verify_model('other-org/missing')\nexcept ModelConfigNotFound as e:\n    print('ERR', e)\n"
        )
        run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    finally:
        server.shutdown()
    assert run.returncode == 0, run.stderr
    lines = run.stdout.strip().splitlines()
    report = json.loads(lines[0])
    assert report["source"] == "Hugging Face hub" and report["num_parameters"] == PUBLISHED["Qwen2.5-0.5B-Instruct"]
    assert report["tool_calling"] == {"chat_template_tools": True, "parser": "hermes", "note": None}
    assert lines[1].startswith("ERR other-org/missing was not found on the Hugging Face hub")


def _verify_cli(tmp_path, *args: str, endpoint: str) -> tuple[subprocess.CompletedProcess, float]:
    """`prime-train verify-model ARGS` in a fresh interpreter (huggingface_hub reads HF_ENDPOINT at import),
    with an empty HF cache; returns the result and the seconds it took."""
    import time

    env = {**os.environ, "HF_ENDPOINT": endpoint, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_DISABLE_TELEMETRY": "1"}
    for key in ("HF_HUB_OFFLINE", "HF_HUB_CACHE", "HF_TOKEN", "HTTPS_PROXY", "HTTP_PROXY", "https_proxy", "http_proxy"):
        env.pop(key, None)
    start = time.monotonic()
    run = subprocess.run([sys.executable, "-m", "prime_train", "verify-model", *args], env=env, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    return run, time.monotonic() - start


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_hub_is_called_offline_at_once_not_a_missing_config(tmp_path):
    """Connection refused (the machine is offline, or HF_ENDPOINT points nowhere): no retries for ~25 s, and the
    error says offline / hub unreachable and what to do, in the JSON too; not "has no config.json on the hub"."""
    run, seconds = _verify_cli(tmp_path, "Qwen/Qwen2.5-1.5B-Instruct", "--json",
                               endpoint=f"http://127.0.0.1:{_closed_port()}")  # fmt: skip
    assert run.returncode == 78, run.stdout + run.stderr
    error = json.loads(run.stdout)["error"]
    assert error.startswith("offline / hub unreachable: 127.0.0.1:") and "has no config.json" not in error
    assert "pass a local model directory" in error.lower() and "hf download Qwen/Qwen2.5-1.5B-Instruct" in error
    assert "Retrying" not in run.stderr, "huggingface_hub's retries never started"
    assert seconds < 15, f"took {seconds:.1f} s"  # main took ~25 s retrying


def test_a_hub_that_accepts_but_never_answers_is_unreachable_after_one_probe(tmp_path):
    """A black hole (a TCP listener that never answers): one HEAD within the probe's timeout, then the error."""
    import socket

    from prime_train.validator.model_files import PROBE_TIMEOUT_S

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    accepted: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    try:
        run, seconds = _verify_cli(tmp_path, "Qwen/Qwen2.5-1.5B-Instruct",
                                   endpoint=f"http://127.0.0.1:{listener.getsockname()[1]}")  # fmt: skip
    finally:
        listener.close()
        for conn in accepted:
            conn.close()
    assert run.returncode == 78, run.stdout + run.stderr
    assert "offline / hub unreachable" in run.stderr and f"no answer within {PROBE_TIMEOUT_S:g} s" in run.stderr
    assert len(accepted) == 1, "one probe, no download attempts"
    assert seconds < PROBE_TIMEOUT_S + 8


def test_a_config_without_sizes_still_reports_its_architecture_and_vllm_support(tmp_path, monkeypatch):
    """An architecture the counter does not know, whose config.json lacks intermediate_size: the report names it
    and what vLLM says of it, leaves the size out with a warning saying why; it is not an error."""
    directory = tmp_path / "new-arch"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({
        "architectures": ["BrandNewForCausalLM"], "model_type": "brand_new", "hidden_size": 256,
        "num_hidden_layers": 4, "num_attention_heads": 4, "vocab_size": 1000, "torch_dtype": "bfloat16",
    }))  # fmt: skip
    report = verify_model(str(directory), job="sft")
    assert report.architecture == "BrandNewForCausalLM" and report.model_type == "brand_new"
    assert report.num_parameters is None and report.serve_memory_bytes is None and report.train_memory_bytes is None
    assert any("parameter count unknown" in w and "intermediate_size" in w for w in report.warnings)
    if NO_VLLM:
        assert report.vllm_supported is None  # the shipped table does not list it: unknown, not refused
    monkeypatch.setattr(models, "installed_vllm_archs", lambda: ("0.11.0", {"LlamaForCausalLM"}))
    rl = verify_model(str(directory), job="rl")
    assert rl.vllm_supported is False and not rl.ok
    assert any("vLLM does not serve BrandNewForCausalLM" in p for p in rl.problems)
    data = json.loads(json.dumps(rl.to_dict()))
    assert data["architecture"] == "BrandNewForCausalLM" and data["vllm_supported"] is False
    assert "error" not in data and data["num_parameters"] is None
    from rich.console import Console

    console = Console(record=True, width=200)
    render_report(rl, console)
    text = console.export_text()
    assert "BrandNewForCausalLM" in text and "unknown" in text and "not usable" in text

    run = subprocess.run([sys.executable, "-m", "prime_train", "verify-model", str(directory), "--json", "--job",
                          "sft"], capture_output=True, text=True, timeout=120)  # fmt: skip
    cli = json.loads(run.stdout)
    assert cli["architecture"] == "BrandNewForCausalLM" and "error" not in cli, run.stdout + run.stderr


# ---------------------------------------------------------------- the JSON and the table


def test_to_dict_has_the_cli_json_shape(tmp_path):
    report = verify_model(str(model_dir(tmp_path, "Qwen3-30B-A3B", tokenizer_config={"chat_template": TOOL_TEMPLATE})))
    data = json.loads(json.dumps(report.to_dict()))
    assert set(data) >= JSON_KEYS
    assert set(data["tool_calling"]) == {"chat_template_tools", "parser", "note"}
    assert data["ok"] is report.ok is True and data["problems"] == []
    assert data["active_parameters"] < data["num_parameters"] == 30_532_122_624
    assert data["tested"]["model_id"] == "Qwen/Qwen3-30B-A3B"
    dense = verify_model(str(model_dir(tmp_path, "Qwen3-0.6B"))).to_dict()
    assert dense["active_parameters"] is None  # only MoE models have one


def test_render_report_prints_facts_problems_and_verdict(tmp_path):
    from rich.console import Console

    console = Console(record=True, width=200)
    render_report(verify_model(str(model_dir(tmp_path, "Qwen2.5-VL-7B-Instruct"))), console)
    out = console.export_text()
    assert "Qwen2_5_VLForConditionalGeneration" in out and "8.29 B (8,292,166,656)" in out
    assert "text-only: Qwen/Qwen2.5-7B-Instruct" in out
    assert "problem:" in out and "not usable for rl" in out


def test_verify_model_runs_without_importing_torch(tmp_path):
    directory = model_dir(tmp_path, "gpt-oss-20b")
    script = (
        "import sys\nfrom prime_train.validator.models import verify_model\n"
        f"r = verify_model({str(directory)!r}, job='sft')\n"
        "assert r.num_parameters == 20914757184, r.num_parameters\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


# ---------------------------------------------------------------- registry


def test_registry_loads_and_every_entry_has_the_required_keys():
    doc = registry.load_registry()
    assert "nobody has served or trained" in doc["note"]
    assert len(doc["models"]) >= 8
    table = vllm_compat.load_vllm_table()["architectures"]
    for entry in doc["models"]:
        assert set(registry.REQUIRED_KEYS) <= set(entry), entry.get("model_id")
        for issue in entry["known_issues"]:
            assert issue["issue"] and ("source" in issue)
        # an entry never asks for an older vLLM than the one that added its architecture
        since = table[entry["architecture"]]["since"]
        assert not models._older(entry["vllm_version"].lstrip(">="), since), entry["model_id"]


def test_registry_lookup_by_id_and_by_bare_name():
    assert registry.lookup("openai/gpt-oss-20b")["family"] == "gpt-oss"
    assert registry.lookup("QWEN/qwen3-8b")["model_id"] == "Qwen/Qwen3-8B"
    assert registry.lookup("Qwen3-8B")["model_id"] == "Qwen/Qwen3-8B"  # a local directory's name
    assert registry.lookup("someone/Qwen3-8B") is None  # a fork is not the tested model
    assert registry.lookup("not-a-model") is None and registry.lookup(None) is None


def test_registry_rejects_a_malformed_entry_by_name():
    with pytest.raises(registry.RegistryError, match=r"models\[1\] \(x/y\) lacks tested_on"):
        registry._validate(
            {"models": [{k: [] if k == "known_issues" else "a" for k in registry.REQUIRED_KEYS},
                        {"model_id": "x/y", "family": "f", "vllm_version": "1", "transformers_version": "1",
                         "known_issues": []}]}
        )  # fmt: skip


def test_models_json_and_the_models_table():
    from rich.console import Console

    data = json.loads(json.dumps(registry.models_json()))
    assert data["note"] and [m["model_id"] for m in data["models"]] == [
        m["model_id"] for m in registry.load_registry()["models"]
    ]
    console = Console(record=True, width=250)
    registry.render_models(console)
    out = console.export_text()
    for entry in data["models"]:
        assert entry["model_id"] in out
    assert "nobody has served or trained" in out


# ---------------------------------------------------------------- LoRA when full fine-tuning does not fit


def test_lora_is_offered_with_its_figure_when_full_fine_tuning_does_not_fit(tmp_path):
    llama = verify_model(str(model_dir(tmp_path, "Llama-3.1-8B")), job="sft")  # held against one H100
    assert llama.ok  # an offer, not a problem
    [offer] = [w for w in llama.warnings if "full fine-tuning" in w]
    assert "--lora.rank 16" in offer and "41,943,040 trainable" in offer and "which fits" in offer
    assert llama.lora_trainable_parameters == 41_943_040
    assert llama.lora_train_memory_bytes == 8_030_261_248 * 4 + 41_943_040 * 16  # fp32 base + the adapters' states
    assert llama.qlora_train_memory_bytes < llama.lora_train_memory_bytes < 80 << 30 < llama.train_memory_bytes
    assert llama.train_gpu == {
        "gpu": "H100 SXM", "count": 1, "memory_bytes": 81559 << 20, "full_fits": False, "lora_fits": True,
        "qlora_fits": True,
    }  # fmt: skip
    data = llama.to_dict()
    assert data["lora_train_memory_bytes"] == llama.lora_train_memory_bytes and "lora" in data["memory_assumptions"]

    eight = verify_model(str(tmp_path / "Llama-3.1-8B"), job="sft", gpu="H100:8")  # FSDP over 8: 15 GiB a GPU
    assert eight.train_gpu["full_fits"] and not any("full fine-tuning" in w for w in eight.warnings)
    small = verify_model(str(model_dir(tmp_path, "Qwen3-0.6B")), job="sft")
    assert small.train_gpu["full_fits"] and not any("full fine-tuning" in w for w in small.warnings)
    with pytest.raises(ValueError, match="unknown GPU"):
        verify_model(str(tmp_path / "Llama-3.1-8B"), job="sft", gpu="Z9000")


def test_verify_model_cli_takes_the_gpu_and_shows_the_lora_row(tmp_path):
    directory = model_dir(tmp_path, "Qwen2.5-7B-Instruct")
    run = subprocess.run(
        [sys.executable, "-m", "prime_train", "verify-model", str(directory), "--job", "sft", "--gpu", "A100-40GB"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "with LoRA (rank 16)" in run.stdout and "40,370,176 trainable" in run.stdout
    assert "more than the 40.0 GiB of one A100 40GB" in " ".join(run.stdout.split())
    bad = subprocess.run(
        [sys.executable, "-m", "prime_train", "verify-model", str(directory), "--gpu", "cpu"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert bad.returncode == 78 and "--gpu names a GPU type" in bad.stderr


def test_the_shipped_configs_are_the_hubs_files_in_tests_data():
    shipped = json.loads((Path(registry.__file__).parent / "data" / "model_configs.json").read_text(encoding="utf-8"))[
        "configs"
    ]
    assert shipped, "no shipped configs"
    for model_id, config in shipped.items():
        assert registry.lookup(model_id) is not None, f"{model_id} is not a registry model"
        assert config == config_of(model_id.split("/")[1]), model_id


def test_a_registry_model_offline_and_uncached_is_verified_from_its_shipped_config(tmp_path, monkeypatch):
    # the trial: `verify-model` of a registry model offline exited 78 instead of showing what the registry knows
    from typer.testing import CliRunner

    from prime_train.cli import app

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    result = CliRunner().invoke(app, ["verify-model", "Qwen/Qwen2.5-0.5B-Instruct", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["num_parameters"] == 494_032_768 and report["tested"]["model_id"] == "Qwen/Qwen2.5-0.5B-Instruct"
    # a registry model whose config.json is not shipped: bad input still, with the registry's entry said
    result = CliRunner().invoke(app, ["verify-model", "Qwen/Qwen2.5-1.5B-Instruct"])
    assert result.exit_code == 78
    assert "HF_HUB_OFFLINE" in result.stderr and "tested-model registry: family qwen2.5" in result.stderr, result.stderr
