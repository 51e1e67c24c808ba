"""`prime-train generate | chat`: sample from a trained model (engine/sample.py loads it; transformers generates)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer

from prime_train.cli import output
from prime_train.cli.common import JsonFlag
from prime_train.cli.errors import BAD_INPUT, CliError

if TYPE_CHECKING:
    from prime_train.engine.sample import LoadedModel, Sampling

Source = Annotated[
    Path,
    typer.Argument(help="A run directory (its final/, or --step N), an HF model directory, or a LoRA adapter's."),
]
Step = Annotated[
    Optional[int], typer.Option("--step", min=0, help="Use the run's checkpoint step-N, converted on the fly.")
]
MaxTokens = Annotated[int, typer.Option("--max-tokens", min=1, help="At most this many new tokens per reply.")]
Temperature = Annotated[float, typer.Option("--temperature", min=0.0, help="0: greedy decoding.")]
TopP = Annotated[float, typer.Option("--top-p", min=0.0, max=1.0, help="Nucleus sampling's probability mass.")]
Seed = Annotated[Optional[int], typer.Option("--seed", help="Seed the sampling, for a repeatable reply.")]
Raw = Annotated[bool, typer.Option("--raw", help="Give the prompt as it is, without the tokenizer's chat template.")]


def _load(source: Path, step: int | None) -> LoadedModel:
    from prime_train.cli.common import require_engine_modules

    require_engine_modules()
    from prime_train.engine.sample import ModelSourceError, load_model

    try:
        return load_model(source, step)
    except (ModelSourceError, OSError) as exc:  # not a model, or files transformers cannot read
        raise CliError(exc, BAD_INPUT) from None


def _sampling(max_tokens: int, temperature: float, top_p: float, seed: int | None) -> Sampling:
    from prime_train.engine.sample import Sampling

    return Sampling(max_new_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed)


def generate(
    source: Source,
    prompt: Annotated[list[str], typer.Option("--prompt", "-p", help="A prompt; repeat for several.")],
    step: Step = None,
    max_tokens: MaxTokens = 128,
    temperature: Temperature = 0.7,
    top_p: TopP = 1.0,
    seed: Seed = None,
    raw: Raw = False,
    as_json: JsonFlag = False,
) -> None:
    """Sample a reply to each prompt from a trained model, stopping at the end-of-sequence token.

    The prompt goes through the tokenizer's chat template when it has one (--raw: as it is; the tiny default's
    reverse-text task is trained on raw prompts). With --json each reply carries model_input, the text the model
    continued. Exit 0, 78 when SOURCE is not a model or a run with one.

    Examples:

      prime-train generate runs/tiny-sft --prompt "reverse dwlk=" --raw --temperature 0

      prime-train generate runs/tiny-sft --step 200 -p "reverse abc=" --raw --json

      prime-train generate exported/ --prompt "Write a haiku" --temperature 0.8 --top-p 0.95 --max-tokens 64
    """
    from prime_train.engine.sample import generate as sample
    from prime_train.engine.sample import prompt_text

    loaded = _load(source, step)
    sampling = _sampling(max_tokens, temperature, top_p, seed)
    replies = []
    for p in prompt:
        text = prompt_text(loaded.tokenizer, [{"role": "user", "content": p}], raw=raw)
        replies.append({"prompt": p, "model_input": text, "completion": sample(loaded, text, sampling)})
    if as_json:
        output.print_json({"model": loaded.source, "replies": replies})
        return
    output.say(f"model: {loaded.source}", stderr=True)
    for r in replies:
        output.say(r["completion"] if len(replies) == 1 else f"{r['prompt']} -> {r['completion']}")


def chat(
    source: Source,
    step: Step = None,
    max_tokens: MaxTokens = 256,
    temperature: Temperature = 0.7,
    top_p: TopP = 1.0,
    seed: Seed = None,
    raw: Raw = False,
    system: Annotated[Optional[str], typer.Option("--system", help="A system message for the conversation.")] = None,
    as_json: JsonFlag = False,
) -> None:
    """Talk to a trained model: one message a line on stdin (a terminal or a pipe), its reply after each.

    An empty line, /exit or the end of input ends it. With a chat template the conversation is kept (each reply
    sees the turns before it; /reset clears them); without one (or --raw) every line is a prompt of its own. Stdin
    may be a pipe: `printf 'hi\\n' | prime-train chat RUN`. With --json each turn is one JSON line on stdout (user,
    model_input: the text the model continued, assistant). Exit 0, 78 when SOURCE is not a model.

    Examples:

      prime-train chat runs/tiny-sft --raw --temperature 0

      prime-train chat exported/ --system "You are terse." --max-tokens 200
    """
    import json

    from prime_train.engine.sample import generate as sample
    from prime_train.engine.sample import prompt_text

    loaded = _load(source, step)
    sampling = _sampling(max_tokens, temperature, top_p, seed)
    keep = not raw and bool(getattr(loaded.tokenizer, "chat_template", None))
    history: list[dict[str, str]] = [{"role": "system", "content": system}] if system and keep else []
    interactive = sys.stdin.isatty()
    if interactive:
        output.say(
            f"model: {loaded.source}; empty line or /exit to end, /reset to forget the conversation", stderr=True
        )
    while True:
        line = _read(interactive)
        if line is None or line.strip() in ("", "/exit", "/quit"):
            return
        if line.strip() == "/reset":
            history = history[:1] if system and keep else []
            continue
        messages = [*history, {"role": "user", "content": line}]
        text = prompt_text(loaded.tokenizer, messages, raw=raw)
        reply = sample(loaded, text, sampling)
        if keep:
            history = [*messages, {"role": "assistant", "content": reply}]
        if as_json:
            sys.stdout.write(json.dumps({"user": line, "model_input": text, "assistant": reply}) + "\n")
            sys.stdout.flush()
        else:
            output.say(reply)


def _read(interactive: bool) -> str | None:
    """One line of the user's, without its newline; None at end of input (or Ctrl-D, Ctrl-C on a terminal)."""
    try:
        if interactive:
            return input("> ")
        line = sys.stdin.readline()
        return line.rstrip("\n") if line else None
    except (EOFError, KeyboardInterrupt):
        return None
