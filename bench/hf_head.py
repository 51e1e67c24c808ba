"""transformers' model with its own head against the same model given the chunked head (engine/hf_head.py).

    python bench/hf_head.py                                   # Gemma 3 text, 2 layers, hidden 128, vocab 262,144
    python bench/hf_head.py --model-type phi3 --vocab 32064   # another family the head is given to

Both sides are the same weights of a small random transformers model of --model-type at Gemma 3's vocabulary by
default (the head is what the vocabulary makes large; the trunk is kept small so that the head dominates as it
does not at 1B scale), one SFT step's forward and backward on --rows x --seq tokens:

- whole: transformers' forward, then the loss on its logits shifted (what evaluate.token_losses does for a model
  without the head): the logits, their fp32 copy, log_softmax for backward;
- chunked: the same model after engine/hf_head.py fuse_head, labels to its forward: the loss one chunk of tokens
  at a time (engine/loss.py), no logits.

Printed per side, in one process: the median wall time of --rounds forward + backward and the most tensor memory
held at once (bench/logprobs.py peak_mib), then chunked / whole. The two sides' losses and gradients are checked
to agree first.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.nn.functional as F
from logprobs import peak_mib
from transformers import AutoConfig, AutoModelForCausalLM

from prime_train.engine.hf_head import fuse_head


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-type", default="gemma3_text")
    parser.add_argument("--vocab", type=int, default=262_144)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    config = AutoConfig.for_model(
        args.model_type, vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=args.hidden // 4,
        max_position_embeddings=max(512, args.seq), tie_word_embeddings=False, pad_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    whole_model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32).train()
    chunked_model = copy.deepcopy(whole_model)
    assert fuse_head(chunked_model), "this family is not given the chunked head"
    ids = torch.randint(1, args.vocab, (args.rows, args.seq))

    def whole():
        logits = whole_model(input_ids=ids).logits
        return F.cross_entropy(logits[:, :-1].float().reshape(-1, args.vocab), ids[:, 1:].reshape(-1))

    def chunked():
        return chunked_model(input_ids=ids, labels=ids).loss

    sides = {"whole": (whole, whole_model), "chunked": (chunked, chunked_model)}

    def step(name):
        loss_fn, model = sides[name]
        model.zero_grad(set_to_none=True)
        loss = loss_fn()
        loss.backward()
        return loss.detach()

    losses = {name: step(name) for name in sides}
    torch.testing.assert_close(losses["chunked"], losses["whole"], rtol=1e-5, atol=1e-5)
    for (name, a), b in zip(whole_model.named_parameters(), chunked_model.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")
    logits_mib = args.rows * args.seq * args.vocab * 4 / 2**20
    print(
        f"{type(whole_model).__name__}, hidden {args.hidden}, 2 layers, vocab {args.vocab:,}, {args.rows} rows x "
        f"{args.seq} tokens, fp32, cpu: whole fp32 logits {logits_mib:,.0f} MiB a copy; losses and gradients agree"
    )
    figures = {}
    for name in sides:
        times = []
        for _ in range(args.rounds):
            start = time.perf_counter()
            step(name)
            times.append(time.perf_counter() - start)
        peak = peak_mib(lambda name=name: step(name), torch.device("cpu"))
        figures[name] = (statistics.median(times), peak)
        print(f"  {name:8s} forward + backward {figures[name][0] * 1000:8.1f} ms   peak tensor memory {peak:8.1f} MiB")
    (t_whole, m_whole), (t_chunk, m_chunk) = figures["whole"], figures["chunked"]
    print(f"  chunked / whole: time {t_chunk / t_whole:.2f}x, peak memory {m_chunk / m_whole:.2f}x")


if __name__ == "__main__":
    main()
