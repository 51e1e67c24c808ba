"""One parser for accelerator strings ("H100:8", "L4:0.5", "cpu"), and the three places that read them agree on it:
lint of [spot].accelerators, `prime-train init --hardware` and `prime-train cost`."""

from __future__ import annotations

import pytest

from prime_train.config.accelerators import Accelerators, parse_accelerators
from prime_train.config.loader import load_config
from prime_train.integrations.spot_lint import lint_spot
from prime_train.validator.cost import CostInputError, estimate_cost
from prime_train.validator.wizard import Answers, build_config, parse_hardware


@pytest.mark.parametrize(
    ("text", "name", "count"),
    [
        ("H100", "H100", 1),
        ("H100:8", "H100", 8),
        ("h100:8", "h100", 8),  # kept as written: SkyPilot and the GPU table match names in any case
        ("  A100-80GB:4 ", "A100-80GB", 4),
        ("tpu-v5e-16", "tpu-v5e-16", 1),
        ("H100:0.5", "H100", 0.5),  # SkyPilot shares a GPU between tasks
        ("L4:8.0", "L4", 8),
        ("cpu", None, 0),
        ("CPU", None, 0),
    ],
)
def test_names_and_counts_parse_as_skypilot_reads_them(text, name, count):
    parsed = parse_accelerators(text)
    assert (parsed.name, parsed.count) == (name, count)
    assert type(parsed.count) is type(count), "a whole count is an int, a fraction a float"
    assert parse_accelerators(str(parsed)) == parsed, "str() writes the canonical form back"


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("", "empty"),
        ("   ", "empty"),
        (":8", "the name before ':' is empty"),
        ("H100:", "the count after ':' is empty"),
        ("H100:0", "must be more than 0"),
        ("H100:0.0", "must be more than 0"),
        ("H100:-1", "('-1') is not a positive number"),
        ("H100:abc", "('abc') is not a positive number"),
        ("H100:inf", "('inf') is not a positive number"),
        ("H100:1e3", "('1e3') is not a positive number"),
        ("H100:8:2", "more than one ':'"),
        ("H100,A100", "'H100,A100' is not an accelerator name"),
        ("8:H100", "'8' is not an accelerator name"),
        ("H100x8", "did you mean 'H100:8'?"),
        ("A100-80GB*4", "did you mean 'A100-80GB:4'?"),
        ("cpu:4", "'cpu' takes no count"),
    ],
)
def test_bad_strings_are_rejected_naming_the_bad_part(text, words):
    with pytest.raises(ValueError) as caught:
        parse_accelerators(text, what="spot.accelerators")
    message = str(caught.value)
    assert message.startswith(f"spot.accelerators {text!r}: "), "the setting and the string come first"
    assert words in message


def test_a_caller_that_needs_whole_gpus_says_why():
    assert parse_accelerators("H100:8").whole_count("one process per GPU") == 8
    with pytest.raises(ValueError, match=r"0\.5 of a GPU, but one process per GPU: give a whole number"):
        parse_accelerators("H100:0.5").whole_count("one process per GPU")
    with pytest.raises(ValueError, match="no GPU, but one process per GPU"):
        parse_accelerators("cpu").whole_count("one process per GPU")
    assert Accelerators(None, 0).is_cpu and not Accelerators("H100", 1).is_cpu


# ---------------------------------------------------------------- the three readers agree


def _spot_config(tmp_path, accelerators: str, num_nodes: int = 1):
    path = tmp_path / "spot.toml"
    path.write_text(f'[spot]\naccelerators = "{accelerators}"\nnum_nodes = {num_nodes}\n')
    return load_config([str(path)])


def _lint_accelerators(cfg) -> list[str]:
    return [message for key, severity, message in lint_spot(cfg) if key == ("spot", "accelerators")]


@pytest.mark.parametrize("text", ["H100:0.5", "H100:0", "H100:-1", "H100:abc", ":8", "", "H100x8"])
def test_lint_init_and_cost_all_refuse_what_cannot_train(tmp_path, text):
    cfg = _spot_config(tmp_path, text)
    [lint_message] = _lint_accelerators(cfg)
    with pytest.raises(ValueError) as init_error:
        parse_hardware(text)
    with pytest.raises(CostInputError) as cost_error:
        estimate_cost(cfg, gpu="H100", step_time_s=1.0)
    # one parser: the same complaint from each, under the name of its own setting (and its own need of whole GPUs)
    assert _reason(str(init_error.value)) == _reason(str(cost_error.value)) == _reason(lint_message)


def _reason(message: str) -> str:
    """What is wrong with the string, without the setting's name or what the caller needed."""
    return message.split("': ", 1)[1].split(", but")[0]


def test_lint_init_and_cost_read_a_sound_string_alike(tmp_path):
    cfg = _spot_config(tmp_path, "h100:4")
    assert _lint_accelerators(cfg) == []
    hw = parse_hardware("h100:4")
    assert (hw.gpu, hw.count) == ("h100", 4) and hw.memory_gib > 70, "the GPU table matches names in any case"
    report = estimate_cost(cfg, step_time_s=1.0)
    assert report.num_gpus == 4 and [row.gpu for row in report.rows] == ["H100 SXM"]
    assert estimate_cost(_spot_config(tmp_path, "h100:4", num_nodes=2), step_time_s=1.0).num_gpus == 8


def test_cpu_is_the_wizards_default_and_no_gpu_for_spot(tmp_path):
    assert parse_hardware("CPU").is_gpu is False
    assert 'precision = "fp32"' in build_config(Answers(hardware="cpu"))
    [message] = _lint_accelerators(_spot_config(tmp_path, "cpu"))
    assert "name one, e.g. 'H100:8'" in message


def test_one_gpu_table_for_lint_init_memory_and_cost(tmp_path):
    """A GPU the table does not know: lint warns about the [spot] that rents it (naming names that work), init and
    cost refuse it as memory does; a known GPU is found by its accelerator string everywhere."""
    from prime_train.validator.gpus import load_gpus
    from prime_train.validator.lint import lint_files
    from prime_train.validator.memory_inputs import MemoryInputError

    path = tmp_path / "v100.toml"
    path.write_text('[ckpt]\nremote = "s3://b/p"\n[spot]\naccelerators = "V100:8"\n')
    problems, _ = lint_files([str(path)], [])
    [warning] = [p for p in problems if "GPU table" in p.message]
    assert warning.severity == "warning" and "V100 is not in prime-train's GPU table" in warning.message
    assert "A100-80GB" in warning.message and "A100 80GB" not in warning.message, "names a [spot] table can use"
    with pytest.raises(ValueError, match="unknown GPU 'V100'"):
        parse_hardware("V100:8")
    with pytest.raises(CostInputError, match="unknown GPU 'V100'"):
        estimate_cost(load_config([str(path)]), step_time_s=1.0)
    with pytest.raises(MemoryInputError, match="unknown GPU 'V100'"):
        load_gpus().find("V100:8")
    assert load_gpus().find("A100-80GB:4").name == "A100 80GB"
    path.write_text('[ckpt]\nremote = "s3://b/p"\n[spot]\naccelerators = "T4:4"\n')
    assert not [p for p in lint_files([str(path)], [])[0] if "GPU table" in p.message]
