"""HF export: from_pretrained round trips, sharding, atomic replacement, DDP/FSDP2 and DCP -> HF conversion.

Run as a script, this file is the worker the two-process test launches under torchrun.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from enginetools import tiny_llama as _tiny_llama
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

from prime_train.engine.export import ExportRefused, dcp_to_hf, export_hf, unwrap_model

THIS_FILE = Path(__file__).resolve()
pytestmark = [
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]


def tiny_llama(seed: int, *, tie: bool):
    """The shared tiny Llama with the special-token ids export writes into config.json."""
    return _tiny_llama(seed, tie=tie, bos_token_id=1, eos_token_id=2, pad_token_id=3)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer built in memory (no download); ids fit a 64-token vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3}
    for ch in "abcdefghijklmnopqrstuvwxyz0123456789 .,+-=":
        vocab[ch] = len(vocab)
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


INPUT = torch.tensor([[1, 5, 9, 17, 33, 40, 2, 7]])


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=INPUT).logits


def safetensors_keys(out: Path) -> set[str]:
    keys: set[str] = set()
    for f in out.glob("*.safetensors"):
        with safe_open(f, "pt") as st:
            keys.update(st.keys())
    return keys


def assert_weights_equal(model, expected: dict[str, torch.Tensor]) -> None:
    got = model.state_dict()
    for k, v in expected.items():
        assert torch.equal(got[k], v), k


# ---------------------------------------------------------------------- one process


@pytest.mark.parametrize("tie", [True, False])
def test_export_hf_loads_with_from_pretrained_and_gives_the_same_logits(tmp_path, tie):
    model = tiny_llama(0, tie=tie)
    out = export_hf(model, tiny_tokenizer(), tmp_path / "final", rank=0)
    assert out == tmp_path / "final"
    files = set(os.listdir(out))
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json"} <= files
    assert os.listdir(tmp_path) == ["final"]

    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert torch.equal(logits(loaded), logits(model))
    # tied embeddings are stored once and come back tied
    assert ("lm_head.weight" in safetensors_keys(out)) is not tie
    assert (loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()) is tie
    assert AutoTokenizer.from_pretrained(out)("ab c")["input_ids"] == tiny_tokenizer()("ab c")["input_ids"]


def test_export_hf_with_a_small_max_shard_size_writes_shards_and_an_index(tmp_path):
    model = tiny_llama(0, tie=False)
    out = export_hf(model, None, tmp_path / "final", rank=0, max_shard_size="50KB")
    shards = sorted(p.name for p in out.glob("model-*.safetensors"))
    assert len(shards) > 1
    assert not (out / "model.safetensors").exists()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(model.state_dict())
    assert set(index["weight_map"].values()) == set(shards)
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert torch.equal(logits(loaded), logits(model))


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_every_exported_file_has_the_mode_open_gives_under_the_umask(tmp_path, umask):
    # safetensors writes its file 0o600: model.safetensors was unreadable where config.json beside it was not
    old = os.umask(umask)
    try:
        out = export_hf(tiny_llama(0, tie=True), tiny_tokenizer(), tmp_path / "final", rank=0)
    finally:
        os.umask(old)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()}
    assert modes["model.safetensors"] == oct(0o666 & ~umask)
    assert set(modes.values()) == {oct(0o666 & ~umask)}, modes


class BrokenTokenizer:
    """Fails half-way through an export, after the weights are written."""

    def save_pretrained(self, path):
        raise OSError("No space left on device")


def test_a_second_export_replaces_the_first_only_once_it_is_whole(tmp_path):
    first, second = tiny_llama(0, tie=True), tiny_llama(1, tie=True)
    final = tmp_path / "final"
    export_hf(first, tiny_tokenizer(), final, rank=0)

    with pytest.raises(OSError, match="No space"):
        export_hf(second, BrokenTokenizer(), final, rank=0)
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(final).eval()), logits(first))

    export_hf(second, tiny_tokenizer(), final, rank=0)
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(final).eval()), logits(second))
    assert sorted(os.listdir(tmp_path)) == ["final"]


def test_export_recovers_the_previous_export_after_a_crash_between_the_renames(tmp_path):
    first = tiny_llama(0, tie=True)
    final = tmp_path / "final"
    export_hf(first, tiny_tokenizer(), final, rank=0)
    os.rename(final, tmp_path / "final.old")  # killed after moving the old export aside
    (tmp_path / "final.tmp").mkdir()
    with pytest.raises(OSError):
        export_hf(tiny_llama(1, tie=True), BrokenTokenizer(), final, rank=0)
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(final).eval()), logits(first))


def test_an_export_killed_while_writing_its_marker_is_replaced_by_the_next(tmp_path):
    # kill -9 between mkdir final.tmp and the marker's rename (as a prime-train writing the marker through a temporary
    # name left it): the next export must know the directory as its own, not refuse it as someone else's
    final = tmp_path / "final"
    (tmp_path / "final.tmp").mkdir()
    (tmp_path / "final.tmp" / "..prime-train-export.json.0a1b2c3d4e5f.tmp").write_text('{"made_by": "prime')
    model = tiny_llama(0, tie=True)
    export_hf(model, tiny_tokenizer(), final, rank=0)
    assert torch.equal(logits(AutoModelForCausalLM.from_pretrained(final).eval()), logits(model))
    assert sorted(os.listdir(tmp_path)) == ["final"]
    # anything else beside such a temporary file is still not the export's to delete
    (tmp_path / "final.tmp").mkdir()
    (tmp_path / "final.tmp" / "..prime-train-export.json.0a1b2c3d4e5f.tmp").write_text("{}")
    (tmp_path / "final.tmp" / "notes.txt").write_text("mine")
    with pytest.raises(ExportRefused, match="not an export of prime-train"):
        export_hf(model, tiny_tokenizer(), final, rank=0)
    assert (tmp_path / "final.tmp" / "notes.txt").read_text() == "mine"


def test_unwrap_model_peels_torch_compile():
    model = tiny_llama(0, tie=True)
    assert unwrap_model(torch.compile(model)) is model
    assert unwrap_model(model) is model


def test_dcp_to_hf_names_what_is_missing_from_an_incomplete_checkpoint(tmp_path):
    ckpt = tmp_path / "checkpoints"
    (ckpt / "step-3.tmp").mkdir(parents=True)
    (ckpt / "step-4").mkdir()
    (ckpt / "step-5").mkdir()
    (ckpt / "step-5" / ".metadata").write_bytes(b"")
    cases = {
        "step-3.tmp": "unfinished save",
        "step-4": r"no DCP \.metadata",
        "step-5": "no hf/config.json",
        "step-6": "does not exist",
    }
    for name, why in cases.items():
        with pytest.raises(ValueError, match=rf"cannot convert .*{name}.*{why}"):
            dcp_to_hf(ckpt / name, tmp_path / "out")
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------- real processes


def test_two_process_fsdp2_and_ddp_exports_and_dcp_to_hf_of_the_fsdp2_checkpoint(tmp_path):
    root = tmp_path / "run"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(THIS_FILE)]
    proc = subprocess.run(
        [*cmd, str(root)], capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    expected = torch.load(root / "expected.pt")

    fsdp_export = AutoModelForCausalLM.from_pretrained(root / "final_fsdp").eval()
    assert_weights_equal(fsdp_export, expected["trained"])
    assert "lm_head.weight" not in safetensors_keys(root / "final_fsdp")
    ddp_export = AutoModelForCausalLM.from_pretrained(root / "final_ddp").eval()
    assert_weights_equal(ddp_export, expected["initial"])

    step_dir = root / "checkpoints" / "step-2"
    assert {"config.json", "tokenizer.json"} <= set(os.listdir(step_dir / "hf"))
    out = dcp_to_hf(step_dir, tmp_path / "converted")
    converted = AutoModelForCausalLM.from_pretrained(out).eval()
    assert_weights_equal(converted, expected["trained"])
    assert "lm_head.weight" not in safetensors_keys(out)
    assert torch.equal(logits(converted), logits(fsdp_export))
    tok = AutoTokenizer.from_pretrained(out)
    prompt = tok("1+2=", return_tensors="pt")
    generated = converted.generate(**prompt, max_new_tokens=4, do_sample=False)
    assert generated.shape == (1, prompt["input_ids"].shape[1] + 4)


def _worker(root: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel

    from prime_train.config.schema import CkptConfig
    from prime_train.engine.checkpoint import Checkpointer, TrainState
    from prime_train.rundir import RunDir

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    tokenizer = tiny_tokenizer()

    initial = tiny_llama(0, tie=True).train()
    initial_weights = {k: v.clone() for k, v in initial.state_dict().items()}
    export_hf(DistributedDataParallel(initial), tokenizer, root / "final_ddp", rank=rank)

    model = tiny_llama(0, tie=True).train()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(10 + rank)
    for _ in range(2):
        x = torch.randint(0, 64, (2, 8))
        model(input_ids=x, labels=x).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    state = TrainState(model, optimizer, None, None, rank=rank)
    state.step = 2
    ckpt = Checkpointer(RunDir(root), CkptConfig(async_save=False), rank=rank, world_size=world)
    ckpt.set_hf_assets(unwrap_model(model).config, tokenizer)
    ckpt.save(state, state.step)
    export_hf(model, tokenizer, root / "final_fsdp", rank=rank)

    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    trained = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save({"initial": initial_weights, "trained": trained}, root / "expected.pt")


if __name__ == "__main__":
    from prime_train.engine.parallel import destroy_distributed

    logging.basicConfig(level=logging.INFO, stream=sys.stdout)
    _worker(Path(sys.argv[1]))
    destroy_distributed()  # after the worker returned: its models must not outlive the group


def test_exported_model_names_the_tokenizers_end_token_and_generate_stops_there(sft_model):
    """final/ of a real SFT run: config.json and generation_config.json say eos = the byte tokenizer's <|eos|>, so
    transformers' generate() ends the answer instead of running on to max_new_tokens."""
    from prime_train.vocab import EOS_TOKEN_ID

    tokenizer = AutoTokenizer.from_pretrained(sft_model)
    config = json.loads((sft_model / "config.json").read_text())
    generation = json.loads((sft_model / "generation_config.json").read_text())
    assert tokenizer.eos_token_id == config["eos_token_id"] == generation["eos_token_id"] == EOS_TOKEN_ID
    assert config["pad_token_id"] == tokenizer.pad_token_id and config["bos_token_id"] == tokenizer.bos_token_id

    model = AutoModelForCausalLM.from_pretrained(sft_model).eval()
    stopped = 0
    for word in ("hello", "prime", "stop", "tokens"):
        prompt = tokenizer(f"reverse {word}=", return_tensors="pt")
        out = model.generate(**prompt, max_new_tokens=24, do_sample=False)[0, prompt["input_ids"].shape[1] :]
        ids = out.tolist()
        if ids[-1] == EOS_TOKEN_ID and len(ids) < 24:
            stopped += 1
            assert EOS_TOKEN_ID not in ids[:-1]
    # every greedy answer ends with the end token, well before the limit
    assert stopped == 4
