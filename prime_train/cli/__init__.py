"""The `prime-train` command line: one module per command group, one way to print, one error handler.

app.py      the command tree and its root group (error handler, literal help)
output.py   the one print path: labels, problems, `--json` or a rich view
errors.py   what a user can cause becomes `error: <message>` and an exit code
common.py   config files with `--section.key` overrides, loading, shared flags
config.py   lint, config show|diff          run.py     train, run, preflight, profile
plan.py     verify-model, models, memory, cost          spot.py    run --spot, spot *, monitor
watch.py    status, logs, diagnose          init.py    init (and its recipes)
ckpt.py     ckpt to-hf | list | rm          runs.py    runs
generate.py generate, chat                  evaluate.py eval
data.py     data inspect                    hub.py     download, push
"""

from prime_train.cli.app import app, main

__all__ = ["app", "main"]
