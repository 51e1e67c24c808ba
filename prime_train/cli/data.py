"""`prime-train data inspect`: records as the engine sees them (engine/data_inspect.py reads them)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Annotated

import typer

from prime_train.cli import output
from prime_train.cli.common import OVERRIDES, JsonFlag, RunConfigFiles, load_run_config, require_engine_modules
from prime_train.cli.errors import BAD_INPUT, CliError

if TYPE_CHECKING:
    from rich.console import Console

data_app = typer.Typer(help="Look at training data as the engine sees it.", no_args_is_help=True)


@data_app.command("inspect", context_settings=OVERRIDES)
def data_inspect(
    ctx: typer.Context,
    files: RunConfigFiles = None,
    n: Annotated[int, typer.Option("-n", min=0, help="Records shown of each dataset.")] = 3,
    limit: Annotated[
        int, typer.Option("--limit", min=1, help="Records of each dataset read for the statistics.")
    ] = 2000,
    as_json: JsonFlag = False,
) -> None:
    """Show a few training records as the engine tokenizes them, with the loss mask on the text, then packing
    efficiency, a histogram of document lengths and warnings (documents cut at data.seq_len, empty completions).

    On a colour terminal the part the loss is taken on is bold green and the masked part dim; elsewhere (pipes,
    NO_COLOR, --json's `marked`) the trained part is written between [[ and ]]. Exit 0, 78 for a config that does
    not lint or data that does not load.

    Examples:

      prime-train data inspect

      prime-train data inspect my-sft.toml -n 5

      prime-train data inspect my-sft.toml --data.seq_len 512 --json
    """
    cfg = load_run_config(files, ctx.args)
    require_engine_modules()
    from prime_train.engine.data_inspect import inspect_data
    from prime_train.engine.metrics import EngineConfigError

    try:
        report = inspect_data(cfg, n=n, limit=limit)
    except (EngineConfigError, ValueError, OSError) as exc:  # data that does not read: the message names it
        raise CliError(exc, BAD_INPUT) from None
    output.emit(report, as_json, lambda console: _render(report, console))


def _render(r: dict, console: Console) -> None:
    from rich.text import Text

    colour = console.is_terminal and not os.environ.get("NO_COLOR") and console.color_system is not None
    for i, rec in enumerate(r["records"], 1):
        console.print(
            Text(f"record {i} ({rec['dataset']}, {rec['format']}): {rec['num_tokens']} tokens, "
                 f"{rec['num_trained']} trained", style="bold")
        )  # fmt: skip
        if colour:
            console.print(
                Text.assemble(*((s["text"], "bold green" if s["trained"] else "dim") for s in rec["segments"]))
            )
        else:
            console.print(output.literal(rec["marked"]))
        console.print(output.literal(f"ids: {rec['ids']}"), style="dim" if colour else "")
    s, lengths = r["packing_stats"], r["lengths"]
    packed = "packed by best fit" if r["packing"] else "one document a sequence (data.packing = false)"
    console.print(output.literal(
        f"{s['documents']} documents (at most {r['read']['limit_per_dataset']} of each dataset) -> {s['sequences']} "
        f"sequences of {r['seq_len']} tokens, {packed}: packing efficiency {s['efficiency']:.1%} (non-pad share of "
        f"positions), {s['trained_tokens']} of {s['tokens']} tokens trained, {s['truncated_tokens']} cut off"
    ))  # fmt: skip
    console.print(
        output.literal(f"document length: min {lengths['min']}, mean {lengths['mean']:.1f}, max {lengths['max']}")
    )
    top = max((b["count"] for b in r["histogram"]), default=0) or 1
    for b in r["histogram"]:
        bar = "#" * round(30 * b["count"] / top)
        console.print(output.literal(f"  {b['from']:>6}-{b['to']:<6} {b['count']:>7}  {bar}"))
    for w in r["warnings"]:
        output.warning(w)
