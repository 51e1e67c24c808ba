"""Population-based training (Jaderberg et al. 2017, "Population Based Training of Neural Networks"): `parallel`
trials train side by side in rounds of `pbt.interval` steps. At the end of a round each trial is stopped with a
checkpoint (75); the worst `pbt.quantile` of them copy a better trial's newest checkpoint (exploit) and take its
hyper-parameters multiplied by one of `pbt.factors` (explore), then every trial resumes, the exploited ones from the
copy. The copy, the old and the new values are events in the trial's events.jsonl. optuna keeps the population:
each member is one trial, its first values sampled at random, its last ones in the user attribute `params_final`.
"""

from __future__ import annotations

import os
import random
import shutil
import threading
from typing import Any

from prime_train.contract import Event
from prime_train.kit.events import EventLog
from prime_train.rundir import newest_checkpoint
from prime_train.sweep.runner import Sweep
from prime_train.sweep.spec import is_int_key
from prime_train.sweep.study import owner, owner_gone, set_trial_attr, study_lock, suggest
from prime_train.sweep.trial import TrialRun, trial_name

PBT_DIR = "pbt"  # in a trial's run directory: the checkpoints it copied from better trials


def sweep_for(spec, storage: str, say=None) -> Sweep:
    """The sweep a spec asks for: PBT's population, or trials one after another (`parallel` at a time)."""
    return PopulationSweep(spec, storage, say) if spec.section.sampler == "pbt" else Sweep(spec, storage, say)


class PopulationSweep(Sweep):
    """A sweep whose `parallel` trials are one population, trained in rounds (the module's docstring)."""

    def _workers(self) -> list[threading.Thread]:
        return [threading.Thread(target=PopulationRun(self).run, name="sweep-pbt", daemon=True)]


class PopulationRun:
    def __init__(self, sweep: Sweep):
        self.sweep = sweep
        self.spec = sweep.spec
        self.pbt = sweep.spec.section.pbt
        self.rng = random.Random(sweep.spec.section.seed)

    def run(self) -> None:
        members = self._members()
        while members and not self.sweep.stopping.is_set():
            target = (min(m.step or 0 for m in members) // self.pbt.interval + 1) * self.pbt.interval
            self._round(members, target if target < self.sweep.max_steps else None)
            for m in members:
                if m.state in ("complete", "pruned", "failed"):
                    self.sweep._tell(m)
            members = [m for m in members if m.state == "interrupted"]
            if members and not self.sweep.stopping.is_set():
                self._exploit_and_explore(members)

    def _members(self) -> list[TrialRun]:
        """The population: the study's interrupted members (a killed sweep's), then new ones up to `parallel`."""
        import optuna

        sweep = self.sweep
        with sweep._lock, study_lock(self.spec.sweep_dir):
            members = []
            trials = sweep.study.get_trials(deepcopy=False)
            for t in trials:
                if t.state == optuna.trial.TrialState.RUNNING and owner_gone(t.user_attrs):
                    set_trial_attr(sweep.study, t.number, "owner", owner())
                    params = dict(t.user_attrs.get("params_final") or t.params)
                    run = TrialRun(t.number, params, self.spec.sweep_dir / trial_name(t.number), adopted=True)
                    run.resume_from = t.user_attrs.get("pbt_resume")
                    members.append(run)
            for _ in range(max(0, self.spec.section.parallel - len(trials))):
                trial = sweep.study.ask()
                trial.set_user_attr("owner", owner())
                run_dir = self.spec.sweep_dir / trial_name(trial.number)
                members.append(TrialRun(trial.number, suggest(trial, self.spec), run_dir))
            for m in members:
                sweep.runs[m.number] = m
                if m.adopted:
                    sweep.events.emit(Event.SWEEP_TRIAL_ADOPTED, **m.row())
                else:
                    sweep.events.emit(Event.SWEEP_TRIAL_STARTED, **m.row())
        return members

    def _round(self, members: list[TrialRun], stop_at: int | None) -> None:
        """Every member trains until `stop_at` (None: to its end), side by side."""

        def one(m: TrialRun) -> None:
            extra = ["--ckpt.resume", m.resume_from] if m.resume_from else None
            m.state, m.outcome, m.service, m.pruned_at, m.stop_at = "starting", None, None, None, stop_at
            self.sweep._run(m, extra=extra, tell=False)
            if m.resume_from and m.state != "failed":
                m.resume_from = None
                self._set_attr(m, "pbt_resume", None)

        threads = [threading.Thread(target=one, args=(m,), name=f"sweep-pbt-{m.number}", daemon=True) for m in members]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def _exploit_and_explore(self, members: list[TrialRun]) -> None:
        scored = [m for m in members if m.values]
        if len(scored) < 2:
            return
        scored.sort(key=lambda m: m.values[-1][1], reverse=self.spec.section.direction == "maximize")  # best first
        count = max(1, int(self.pbt.quantile * len(scored)))
        for bad in scored[-count:]:
            better = self.rng.choice(scored[:count])
            copied = self._copy_checkpoint(better, bad)
            if copied is None:
                continue
            before, after = dict(bad.params), self._perturb(better.params)
            bad.params, bad.resume_from = after, copied
            self._set_attr(bad, "params_final", after)
            self._set_attr(bad, "pbt_resume", copied)
            events = EventLog(bad.run_dir / "events.jsonl")
            events.emit(Event.PBT_EXPLOIT, from_trial=better.number, checkpoint=copied, step=_step_of(copied))
            events.emit(Event.PBT_EXPLORE, before=before, after=after, from_params=dict(better.params))
            self.sweep.events.emit(Event.PBT_EXPLOIT, **bad.row())

    def _copy_checkpoint(self, src: TrialRun, dst: TrialRun) -> str | None:
        """`src`'s newest whole checkpoint copied into dst's pbt/ directory (renamed into place when whole)."""
        ckpt = newest_checkpoint(src.run_dir / "checkpoints")
        if ckpt is None:
            return None
        target = dst.run_dir / PBT_DIR / f"from-{trial_name(src.number)}-{ckpt.path.name}" / ckpt.path.name
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(target.name + ".tmp")
            if tmp.exists():
                shutil.rmtree(tmp)  # our own unfinished copy of an earlier, interrupted exploit
            shutil.copytree(ckpt.path, tmp, symlinks=True)
            os.rename(tmp, target)
        return str(target)

    def _perturb(self, params: dict[str, Any]) -> dict[str, Any]:
        """Each value multiplied by one of the factors, kept in its range; a choice moves to a neighbour."""
        out = {}
        for key, value in params.items():
            p = self.spec.section.space[key]
            if p.choices is not None:
                i = p.choices.index(value) if value in p.choices else 0
                out[key] = p.choices[min(len(p.choices) - 1, max(0, i + self.rng.choice((-1, 1))))]
                continue
            new = min(float(p.high), max(float(p.low), float(value) * self.rng.choice(self.pbt.factors)))
            out[key] = round(new) if is_int_key(key) else new
        return out

    def _set_attr(self, run: TrialRun, key: str, value: Any) -> None:
        set_trial_attr(self.sweep.study, run.number, key, value)


def _step_of(path: str) -> int:
    return int(os.path.basename(path).removeprefix("step-"))
