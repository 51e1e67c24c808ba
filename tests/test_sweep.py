"""`prime-train sweep`: optuna studies whose trials are supervised runs (prime_train/sweep/).

The multi-trial tests run the real CLI in subprocesses on the tiny CPU config (4 steps a trial, about 7 s each on
a loaded 2-core machine): a hyperband sweep killed with kill -9 and run again, two sweep processes sharing one
journal storage, and PBT's exploit and explore.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path
from subprocess import PIPE

import psutil
import pytest

optuna = pytest.importorskip("optuna")

from enginetools import REPO, TINY, WIDE, cli, run_cli  # noqa: E402

from prime_train.contract import read_json  # noqa: E402
from prime_train.kit.events import read_events  # noqa: E402
from prime_train.sweep.spec import load_spec  # noqa: E402
from prime_train.validator.lint import lint_files  # noqa: E402

# every trial: 4 steps on 200 examples, evaluated and checkpointed every 2 steps, no export
FAST = """
[sweep.overrides]
"train.max_steps" = {steps}
"train.eval_interval" = 2
"train.warmup_steps" = 1
"train.global_batch_size" = 8
"train.micro_batch_size" = 8
"ckpt.interval" = 2
"ckpt.export_final" = false
"data.datasets.0.num_examples" = 200
"logging.log_interval" = 1
"supervisor.poll_interval_s" = 0.5
"""


def write_sweep(tmp_path: Path, body: str, *, steps: int = 4, name: str = "SWEEP.toml") -> Path:
    path = tmp_path / name
    head = f'[sweep]\nbase = "{TINY}"\noutput_dir = "{tmp_path / "sweeps"}"\n'
    path.write_text(head + body + FAST.format(steps=steps))
    return path


def run_started(run_dir: Path) -> int:
    return sum(e.get("event") == "run_started" for e in read_events(run_dir / "events.jsonl"))


def _checkpointed(sweep_dir: Path, number: int) -> bool:
    return any((sweep_dir / f"trial-{number:04d}" / "checkpoints").glob("step-*[0-9]"))


def test_sweep_lint_names_file_and_line_of_each_mistake(tmp_path):
    spec = write_sweep(
        tmp_path,
        'name = "bad"\ntrials = 4\nsampler = "grid"\n[sweep.space]\n'
        '"train.lrr" = { choices = [1e-3, 1e-2] }\n'  # line 8
        '"train.warmup_steps" = { low = 10, high = 5 }\n'  # line 9
        '"train.micro_batch_size" = { choices = [] }\n',  # line 10
    )
    _, problems = load_spec(spec)
    by_line = {p.line: p.message for p in problems if p.severity == "error"}
    assert "no run-config key" in by_line[8] and "did you mean `lr`" in by_line[8]
    assert "range is empty" in by_line[9]
    assert "choices is empty" in by_line[10]
    assert all(p.file == str(spec) for p in problems)

    grid = 'trials = 3\nsampler = "grid"\n[sweep.space]\n"train.warmup_steps" = { low = 1, high = 5 }\n'
    big = write_sweep(tmp_path, grid, name="big.toml")
    (too_big,) = [p for p in load_spec(big)[1] if p.severity == "error"]
    assert too_big.line == 4 and "the grid has 5 points but trials = 3" in too_big.message

    # the CLI: lint knows [sweep], and `sweep` refuses a bad spec with 78 and no traceback
    result = run_cli("lint", str(spec))
    assert result.returncode == 78 and f"{spec}:8:" in result.stdout + result.stderr
    result = run_cli("sweep", str(spec))
    assert result.returncode == 78 and "Traceback" not in result.stderr, result.stderr


@pytest.mark.slow
def test_hyperband_sweep_killed_after_two_trials_resumes_without_retraining(tmp_path):
    spec = write_sweep(
        tmp_path,
        'name = "lr"\ntrials = 6\nparallel = 2\nsampler = "random"\nseed = 3\npruner = "hyperband"\n'
        '[sweep.space]\n"train.lr" = { low = 1e-4, high = 1e-2, log = true }\n',
    )
    sweep_dir = tmp_path / "sweeps" / "lr"
    env = {**os.environ, **WIDE}
    first = subprocess.Popen(cli("sweep", str(spec)), cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=PIPE)
    deadline, finished, midway = time.time() + 150, set(), set()
    while time.time() < deadline and first.poll() is None and not (len(finished) >= 2 and midway):
        time.sleep(0.2)
        rows = (read_json(sweep_dir / "sweep.json") or {}).get("trials", [])
        finished = {t["trial"] for t in rows if t["state"] in ("complete", "pruned")}
        midway = {t["trial"] for t in rows if t["state"] == "running" and _checkpointed(sweep_dir, t["trial"])}
    assert first.poll() is None, first.stderr.read().decode()[-2000:]
    trainers = psutil.Process(first.pid).children(recursive=True)
    first.send_signal(signal.SIGKILL)
    first.wait()
    # the trials' ranks notice their supervisor is gone (engine/lifeline.py), finish the step and exit; one at its
    # last step finishes its run. Wait for them all, then count only the trials they left unfinished.
    _, alive = psutil.wait_procs(trainers, timeout=90)
    assert not alive, alive
    midway = {
        n for n in midway if (read_json(sweep_dir / f"trial-{n:04d}" / "progress.json") or {}).get("phase") != "done"
    }

    result = run_cli("sweep", str(spec), "--json", timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    doc = json.loads(result.stdout)
    states = {t["trial"]: t["state"] for t in doc["trials"]}
    assert sorted(states) == list(range(6)) and set(states.values()) <= {"complete", "pruned"}, states
    for n in finished:  # kept, never trained again
        assert run_started(sweep_dir / f"trial-{n:04d}") == 1
    for n in midway - finished:  # killed with a checkpoint: resumed from it, not started over
        interrupted = sweep_dir / f"trial-{n:04d}"
        resumes = [e for e in read_events(interrupted / "events.jsonl") if e.get("event") == "attempt_started"]
        assert run_started(interrupted) == 2 and resumes[-1]["resume_from"] >= 2, resumes
    study = optuna.load_study(study_name="lr", storage=f"sqlite:///{sweep_dir / 'study.db'}")
    assert len(study.trials) == 6

    # best.toml is a run config that lints clean; the plot and `status SWEEP_DIR` are there
    assert doc["best"]["trial"] in states and Path(doc["best_toml"]).is_file()
    problems, cfg = lint_files([doc["best_toml"]])
    assert not [p for p in problems if p.severity == "error"] and cfg.train.lr == doc["best"]["params"]["train.lr"]
    assert Path(doc["plot"]).stat().st_size > 1000
    status = run_cli("status", str(sweep_dir), "--json")
    assert status.returncode == 0 and len(json.loads(status.stdout)["trials"]) == 6


@pytest.mark.slow
def test_two_sweep_processes_on_one_journal_storage_split_the_trials(tmp_path):
    spec = write_sweep(
        tmp_path,
        'name = "shared"\ntrials = 3\nsampler = "tpe"\nseed = 1\npruner = "none"\n[sweep.space]\n'
        '"train.warmup_steps" = { choices = [1, 2, 3] }\n',
        steps=2,
    )
    journal = tmp_path / "study.journal"
    env = {**os.environ, **WIDE}
    procs = [
        subprocess.Popen(
            cli("sweep", str(spec), "--storage", f"journal:{journal}", "--json"),
            cwd=REPO,
            env=env,
            stdout=PIPE,
            stderr=PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=240) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e[-2000:] for _, e in outs]
    backend = optuna.storages.journal.JournalFileBackend(str(journal))
    study = optuna.load_study(study_name="shared", storage=optuna.storages.JournalStorage(backend))
    assert [t.number for t in study.trials] == [0, 1, 2]
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in study.trials)
    owners = {t.user_attrs["owner"]["pid"] for t in study.trials}
    assert owners <= {p.pid for p in procs}
    sweep_dir = tmp_path / "sweeps" / "shared"
    for n in range(3):  # each trial ran once, by one process
        assert run_started(sweep_dir / f"trial-{n:04d}") == 1
    assert not (sweep_dir / "study.db").exists()


@pytest.mark.slow
def test_pbt_copies_a_better_checkpoint_perturbs_lr_and_resumes_from_it(tmp_path):
    spec = write_sweep(
        tmp_path,
        'name = "pbt"\nparallel = 2\ntrials = 2\nsampler = "pbt"\npruner = "none"\nseed = 5\n'
        "[sweep.pbt]\ninterval = 2\nquantile = 0.5\nfactors = [0.5, 2.0]\n"
        '[sweep.space]\n"train.lr" = { low = 1e-4, high = 1e-2, log = true }\n',
        steps=8,  # rounds end at steps 2, 4 and 6: an exploited trial always has steps left to resume into
    )
    spec.write_text(spec.read_text() + '"train.scheduler" = "constant"\n')
    result = run_cli("sweep", str(spec), "--json", timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    sweep_dir = tmp_path / "sweeps" / "pbt"
    exploited = []
    for n in (0, 1):
        events = read_events(sweep_dir / f"trial-{n:04d}" / "events.jsonl")
        copies = [e for e in events if e["event"] == "pbt_exploit"]
        explores = [e for e in events if e["event"] == "pbt_explore"]
        exploited += [(n, c, x) for c, x in zip(copies, explores, strict=True)]
    assert exploited, "no trial copied a better one's checkpoint"
    for n, copy, explore in exploited:
        assert copy["from_trial"] == 1 - n and Path(copy["checkpoint"]).is_dir()
        new_lr, better_lr = explore["after"]["train.lr"], explore["from_params"]["train.lr"]
        assert new_lr in (better_lr * 0.5, better_lr * 2.0, 1e-4, 1e-2)  # perturbed, or clipped to the range

    def logs(n: int) -> str:
        return "".join(p.read_text() for p in (sweep_dir / f"trial-{n:04d}").glob("logs/attempt-*/trainer.log"))

    # Each round ends exactly at its step (the engine stops there itself, PRIME_TRAIN_STOP_AT_STEP): every copied
    # checkpoint is a round's end, and every exploited trial resumes from its copy in the next round.
    assert all(copy["step"] in (2, 4, 6) for _, copy, _ in exploited), [c["checkpoint"] for _, c, _ in exploited]
    for n in (0, 1):
        stops = [e for e in read_events(sweep_dir / f"trial-{n:04d}" / "events.jsonl") if e["event"] == "run_stopped"]
        assert [e["step"] for e in stops] == [2, 4, 6], stops
    resumed = [
        (n, copy, explore)
        for n, copy, explore in exploited
        if f"resumed from {copy['checkpoint']} at step {copy['step']}" in logs(n)
    ]
    assert len(resumed) == len(exploited), [(n, c["checkpoint"]) for n, c, _ in exploited]
    n, copy, explore = resumed[0]
    new_lr = explore["after"]["train.lr"]
    run_dir = sweep_dir / f"trial-{n:04d}"
    # the step after the copied checkpoint trains at the explored lr (a constant schedule)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    after = [r for r in rows if r.get("step") == copy["step"] + 1 and "lr" in r]
    assert after and after[-1]["lr"] == pytest.approx(new_lr)


def test_a_trial_is_interrupted_only_when_its_owner_is_gone():
    from prime_train.sweep.study import STALE_S, owner, owner_gone

    me = owner()
    assert not owner_gone({"owner": me})
    dead = subprocess.Popen(["true"])
    dead.wait()
    assert owner_gone({"owner": {**me, "pid": dead.pid}})
    assert owner_gone({})  # asked by a process killed before it could say so
    elsewhere = {**me, "host": "another-machine"}  # judged by its heartbeat
    assert not owner_gone({"owner": elsewhere}, now=me["beat"] + STALE_S / 2)
    assert owner_gone({"owner": elsewhere}, now=me["beat"] + STALE_S * 2)


def test_the_metric_follower_reads_whole_lines_as_the_run_writes_them(tmp_path):
    from prime_train.sweep.trial import MetricFollower, final_value

    path = tmp_path / "metrics.jsonl"
    follow = MetricFollower(path, "eval_loss")
    assert follow.poll() == []  # not written yet
    path.write_text('{"step": 1, "loss": 3.0}\n{"step": 2, "eval_loss": 2.5}\n{"step": 4, "eval_')
    assert follow.poll() == [(2, 2.5)]
    with path.open("a") as fh:
        fh.write('loss": 2.0}\n')
    assert follow.poll() == [(4, 2.0)]
    assert final_value(follow.values, "last", "minimize") == 2.0
    assert final_value([(2, 1.5), (4, 2.0)], "best", "minimize") == 1.5


@pytest.mark.slow
def test_ctrl_c_stops_every_running_trial_with_a_checkpoint_and_the_rerun_resumes_them(tmp_path):
    spec = write_sweep(
        tmp_path,
        'name = "stop"\ntrials = 2\nparallel = 2\nsampler = "random"\nseed = 5\n'
        '[sweep.space]\n"train.lr" = { low = 1e-4, high = 1e-2, log = true }\n',
        steps=40,  # long enough to be stopped part way
    )
    sweep_dir = tmp_path / "sweeps" / "stop"
    env = {**os.environ, **WIDE}
    proc = subprocess.Popen(cli("sweep", str(spec)), cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=PIPE)
    deadline = time.time() + 150
    while time.time() < deadline and proc.poll() is None and not all(_checkpointed(sweep_dir, n) for n in (0, 1)):
        time.sleep(0.2)
    assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    proc.send_signal(signal.SIGINT)  # Ctrl-C: one interrupt stops every trial with a checkpoint
    assert proc.wait(120) == 75, proc.stderr.read().decode()[-2000:]
    stopped = {}
    for n in (0, 1):
        trial = sweep_dir / f"trial-{n:04d}"
        progress = read_json(trial / "progress.json")
        assert progress["phase"] == "stopped", progress
        assert (trial / "checkpoints" / f"step-{progress['step']}").is_dir()  # its stopping step, saved
        stopped[n] = progress["step"]
    rows = {t["trial"]: t["state"] for t in read_json(sweep_dir / "sweep.json")["trials"]}
    assert set(rows.values()) == {"interrupted"}, rows
    # the same command goes on: each trial resumes from the step it stopped at
    again = run_cli("sweep", str(spec), "--json", timeout=400)
    assert again.returncode == 0, again.stderr[-3000:]
    for n, step in stopped.items():
        attempts = [
            e for e in read_events(sweep_dir / f"trial-{n:04d}" / "events.jsonl") if e.get("event") == "attempt_started"
        ]
        assert attempts[-1]["resume_from"] == step, attempts
