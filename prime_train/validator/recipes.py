"""The shipped recipes: configs for real models on stated hardware, which `prime-train init --recipe` copies.

Each is a TOML file in prime_train/configs/recipes/ and a line here saying what it trains and on what: the GPU (a
name of validator/data/gpus.json) and how many. tests/test_recipes.py keeps every one lint-clean and inside the
memory calculator's verdict for that GPU.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

RECIPES_DIR = Path(__file__).resolve().parents[1] / "configs" / "recipes"


@dataclass(frozen=True)
class Recipe:
    name: str  # the file's stem: `init --recipe NAME`
    summary: str
    model: str
    gpu: str  # a GPU of the memory calculator's table, the smallest the recipe is sized for
    num_gpus: int

    @property
    def path(self) -> Path:
        return RECIPES_DIR / f"{self.name}.toml"

    @property
    def hardware(self) -> str:
        return f"{self.num_gpus} x {self.gpu}"

    def to_dict(self) -> dict:
        return {**asdict(self), "hardware": self.hardware, "path": str(self.path)}


_LLAMA_8B = "meta-llama/Llama-3.1-8B-Instruct"
RECIPES = (
    Recipe("qwen2.5-0.5b-sft-1gpu", "full SFT on chat data", "Qwen/Qwen2.5-0.5B-Instruct", "L4", 1),
    Recipe("llama3.1-8b-lora-1gpu", "LoRA SFT (rank 16, all linear layers)", _LLAMA_8B, "H100 SXM", 1),
    Recipe("llama3.1-8b-full-8gpu", "full fine-tune, FSDP2 over 8 GPUs", _LLAMA_8B, "H100 SXM", 8),
    Recipe(
        "qwen2.5-1.5b-grpo-2gpu",
        "GRPO on arithmetic, vLLM rollouts on the second GPU",
        "Qwen/Qwen2.5-1.5B-Instruct",
        "H100 SXM",
        2,
    ),
)


def find_recipe(name: str) -> Recipe:
    """The recipe called `name`; ValueError naming the recipes (and the nearest) otherwise."""
    import difflib

    by_name = {r.name: r for r in RECIPES}
    if name in by_name:
        return by_name[name]
    near = difflib.get_close_matches(name, list(by_name), n=1, cutoff=0.5)
    hint = f"; did you mean {near[0]}?" if near else ""
    raise ValueError(f"no recipe {name!r}{hint} (recipes: {', '.join(by_name)}; `prime-train init --list` shows them)")
