"""`python -m prime_train`: the `prime-train` command."""

from prime_train.cli import main

main()
