"""`prime-train cost`: hand-computed arithmetic, the engine's FLOPs and batch ramp, price files and their errors."""

from __future__ import annotations

import json

import pytest
from rich.console import Console

from prime_train.config.schema import Config
from prime_train.validator.cost import (
    CostInputError,
    duration,
    estimate_cost,
    flops_per_token,
    gpu_to_measure,
    render_cost,
    total_sequences,
    usd,
)
from prime_train.validator.model_shape import model_shape
from prime_train.validator.prices import load_prices

# hidden 512, 2 layers, 8 heads of 64, MLP 1024, vocab 1000, tied: parameters by hand
#   embedding 1000·512 = 512,000; per layer q,k,v,o 4·512² = 1,048,576 + gate,up,down 3·512·1024 = 1,572,864
#   + two norms 1,024 = 2,622,464; × 2 layers = 5,244,928; final norm 512  → 5,757,440
SMALL = {
    "model_type": "llama",
    "hidden_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "intermediate_size": 1024,
    "vocab_size": 1000,
    "tie_word_embeddings": True,
}
SMALL_PARAMS = 5_757_440


def _config(tmp_path, **train) -> Config:
    model_dir = tmp_path / "small"
    model_dir.mkdir(exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(SMALL))
    return Config.model_validate(
        {
            "model": {"path": str(model_dir)},
            "data": {"seq_len": 1000},
            "train": {"max_steps": 300, "global_batch_size": 50, "micro_batch_size": 5, **train},
            "distributed": {"nproc_per_node": 4},
        }
    )


def _write_prices(path, providers: dict, **top) -> str:
    path.write_text(json.dumps({"as_of": "2030-01-02", "providers": providers, **top}))
    return str(path)


def test_cost_arithmetic_by_hand(tmp_path):
    cfg = _config(tmp_path)
    prices = _write_prices(tmp_path / "p.json", {"mycloud": {"prices": {"A100 80GB": {"on_demand": 2.0, "spot": 0.5}}}})
    report = estimate_cost(cfg, gpu="A100-80GB", mfu=0.25, prices_file=prices)

    flops = 6 * SMALL_PARAMS + 12 * 2 * 8 * 64 * 1000  # 46,832,640 per token
    assert report.num_params == SMALL_PARAMS
    assert report.flops_per_token == flops
    assert (report.steps, report.num_gpus, report.total_tokens) == (300, 4, 300 * 50 * 1000)
    (row,) = report.rows
    step = 50 * 1000 * flops / (4 * 312e12 * 0.25)
    assert row.step_time_s[1] == pytest.approx(step, rel=1e-12)
    # MFU 0.25 ± 0.1: the fast end at 0.35, the slow end at 0.15
    assert row.step_time_s[0] == pytest.approx(step * 0.25 / 0.35, rel=1e-12)
    assert row.step_time_s[2] == pytest.approx(step * 0.25 / 0.15, rel=1e-12)
    hours = 300 * step / 3600
    assert row.wall_hours[1] == pytest.approx(hours, rel=1e-12)
    assert row.gpu_hours[1] == pytest.approx(4 * hours, rel=1e-12)
    mine = next(p for p in row.providers if p.provider == "mycloud")
    assert mine.on_demand_usd[1] == pytest.approx(4 * hours * 2.0, rel=1e-12)
    assert mine.spot_usd[2] == pytest.approx(4 * 300 * step * 0.25 / 0.15 / 3600 * 0.5, rel=1e-12)
    assert mine.as_of == "2030-01-02"

    measured = estimate_cost(cfg, gpu="A100 80GB", step_time_s=2.0, prices_file=prices)
    (row,) = measured.rows
    assert row.wall_hours == pytest.approx((300 * 1.8 / 3600, 300 * 2.0 / 3600, 300 * 2.2 / 3600))
    assert next(p for p in row.providers if p.provider == "mycloud").spot_usd[1] == pytest.approx(
        4 * 300 * 2.0 / 3600 * 0.5
    )


def test_flops_per_token_is_the_engines(tmp_path):
    pytest.importorskip("torch")
    from transformers import AutoConfig

    from prime_train.engine.model import flops_per_token as engine_flops

    for overrides in ({}, {"tie_embeddings": False}, {"arch": "qwen2", "num_kv_heads": 2}):
        cfg = Config.model_validate({"model": {"hidden_size": 64, "num_layers": 3, "num_heads": 4, **overrides}})
        hf, _ = model_shape(cfg)
        config = AutoConfig.for_model(**hf)
        assert flops_per_token(hf, 96) == engine_flops(config, 96), overrides


def test_batch_ramp_follows_the_engine():
    pytest.importorskip("torch")
    from prime_train.engine.schedule import batch_size_at

    cfg = Config.model_validate(
        {
            "train": {
                "max_steps": 40,
                "global_batch_size": 64,
                "micro_batch_size": 4,
                "batch_ramp_tokens": 20000,
                "batch_ramp_start": 8,
            }
        }
    )
    seq_len, world = 128, 2
    tokens, engine_total = 0, 0
    for _ in range(cfg.train.max_steps):
        batch = batch_size_at(tokens, cfg.train, seq_len, world)
        engine_total += batch
        tokens += batch * seq_len
    ours = total_sequences(cfg.train, seq_len, world)
    assert ours == engine_total
    assert ours < 40 * 64  # the ramp made the early steps smaller
    assert total_sequences(Config().train, seq_len, world) == Config().train.max_steps * 32


def test_user_price_file_overrides_entries_and_keeps_the_rest(tmp_path):
    shipped = load_prices()
    runpod_h100 = next(p for p in shipped.prices if p.provider == "runpod" and p.gpu == "H100 SXM")
    toml = tmp_path / "prices.toml"
    toml.write_text(
        'as_of = "2031-05-06"\n'
        '[providers.runpod.prices."H100"]\n'  # an alias of H100 SXM
        "on_demand = 1.11\n"
        '[providers.homelab]\nas_of = "today"\n[providers.homelab.prices."RTX 4090"]\non_demand = 0.05\n'
    )
    merged = load_prices(str(toml))
    entry = next(p for p in merged.prices if p.provider == "runpod" and p.gpu == "H100 SXM")
    assert entry.on_demand == 1.11 and entry.spot is None and entry.source == str(toml)
    assert entry.on_demand != runpod_h100.on_demand
    assert entry.as_of == "2031-05-06"
    home = next(p for p in merged.prices if p.provider == "homelab")
    assert (home.gpu, home.on_demand, home.as_of) == ("RTX 4090", 0.05, "today")
    # everything the file does not mention is still the shipped table's
    assert len(merged.prices) == len(shipped.prices) + 1
    lambda_a100 = [p for p in merged.prices if p.provider == "lambda" and p.gpu == "A100 80GB"]
    assert lambda_a100 == [p for p in shipped.prices if p.provider == "lambda" and p.gpu == "A100 80GB"]
    assert merged.files[-1] == str(toml)


def test_unknown_gpu_names_it_and_the_known_ones(tmp_path):
    with pytest.raises(CostInputError) as err:
        estimate_cost(_config(tmp_path), gpu="H800")
    text = str(err.value)
    assert "'H800'" in text and "H100 SXM" in text and "A100 40GB" in text


@pytest.mark.parametrize(
    ("name", "content", "expected"),
    [
        ("gpu.json", {"providers": {"aws": {"prices": {"H800": {"on_demand": 2}}}}}, "providers.aws.prices.H800"),
        (
            "price.json",
            {"providers": {"aws": {"prices": {"L4": {"on_demand": "cheap"}}}}},
            "providers.aws.prices.L4.on_demand",
        ),
        ("neg.json", {"providers": {"aws": {"prices": {"L4": {"spot": -1}}}}}, "providers.aws.prices.L4.spot"),
        ("kind.json", {"providers": {"aws": {"prices": {"L4": {"reserved": 1}}}}}, "providers.aws.prices.L4.reserved"),
        ("top.json", {"providers": {"aws": {"prices": {}}}, "pricez": 1}, "'pricez'"),
        ("noprices.json", {"providers": {"aws": {"L4": 1}}}, "providers.aws must have a 'prices' table"),
        ("eur.json", {"currency": "EUR", "providers": {"aws": {"prices": {}}}}, "currency 'EUR'"),
    ],
)
def test_bad_price_file_names_the_file_and_key(tmp_path, name, content, expected):
    path = tmp_path / name
    path.write_text(json.dumps(content))
    with pytest.raises(CostInputError) as err:
        load_prices(str(path))
    assert str(path) in str(err.value) and expected in str(err.value)


def test_unreadable_price_files(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[providers\n")
    with pytest.raises(CostInputError, match="not valid TOML") as err:
        load_prices(str(bad))
    assert str(bad) in str(err.value)
    with pytest.raises(CostInputError, match="cannot read it"):
        load_prices(str(tmp_path / "missing.json"))


def test_rl_and_external_jobs_need_a_measured_step_time(tmp_path):
    rl = Config.model_validate({"run": {"job": "rl"}, "distributed": {"nproc_per_node": 1}})
    with pytest.raises(CostInputError, match="rollout generation"):
        estimate_cost(rl, gpu="H100")
    report = estimate_cost(rl, gpu="H100", step_time_s=30.0, steps=100)
    assert report.rows[0].wall_hours[1] == pytest.approx(100 * 30.0 / 3600)
    with pytest.raises(CostInputError, match="no published bf16 peak"):
        estimate_cost(_config(tmp_path), gpu="A10G")
    with pytest.raises(CostInputError, match="mfu"):
        estimate_cost(_config(tmp_path), gpu="H100", mfu=1.5)


def test_every_priced_gpu_listed_with_memory_verdicts_and_rendered():
    cfg = Config.model_validate(
        {
            "model": {"path": "tests/data/model_configs/Qwen2.5-7B-Instruct"},
            "data": {"seq_len": 2048},
            "train": {"max_steps": 100, "global_batch_size": 64, "micro_batch_size": 1},
            "distributed": {"nproc_per_node": 8, "strategy": "ddp"},
        }
    )
    if model_shape(cfg)[0] is None:
        pytest.skip("tests/data/model_configs is not in this checkout")
    report = estimate_cost(cfg)
    names = [row.gpu for row in report.rows]
    assert "H100 SXM" in names and "RTX 4090" in names and "A10G" not in names  # A10G: no peak, noted
    assert any("A10G" in note for note in report.notes)
    by_name = {row.gpu: row for row in report.rows}
    # DDP keeps the whole 7B states on every GPU: no 24 GB card holds them, a B200 does
    assert by_name["RTX 4090"].fits_memory is False and by_name["B200"].fits_memory is True
    console = Console(record=True, width=220)
    render_cost(report, console)
    text = console.export_text()
    assert "approximate list prices" in text and "does not fit" in text and "runpod" in text
    data = json.loads(json.dumps(report.to_dict()))
    assert data["rows"][0]["providers"] and data["prices_as_of"]


# ---------------------------------------------------------------- units, GPUs named and measured


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(3.92e-05, "39.2 µs"), (0.0009999, "1.00 ms"), (0.1184, "118 ms"), (4.2, "4.20 s"), (59.99, "1.00 min"),
     (750, "12.5 min"), (3 * 3600, "3.00 h"), (5000 * 3600, "5,000 h")],
)  # fmt: skip
def test_durations_read_in_their_own_unit(seconds, text):
    assert duration(seconds) == text


@pytest.mark.parametrize(
    ("dollars", "text"),
    [(0, "$0"), (0.0004, "< $0.01"), (0.0123, "1.2¢"), (0.42, "42¢"), (0.996, "$1.00"), (12.345, "$12.35"),
     (1234.5, "$1,234")],
)  # fmt: skip
def test_dollars_read_as_prices(dollars, text):
    assert usd(dollars) == text


def test_a_tiny_run_shows_microseconds_and_less_than_a_cent_not_zero():
    cfg = Config.model_validate({"train": {"max_steps": 300}})  # the tiny default model
    report = estimate_cost(cfg, gpu="H100")
    console = Console(record=True, width=200)
    render_cost(report, console)
    text = console.export_text()
    assert "step 39.2 µs" in text and "ms wall" in text and "of GPU time" in text
    assert "< $0.01" in text
    assert "e-0" not in text and "$0.00" not in text and "0.0 h" not in text and "0 GPU-h" not in text


def test_a_config_without_spot_says_what_it_prices_and_that_it_runs_on_this_cpu():
    cfg = Config.model_validate({})  # no [spot] table: its defaults ('H100:8') are no request
    report = estimate_cost(cfg, here_gpus=[])
    assert report.num_gpus == 1 and len(report.rows) > 1
    assert any("names no GPU type" in n and "every priced GPU type is listed, at 1 GPU" in n for n in report.notes)
    assert any("runs on this machine's CPU" in n for n in report.notes)
    on_gpu_box = estimate_cost(cfg, here_gpus=["NVIDIA H100 80GB HBM3"])
    assert not any("CPU" in n for n in on_gpu_box.notes)
    eight = estimate_cost(cfg, gpu="H100:8")
    assert eight.num_gpus == 8 and [r.gpu for r in eight.rows] == ["H100 SXM"]


def test_a_measured_step_prices_only_the_gpu_it_was_measured_on():
    assert gpu_to_measure(None, ["NVIDIA H100 80GB HBM3"]).name == "H100 SXM"
    assert gpu_to_measure("H100", ["NVIDIA H100 80GB HBM3"]).name == "H100 SXM"
    with pytest.raises(CostInputError, match=r"this machine's GPU is a H100 SXM.*says nothing about a A100 80GB"):
        gpu_to_measure("A100-80GB", ["NVIDIA H100 80GB HBM3"])
    with pytest.raises(CostInputError, match=r"has no GPU.*a CPU step time says nothing about a GPU's"):
        gpu_to_measure("H100", [])
    with pytest.raises(CostInputError, match="not in the GPU table"):
        gpu_to_measure(None, ["NVIDIA Z80"])


def _replayed_gpus(tmp_path, name: str) -> str:
    """A gpu.jsonl as the supervisor records it, naming one GPU: what PRIME_TRAIN_GPU_REPLAY replays."""
    from prime_train.kit.gpu import GpuReading

    reading = GpuReading(0, "GPU-0", name, 0.0, 500.0, 81559.0)
    path = tmp_path / "gpu.jsonl"
    path.write_text(json.dumps({"t": 0, "gpus": [reading.to_dict()]}) + "\n")
    return str(path)


def _cost_cli(tmp_path, *args, replay: str | None = None):
    import os
    import subprocess
    import sys

    from enginetools import TINY, WIDE

    env = {**os.environ, **WIDE}
    env.pop("PRIME_TRAIN_GPU_REPLAY", None)
    if replay:
        env["PRIME_TRAIN_GPU_REPLAY"] = replay
    return subprocess.run(
        [sys.executable, "-m", "prime_train", "cost", str(TINY), "--run.output_dir", str(tmp_path / "runs"), *args],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip


def test_measure_asks_for_a_gpu_before_measuring_anything(tmp_path):
    """On a machine without a GPU, and for a GPU other than this machine's, --measure refuses up front."""
    no_gpu = _cost_cli(tmp_path, "--measure", "--gpu", "H100")
    assert no_gpu.returncode == 78, no_gpu.stdout + no_gpu.stderr
    assert "has no GPU" in no_gpu.stderr and "a CPU step time says nothing about a GPU's" in no_gpu.stderr
    other = _cost_cli(tmp_path, "--measure", "--gpu", "A100", replay=_replayed_gpus(tmp_path, "NVIDIA H100 80GB HBM3"))
    assert other.returncode == 78 and "says nothing about a A100 40GB" in other.stderr
    assert not (tmp_path / "runs").exists(), "nothing was measured"
    assert "Traceback" not in no_gpu.stderr + other.stderr


def test_measure_on_a_gpu_machine_whose_steps_ran_on_the_cpu_is_not_priced(tmp_path):
    """NVML lists an H100 (replayed) but torch trains on the CPU (this machine's CPU build): measured, then refused."""
    pytest.importorskip("torch")
    result = _cost_cli(tmp_path, "--measure", replay=_replayed_gpus(tmp_path, "NVIDIA H100 80GB HBM3"))
    assert result.returncode == 78, result.stdout + result.stderr
    assert "the measured steps ran on cpu" in result.stderr and "not priced" in result.stderr
    assert "H100" not in result.stdout, "no table priced a CPU step time at H100 rates"


def test_the_price_table_reads_at_80_columns_with_one_line_a_provider():
    cfg = Config.model_validate({"train": {"max_steps": 300}})
    report = estimate_cost(cfg, gpu="H100")
    console = Console(record=True, width=80)
    render_cost(report, console)
    lines = console.export_text().splitlines()
    table = [line for line in lines if line[:1] in "┏┃┡│└"]
    header = [line for line in table if line.startswith("┃")]
    assert len(header) == 1 and "on-demand" in header[0] and "spot" in header[0], header  # no wrapped header
    rows = [line for line in table if line.startswith("│")]
    assert len(rows) == len(report.rows[0].providers), rows  # one line a provider: nothing wrapped in a cell
    assert all(len(line) <= 80 for line in table)
    assert any("2025 list prices" in line for line in lines), "where each price comes from is still said"


def test_lora_costs_4n_for_the_frozen_base_and_6_per_adapter_parameter(tmp_path):
    cfg = _config(tmp_path)
    lora = cfg.model_copy(update={"lora": cfg.lora.model_copy(update={"rank": 8})})
    prices = _write_prices(tmp_path / "p.json", {"mycloud": {"prices": {"A100 80GB": {"on_demand": 2.0}}}})
    whole = estimate_cost(cfg, gpu="A100-80GB", prices_file=prices)
    report = estimate_cost(lora, gpu="A100-80GB", prices_file=prices)
    # rank 8 on q,k,v,o (512 → 512) and gate, up (512 → 1024), down (1024 → 512) of 2 layers, by hand
    adapters = 2 * 8 * (4 * (512 + 512) + 3 * (512 + 1024))  # 139,264
    attention = 12 * 2 * 8 * 64 * 1000
    assert report.flops_per_token == 4 * SMALL_PARAMS + 6 * adapters + attention
    assert whole.flops_per_token == 6 * SMALL_PARAMS + attention
    ratio = report.flops_per_token / whole.flops_per_token  # about 0.77 here: attention's share does not shrink
    assert report.rows[0].step_time_s[1] == pytest.approx(ratio * whole.rows[0].step_time_s[1], rel=1e-12)
    assert any("4N + 6 × adapters" in n for n in report.notes)
    assert not any("4N" in n for n in whole.notes)


def test_an_rl_config_of_a_registry_model_is_priced_offline_from_its_shipped_shape(tmp_path, monkeypatch):
    # the trial: `cost` on an RL config refused "shape unknown" offline though the model is in the registry
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    rl = Config.model_validate(
        {"run": {"job": "rl"}, "model": {"path": "Qwen/Qwen2.5-0.5B-Instruct"}, "distributed": {"nproc_per_node": 1}}
    )
    hf, source = model_shape(rl)
    assert hf is not None and hf["hidden_size"] == 896 and "shipped config.json" in source
    report = estimate_cost(rl, gpu="H100", step_time_s=30.0, steps=100)
    assert report.num_params == 494_032_768 and report.rows[0].wall_hours[1] == pytest.approx(100 * 30.0 / 3600)
    unknown = Config.model_validate({"run": {"job": "rl"}, "model": {"path": "some-org/not-in-the-registry"}})
    assert model_shape(unknown)[0] is None
