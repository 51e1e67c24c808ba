"""The native decoder inside the engine: which model a run trains, its weights, its loss curve, its checkpoints.

engine/llama.py is proven equal to transformers' classes in test_native_model.py; these tests pin how the engine
picks and builds it (model.implementation), that a run's curve does not move when it switches, and that the HF
names keep checkpoints and exports interchangeable.
"""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from transformers import LlamaConfig, LlamaForCausalLM

from prime_train.config.schema import Config, ModelConfig
from prime_train.engine.metrics import EngineConfigError
from prime_train.engine.model import build_model, is_native

VOCAB = 320
IDS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))


def _build(cfg: ModelConfig, *, for_training: bool, seed: int = 0, vocab: int = VOCAB):
    torch.manual_seed(seed)
    return build_model(cfg, vocab, for_training=for_training)


@pytest.mark.parametrize(
    "cfg",
    [
        ModelConfig(),
        ModelConfig(arch="qwen2", num_kv_heads=2, tie_embeddings=False),
        ModelConfig(arch="llama", num_kv_heads=2, tie_embeddings=False, intermediate_size=384),
        ModelConfig(arch="gpt2", num_layers=3),
        ModelConfig(arch="gpt2", tie_embeddings=False),
    ],
    ids=["llama-tied", "qwen2-gqa-untied", "llama-gqa-untied", "gpt2-tied", "gpt2-untied"],
)
def test_training_model_is_native_with_the_weights_and_logits_transformers_would_train(cfg):
    # the random-initialised native model is filled directly (engine/hf_init.py), never through transformers' class:
    # the same numbers from the same seed, and the same draws, so whatever the run draws next is the same too
    hf = _build(cfg, for_training=False)
    after_hf = torch.rand(4)
    native = _build(cfg, for_training=True)
    after_native = torch.rand(4)

    assert is_native(native) and not is_native(hf)
    assert torch.equal(after_native, after_hf)
    assert native.state_dict().keys() == hf.state_dict().keys()
    for name, tensor in hf.state_dict().items():
        assert torch.equal(native.state_dict()[name], tensor), name
    embedding = native.get_input_embeddings().weight
    assert (native.lm_head.weight is embedding) == cfg.tie_embeddings
    assert native.config.to_dict() == hf.config.to_dict()  # what export writes as config.json
    with torch.no_grad():
        torch.testing.assert_close(native(IDS).logits, hf(input_ids=IDS).logits, rtol=1e-5, atol=1e-5)


def test_a_trainer_builds_its_random_initialised_model_without_importing_transformers_model_code():
    # transformers' modeling_llama (and what it pulls in: generation, masking, loss utilities) is about a second of
    # every rank's start-up; a random-initialised run needs it only to export at the end
    code = (
        "import sys, torch\n"
        "from prime_train.config.schema import Config\n"
        "from prime_train.engine.model import flops_per_token, load_model_and_tokenizer\n"
        "tokenizer, model = load_model_and_tokenizer(Config())\n"
        "flops_per_token(model.config, 256)\n"
        "print(sorted(m for m in sys.modules if m.startswith('transformers.models.') and '.modeling_' in m\n"
        "             and not m.startswith('transformers.models.auto.')))\n"  # the name -> class tables only
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_implementation_hf_and_the_generation_side_keep_transformers_model():
    assert not is_native(_build(ModelConfig(implementation="hf"), for_training=True))
    # rl/worker.py decodes with HF's KV cache: build_model without for_training never gives the native model
    assert not is_native(_build(ModelConfig(implementation="native"), for_training=False))


def test_pretrained_path_loads_into_the_native_model_and_grows_the_vocabulary(tmp_path):
    original = _build(ModelConfig(arch="qwen2", num_kv_heads=2), for_training=False)
    original.to(torch.bfloat16).save_pretrained(tmp_path / "saved")

    loaded = _build(ModelConfig(path=str(tmp_path / "saved")), for_training=True, vocab=VOCAB + 64)

    assert is_native(loaded) and loaded.config.model_type == "qwen2"
    assert all(p.dtype == torch.float32 for p in loaded.parameters())
    assert loaded.get_input_embeddings().weight.shape[0] == VOCAB + 64
    for name, tensor in original.state_dict().items():
        assert torch.equal(loaded.state_dict()[name][:VOCAB], tensor[:VOCAB].float()), name


def _dynamic_rope_llama(path) -> None:
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        max_position_embeddings=64, rope_scaling={"rope_type": "dynamic", "factor": 2.0},
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(path)


def test_auto_trains_transformers_model_where_the_native_one_lacks_the_rope_scaling(tmp_path):
    _dynamic_rope_llama(tmp_path / "dyn")
    model = _build(ModelConfig(path=str(tmp_path / "dyn")), for_training=True)
    assert type(model).__name__ == "LlamaForCausalLM"


def test_implementation_native_for_an_unsupported_model_is_a_config_error_naming_the_key(tmp_path):
    _dynamic_rope_llama(tmp_path / "dyn")
    with pytest.raises(EngineConfigError, match=r"model\.implementation = 'native' cannot run 'llama': rope type"):
        _build(ModelConfig(path=str(tmp_path / "dyn"), implementation="native"), for_training=True)


def test_native_with_a_transformers_attention_kernel_is_a_config_error():
    with pytest.raises(EngineConfigError, match=r"model\.attn_implementation = 'eager'"):
        _build(ModelConfig(implementation="native", attn_implementation="eager"), for_training=True)


def test_checkpoint_written_from_the_hf_model_resumes_into_the_native_one(tmp_path):
    # a run from before the native model saved DCP checkpoints of transformers' model: the keys are the same
    def trained(model):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model(input_ids=IDS, labels=IDS).loss.backward()
        opt.step()
        return opt

    hf = _build(ModelConfig(), for_training=False)
    hf_opt = trained(hf)
    model_sd, optim_sd = get_state_dict(hf, hf_opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=tmp_path / "step-1", no_dist=True)

    native = _build(ModelConfig(), for_training=True, seed=1)  # other weights, overwritten by the load
    native_opt = trained(native)
    model_sd, optim_sd = get_state_dict(native, native_opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=tmp_path / "step-1", no_dist=True)
    set_state_dict(native, native_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])

    for name, tensor in hf.state_dict().items():
        assert torch.equal(native.state_dict()[name], tensor), name
    hf_moments = [hf_opt.state[p]["exp_avg"] for p in hf.parameters()]
    native_moments = [native_opt.state[p]["exp_avg"] for p in native.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(hf_moments, native_moments, strict=True))


def _job(tmp_path, implementation: str):
    from prime_train.engine.train import SFTJob

    cfg = Config.model_validate(
        {
            "run": {"name": implementation, "output_dir": str(tmp_path)},
            "model": {"implementation": implementation},
            "train": {"max_steps": 100, "micro_batch_size": 4, "global_batch_size": 8, "warmup_steps": 2},
            "data": {"seq_len": 64, "datasets": [{"task": "reverse-text", "num_examples": 400}]},
            "logging": {"tensorboard": False},
        }
    )
    return SFTJob(cfg)


def test_loss_curves_of_native_and_hf_models_match_on_the_tiny_default(tmp_path):
    curves = {}
    for implementation in ("hf", "native"):
        job = _job(tmp_path, implementation)
        assert is_native(job.model) == (implementation == "native")
        try:
            curves[implementation] = [float(job.train_step()["loss"]) for _ in range(8)]
        finally:
            job.close()
    # same initial weights, same batches; the fused chunked loss and SDPA sum in another order than HF's path
    assert curves["native"] == pytest.approx(curves["hf"], rel=1e-4)
    assert curves["native"][-1] < curves["native"][0]


def _loop_job(tmp_path, data: dict | None = None, **train):
    from prime_train.engine.train import SFTJob

    cfg = Config.model_validate(
        {
            "run": {"name": "loop", "output_dir": str(tmp_path)},
            "train": {"max_steps": 100, "micro_batch_size": 4, "global_batch_size": 8, "eval_interval": 100, **train},
            "data": {"seq_len": 64, "datasets": [{"task": "reverse-text", "num_examples": 400}], **(data or {})},
            "ckpt": {"interval": 100},
            "logging": {"tensorboard": False, "log_interval": 4},
        }
    )
    job = SFTJob(cfg)
    job.stop.startup = False
    return job


def test_steps_between_logging_steps_keep_loss_on_the_device_and_metrics_buffered(tmp_path):
    from prime_train.engine.metrics import read_metrics

    job = _loop_job(tmp_path)
    try:
        m = job.train_step()
        # read only on a logging step: a host float here would be a device-to-host sync every step
        assert isinstance(m["loss"], torch.Tensor) and isinstance(m["grad_norm"], torch.Tensor)
        job.state.step = 0
        for _ in range(3):
            assert job.run_step() is None
        # step 1 (the first of an attempt) is logged at once; 2 and 3 wait in the buffer for step 4
        assert [r["step"] for r in read_metrics(job.run_dir)] == [1]
        assert job.run_step() is None
        rows = read_metrics(job.run_dir)
        assert [r["step"] for r in rows] == [1, 2, 3, 4]
        assert all(isinstance(r["loss"], float) and isinstance(r["grad_norm"], float) for r in rows)
        # throughput from the wall clock between logging steps, on the logging step's row
        assert rows[-1]["tokens_per_s"] > 0 and rows[-1]["step_time_s"] > 0 and "tokens_per_s" not in rows[2]
    finally:
        job.close()


def test_a_non_finite_loss_stops_the_run_at_the_next_logging_step_naming_the_step_it_diverged(tmp_path):
    from prime_train.contract import ExitCode, read_heartbeat

    job = _loop_job(tmp_path)
    try:
        assert job.run_step() is None  # step 1, logged
        with torch.no_grad():
            job.model.model.norm.weight.fill_(float("nan"))
        assert job.run_step() is None  # step 2 diverged, not read yet
        assert job.run_step() is None
        assert job.run_step() == ExitCode.FAILED  # step 4: the logging step reads 2, 3 and 4
        beat = read_heartbeat(job.run_dir.progress_path)
        assert beat.failure == "loss_not_finite"
        assert "not finite at step 2" in beat.reason
    finally:
        job.close()


def test_an_sft_run_with_an_environment_eval_shows_the_environments_eval_keys_on_its_console_line(tmp_path):
    # each job declares the eval metrics of its console line: SFT's include train.eval_environment's reward and pass
    # rate (the loop once listed RL's eval keys and never SFT's environment ones)
    job = _loop_job(tmp_path, max_steps=1, eval_environment="reverse-text")
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("prime_train.engine").addHandler(handler)
    try:
        assert job.fit() == 0
    finally:
        logging.getLogger("prime_train.engine").removeHandler(handler)
        job.close()
    [line] = [line for line in lines if line.startswith("step 1/1 ")]
    for key in ("eval_loss", "eval_exact_match", "eval_env_reward", "eval_env_pass_rate"):
        assert f"| {key} " in line, line


@pytest.fixture
def masks(monkeypatch) -> list:
    """Every attention mask the native Llama builds from here on (None: plain causal, no mask tensor)."""
    from prime_train.engine import llama

    made = []
    real_mask = llama.decoder_mask

    def spy(attention, position_ids, attention_mask):
        made.append(real_mask(attention, position_ids, attention_mask))
        return made[-1]

    monkeypatch.setattr(llama, "decoder_mask", spy)
    return made


def test_a_step_on_rows_of_one_document_each_calls_the_model_without_a_document_mask(tmp_path, masks):
    losses = {}
    for packing in (False, True):
        job = _loop_job(tmp_path / str(packing), data={"packing": packing})
        try:
            masks.clear()
            losses[packing] = float(job.train_step()["loss"])
        finally:
            job.close()
        # two micro-batches: plain causal attention (no mask tensor) exactly where a row holds one document
        assert len(masks) == 2 and all((m is None) != packing for m in masks)
    assert all(0 < loss < 10 for loss in losses.values())


def test_document_masking_off_trains_every_row_plainly_causal_and_evaluates_the_same_way(tmp_path, masks):
    from prime_train.engine.evaluate import eval_loss

    job = _loop_job(tmp_path, data={"document_masking": False})
    try:
        job.train_step()
        assert len(masks) == 2 and all(m is None for m in masks)
        masks.clear()
        # the held-out loss (the greedy samples of an eval attend with their left padding's mask, as always)
        assert eval_loss(job.model, job.eval_batches, job.dist, job._autocast)["eval_loss"] > 0
        assert masks and all(m is None for m in masks)
    finally:
        job.close()
