"""No command destroys what it did not make: `ckpt to-hf` never writes over a directory that is not an earlier export
of its own (and that only with --overwrite), a run directory or a checkpoint; retention never deletes through a
link or a live writer's save; `profile`, RL's published weights and the install commands delete or write over
only what they made themselves."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
from enginetools import TINY, run_cli, run_train
from typer.testing import CliRunner

from prime_train.contract import ExitCode, process_started_at, write_json_atomic
from prime_train.retention import TMP_OWNER_FILE, apply_retention, clean_stale_tmp, safe_remove_checkpoint
from prime_train.rundir import RunDir, list_checkpoints

# engine/export.py's EXPORT_MARKER: what makes a directory an export of ours (refusals are its ExportRefused, a
# ValueError: exit 78 from the CLI and from the engine)
MARKER = ".prime-train-export.json"
VENV_MARKER = ".prime-train-venv.json"  # retention.VENV_MARKER: what makes a venv one an install made


def tree(root: Path) -> dict[str, bytes | None]:
    """Every entry under `root` (links as their target's text), to compare before and after."""
    out: dict[str, bytes | None] = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(dirpath) / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                out[rel] = os.readlink(path).encode()
            elif path.is_file():
                out[rel] = path.read_bytes()
            else:
                out[rel] = None
    return out


def precious(path: Path) -> Path:
    """A directory of the user's that no command may touch."""
    (path / "sub").mkdir(parents=True)
    (path / "thesis.tex").write_text("three years of work")
    (path / "sub" / "data.bin").write_bytes(b"\0" * 64)
    return path


# ---------------------------------------------------------------- a real run: checkpoints and final/


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """A finished tiny run (4 steps, a checkpoint at 2 and 4, final/), built once; tests work on copies."""
    out = tmp_path_factory.mktemp("trained")
    result = run_train(out, "r", **{"train.max_steps": 4, "ckpt.interval": 2, "data.datasets.0.num_examples": 400})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out / "r"


@pytest.fixture
def run(trained, tmp_path) -> RunDir:
    """A copy of the trained run, in a runs/ folder of this test's own."""
    root = tmp_path / "runs" / "r"
    shutil.copytree(trained, root, symlinks=True)
    return RunDir(root)


def step_dir(run: RunDir) -> Path:
    return list_checkpoints(run.checkpoints_dir)[-1].path


def test_the_run_s_own_final_export_carries_the_marker(run):
    assert (run.final_dir / MARKER).is_file()
    assert (run.final_dir / "config.json").is_file()


@pytest.mark.parametrize("which", ["models folder", "run directory"])
def test_to_hf_refuses_a_folder_it_did_not_write_with_78_and_changes_nothing(run, tmp_path, which):
    out = precious(tmp_path / "models") if which == "models folder" else run.root
    before = tree(out)
    result = run_cli("ckpt", "to-hf", str(step_dir(run)), str(out), timeout=180)
    said = result.stdout + result.stderr
    assert result.returncode == ExitCode.CONFIG, said
    assert "Traceback" not in said
    assert str(out) in said
    assert ("not an export of prime-train" if which == "models folder" else "run directory") in said
    assert len(result.stderr.strip().splitlines()) <= 3, said
    assert tree(out) == before
    assert not os.path.lexists(f"{out}.tmp") and not os.path.lexists(f"{out}.old")


def test_to_hf_writes_a_new_directory_then_replaces_it_only_with_overwrite(run, tmp_path):
    from prime_train.engine.export import dcp_to_hf

    out = tmp_path / "exported"
    dcp_to_hf(step_dir(run), out)
    assert (out / MARKER).is_file() and (out / "config.json").is_file()
    before = tree(out)
    with pytest.raises(ValueError, match=r"earlier export.*--overwrite"):
        dcp_to_hf(step_dir(run), out)
    assert tree(out) == before
    (out / "model.safetensors").write_bytes(b"stale")
    dcp_to_hf(step_dir(run), out, overwrite=True)
    assert (out / "model.safetensors").read_bytes() != b"stale"
    assert (out / MARKER).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported", "runs"]
    # an empty directory is as good as a new one
    (tmp_path / "empty").mkdir()
    dcp_to_hf(step_dir(run), tmp_path / "empty")
    assert (tmp_path / "empty" / MARKER).is_file()


@pytest.mark.parametrize(
    "where",
    ["checkpoints", "the checkpoint", "inside the checkpoint", "logs", "a file", "a link", "a marked run directory"],
)
def test_to_hf_never_writes_into_or_over_a_run_directory_or_a_checkpoint_even_with_overwrite(run, tmp_path, where):
    from prime_train.engine.export import dcp_to_hf

    step = step_dir(run)
    victim = precious(tmp_path / "victim")
    (tmp_path / "note.txt").write_text("keep")
    out = {
        "checkpoints": run.checkpoints_dir,
        "the checkpoint": step,
        "inside the checkpoint": step / "hf-export",
        "logs": run.logs_dir / "exported",
        "a file": tmp_path / "note.txt",
        "a link": tmp_path / "link",
        "a marked run directory": run.root,
    }[where]
    if where == "a link":
        out.symlink_to(victim, target_is_directory=True)
    if where == "a marked run directory":
        (run.root / MARKER).write_text("{}")  # a planted marker does not make a run directory an export
    before, victim_before = tree(run.root), tree(victim)
    with pytest.raises(ValueError):
        dcp_to_hf(step, out)
    with pytest.raises(ValueError, match=r"never written into or over|not a directory"):
        dcp_to_hf(step, out, overwrite=True)
    assert tree(run.root) == before
    assert tree(victim) == victim_before
    assert (tmp_path / "note.txt").read_text() == "keep"
    assert out.is_symlink() == (where == "a link")


def test_to_hf_leaves_a_directory_of_the_user_s_named_like_its_leftovers(run, tmp_path):
    """OUT.old and OUT.tmp are the export's own scratch names: one that is not an export is never deleted."""
    from prime_train.engine.export import dcp_to_hf

    for suffix in (".old", ".tmp"):
        mine = precious(tmp_path / f"models{suffix}")
        before = tree(mine)
        with pytest.raises(ValueError, match=f"models{suffix}"):
            dcp_to_hf(step_dir(run), tmp_path / "models")
        assert tree(mine) == before
        shutil.rmtree(mine)
    dcp_to_hf(step_dir(run), tmp_path / "models")
    assert (tmp_path / "models" / MARKER).is_file()


def test_export_hf_replaces_its_own_final_but_never_a_final_of_someone_else(tmp_path):
    from enginetools import tiny_llama

    from prime_train.engine.export import export_hf

    final = tmp_path / "final"
    export_hf(tiny_llama(0), None, final, rank=0)
    export_hf(tiny_llama(1), None, final, rank=0)  # an earlier export: replaced
    assert (final / MARKER).is_file()

    (final / MARKER).unlink()  # an export an older prime-train wrote: replaced too
    export_hf(tiny_llama(2), None, final, rank=0)
    assert (final / MARKER).is_file()

    shutil.rmtree(final)
    precious(final)
    before = tree(final)
    with pytest.raises(ValueError, match="not an export of prime-train"):
        export_hf(tiny_llama(3), None, final, rank=0)
    assert tree(final) == before


def test_a_resumed_run_exports_final_again_over_one_an_older_prime_train_wrote(run):
    (run.final_dir / MARKER).unlink(missing_ok=True)  # final/ as a release before the marker left it
    weights = (run.final_dir / "model.safetensors").read_bytes()
    overrides = {"train.max_steps": 6, "ckpt.interval": 2, "data.datasets.0.num_examples": 400}
    result = run_train(run.root.parent, run.root.name, flags=("--resume",), **overrides)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (run.final_dir / MARKER).is_file()
    assert (run.final_dir / "model.safetensors").read_bytes() != weights, "final/ holds the model of step 6"
    assert sorted(p.name for p in run.root.iterdir() if p.name.startswith("final")) == ["final"]


# ---------------------------------------------------------------- retention: hostile layouts


def make_ckpt(ckpt_dir: Path, name: str) -> Path:
    path = ckpt_dir / name
    path.mkdir(parents=True)
    (path / ".metadata").write_bytes(b"meta")
    (path / "__0_0.distcp").write_bytes(b"x" * 16)
    return path


def test_retention_never_deletes_through_a_checkpoints_directory_that_is_a_link(tmp_path):
    elsewhere = tmp_path / "other-run-checkpoints"
    for s in (1, 2, 3):
        make_ckpt(elsewhere, f"step-{s}")
    make_ckpt(elsewhere, "step-4.tmp")
    before = tree(elsewhere)
    ckpt = tmp_path / "run" / "checkpoints"
    ckpt.parent.mkdir()
    ckpt.symlink_to(elsewhere, target_is_directory=True)

    assert apply_retention(ckpt, keep_last=1, keep_every=None) == []
    assert clean_stale_tmp(ckpt) == []
    with pytest.raises(ValueError, match="symbolic link"):
        safe_remove_checkpoint(ckpt / "step-1", ckpt)
    assert tree(elsewhere) == before


def test_retention_leaves_a_step_linked_outside_and_keeps_the_newest_real_checkpoint(tmp_path):
    ckpt = tmp_path / "checkpoints"
    make_ckpt(ckpt, "step-1")
    make_ckpt(ckpt, "step-2")
    outside = make_ckpt(tmp_path / "elsewhere", "step-9")
    (ckpt / "step-9").symlink_to(outside, target_is_directory=True)  # looks newest; is not a checkpoint of ours
    assert apply_retention(ckpt, keep_last=1, keep_every=None) == [ckpt / "step-1"]
    assert [c.step for c in list_checkpoints(ckpt)] == [2]
    assert (outside / "__0_0.distcp").is_file()


@pytest.fixture
def live_writer():
    """A live process of this host, named as the writer of a step-N.tmp."""
    import socket

    proc = subprocess.Popen(["sleep", "600"])
    try:
        yield {"pid": proc.pid, "host": socket.gethostname(), "started_at": process_started_at(proc.pid)}
    finally:
        proc.kill()
        proc.wait()


def test_a_save_another_live_process_is_writing_is_never_deleted_or_moved_over(tmp_path, live_writer):
    ckpt = tmp_path / "checkpoints"
    for s in (1, 2, 3):
        make_ckpt(ckpt, f"step-{s}")
    writing = make_ckpt(ckpt, "step-1.tmp")  # e.g. a second writer re-saving step 1
    write_json_atomic(writing / TMP_OWNER_FILE, live_writer)
    before = tree(writing)

    with pytest.raises(ValueError, match="being written by"):
        safe_remove_checkpoint(writing, ckpt)
    with pytest.raises(ValueError, match="being written by"):
        safe_remove_checkpoint(ckpt / "step-1", ckpt)  # would rename step-1 over it
    assert apply_retention(ckpt, keep_last=1, keep_every=None) == [ckpt / "step-2"]
    assert clean_stale_tmp(ckpt) == []
    assert tree(writing) == before
    assert sorted(p.name for p in ckpt.iterdir()) == ["step-1", "step-1.tmp", "step-3"]


# ---------------------------------------------------------------- profile, RL's published weights


def profile_config(tmp_path: Path):
    from prime_train.config.loader import load_config
    from prime_train.resilience.profile import profile_config

    cfg = load_config([TINY], ["--run.output_dir", str(tmp_path / "runs"), "--run.name", "exp"])
    return profile_config(cfg, 1, 1)


@pytest.mark.parametrize("what", ["a real run of that name", "a link", "a file"])
def test_profile_never_runs_in_or_deletes_a_directory_it_did_not_make(tmp_path, monkeypatch, what):
    from prime_train.resilience import profile as profile_mod
    from prime_train.resilience import supervisor

    def no_supervisor(*args, **kwargs):
        raise AssertionError("the profile started in a directory it did not make")

    monkeypatch.setattr(supervisor, "Supervisor", no_supervisor)
    pcfg = profile_config(tmp_path)
    root = Path(pcfg.run_dir)  # runs/exp-profile: here also the directory of a real run named exp-profile
    root.parent.mkdir(parents=True)
    victim = precious(tmp_path / "victim")
    if what == "a real run of that name":
        precious(root)
        (root / "config.toml").write_text("[run]\n")
    elif what == "a link":
        root.symlink_to(victim, target_is_directory=True)
    else:
        root.write_text("notes")
    before, victim_before = tree(root.parent), tree(victim)
    with pytest.raises(profile_mod.ProfileFailed, match="not a profile's directory") as refused:
        profile_mod.run_profile(pcfg, warmup=1, steps=1, observer=None)
    assert refused.value.code == ExitCode.CONFIG
    assert tree(root.parent) == before and tree(victim) == victim_before


def test_profile_clears_only_its_own_earlier_directory(tmp_path):
    from prime_train.resilience.profile import MARKER as PROFILE_MARKER
    from prime_train.resilience.profile import _clear_previous

    root = tmp_path / "exp-profile"
    root.mkdir()
    _clear_previous(root)  # empty: nothing to clear, nothing refused
    (root / PROFILE_MARKER).write_text("made by prime-train profile")
    (root / "events.jsonl").write_text("{}\n")
    _clear_previous(root)
    assert not root.exists()


def test_rl_pruning_of_published_weights_never_deletes_through_a_link(tmp_path):
    from prime_train.rl.train import GRPOJob

    elsewhere = tmp_path / "elsewhere"
    for s in range(1, 8):
        make_ckpt(elsewhere, f"step-{s}")
    before = tree(elsewhere)
    run = RunDir(tmp_path / "run")
    run.root.mkdir()
    run.weights_dir.symlink_to(elsewhere, target_is_directory=True)
    GRPOJob._prune_published(SimpleNamespace(state=SimpleNamespace(step=4), run_dir=run))
    assert tree(elsewhere) == before

    # a real weights/: the two newest up to this step stay, a step from the future goes, links are only unlinked
    run.weights_dir.unlink()
    for s in (1, 2, 3, 4, 6):
        make_ckpt(run.weights_dir, f"step-{s}")
    (run.weights_dir / "step-5").symlink_to(elsewhere / "step-5", target_is_directory=True)
    GRPOJob._prune_published(SimpleNamespace(state=SimpleNamespace(step=4), run_dir=run))
    assert sorted(p.name for p in run.weights_dir.iterdir()) == ["step-3", "step-4"]
    assert tree(elsewhere) == before


# ---------------------------------------------------------------- install commands: venvs they made, only


@pytest.fixture
def fake_pip(monkeypatch, tmp_path):
    """Every command an install would run, recorded instead of run; nothing is downloaded."""
    from prime_train.integrations import skypilot
    from prime_train.rl import vllm_server

    ran: list[list[str]] = []
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(vllm_server, "_run_streaming", lambda argv, *a, **k: ran.append(argv))
    monkeypatch.setattr(
        vllm_server, "probe_vllm", lambda py, **k: vllm_server.VllmEnv(py, (0, 33, 0), "vllm", "vllm.entrypoints")
    )
    monkeypatch.setattr(
        skypilot, "install_skypilot", lambda prefix, version, **k: ran.append(["install", str(prefix)]) or "py"
    )
    return ran


def invoke(*args: str):
    from prime_train.cli import app

    return CliRunner().invoke(app, list(args), env={"COLUMNS": "200", "NO_COLOR": "1"})


@pytest.mark.parametrize("command", [["inference", "install", "--cpu"], ["spot", "install"]])
@pytest.mark.parametrize("what", ["a folder of the user's", "a venv it did not make", "a file"])
def test_install_refuses_a_prefix_it_did_not_make_and_writes_nothing(tmp_path, fake_pip, command, what):
    prefix = tmp_path / "prefix"
    if what == "a file":
        prefix.write_text("notes")
    else:
        precious(prefix)
        if what == "a venv it did not make":
            (prefix / "pyvenv.cfg").write_text("home = /usr/bin\n")
    before = tree(tmp_path)
    result = invoke(*command, "--prefix", str(prefix))
    assert result.exit_code == ExitCode.CONFIG, result.output
    assert str(prefix) in result.output and "nothing was installed" in result.output
    assert "Traceback" not in result.output
    assert fake_pip == []
    assert tree(tmp_path) == before


@pytest.mark.parametrize("command", [["inference", "install", "--cpu"], ["spot", "install"]])
def test_install_makes_marks_and_later_updates_its_own_venv(tmp_path, fake_pip, command):
    prefix = tmp_path / "new"
    assert invoke(*command, "--prefix", str(prefix)).exit_code == 0
    assert json.loads((prefix / VENV_MARKER).read_text())["made_by"] == "prime-train"
    (prefix / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (prefix / "lib").mkdir()
    assert invoke(*command, "--prefix", str(prefix)).exit_code == 0  # its own venv: updated
    assert fake_pip


@pytest.mark.parametrize(
    "command,name", [(["inference", "install", "--cpu"], "vllm"), (["spot", "install"], "skypilot")]
)
def test_install_updates_the_managed_venv_an_older_prime_train_made(tmp_path, fake_pip, command, name):
    managed = tmp_path / "xdg" / "prime-train" / name
    managed.mkdir(parents=True)
    (managed / "pyvenv.cfg").write_text("home = /usr/bin\n")  # no marker: made before there was one
    (managed / "lib").mkdir()
    result = invoke(*command)
    assert result.exit_code == 0, result.output
    assert (managed / VENV_MARKER).is_file()
