"""Sample text from an exported model: `python -m flame.generate MODEL_DIR --prompt "..." [--max-new-tokens N]`.

Plain and slow on purpose (the whole sequence is run again for every new token): a check that an exported model
loads and speaks, not an inference server.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from flame.data.tokenizer import open_tokenizer
from flame.export import load_exported


@torch.no_grad()
def generate(model, ids: list[int], max_new_tokens: int, temperature: float = 0.0, top_k: int = 50,
             seed: int = 0) -> list[int]:
    """Greedy when temperature is 0, else top-k sampling."""
    g = torch.Generator().manual_seed(seed)
    ids = list(ids)
    for _ in range(max_new_tokens):
        logits = model(torch.tensor([ids]))[0, -1].float()
        if temperature <= 0:
            next_id = int(logits.argmax())
        else:
            values, indices = logits.topk(top_k)
            probs = torch.softmax(values / temperature, dim=-1)
            next_id = int(indices[torch.multinomial(probs, 1, generator=g)])
        ids.append(next_id)
    return ids


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", type=Path)
    p.add_argument("--prompt", default="The")
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    try:  # the folder's tokenizer.json or World vocabulary (absolute: never read as a hub id)
        tokenizer = open_tokenizer(str(a.model_dir.absolute()), eos_token=None, bos_token=None)
    except Exception as e:
        print(f"error: {a.model_dir}: no usable tokenizer ({e})", file=sys.stderr)
        raise SystemExit(2) from None
    model = load_exported(a.model_dir).eval()
    ids = tokenizer.encode_batch([a.prompt])[0]
    out = generate(model, ids, a.max_new_tokens, a.temperature, seed=a.seed)
    print(tokenizer.decode(out))


if __name__ == "__main__":
    main()
