"""Hyper-parameter sweeps on optuna where every trial is a supervised run (`prime-train sweep`): the SWEEP.toml
spec and its lint (spec.py), the study, its storage and who owns a trial (study.py), one trial's run (trial.py),
the sweep's worker threads (runner.py), population-based training (pbt.py), and what the sweep directory holds
(record.py). Torch-free: a layer above the supervisor (resilience/), below the CLI."""
