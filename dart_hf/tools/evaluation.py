"""Mean accepted length of a head on real prompts, checked against plain greedy `generate` as it goes."""

from __future__ import annotations

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from ..core.modeling import DartHead


@torch.no_grad()
def acceptance_report(
    target: PreTrainedModel, head: DartHead, prompts: list[torch.Tensor], max_new_tokens: int = 128,
    check_lossless: bool = True, desc: str = "evaluate", node_budget: int = 60,
) -> dict:
    """Greedy DART on each prompt: new tokens per target forward (bonus included), and whether every output
    equals plain `generate` (the lossless contract, checked on the same prompts). Prompt-lookup candidates are off
    and the tree has a fixed `node_budget` (never the cost-aware one, whose choice follows the machine's timing):
    this measures the head (training curves, model cards), not what lookup adds on top (`dart-hf bench` shows both)."""
    per_prompt, lossless = [], True
    for ids in tqdm(prompts, desc=desc, unit="prompt"):
        ids = ids.to(target.device)
        out = target.generate(
            ids, assistant_model=head, do_sample=False, max_new_tokens=max_new_tokens, dart_prompt_lookup=False,
            dart_node_budget=node_budget,
        )
        if check_lossless:
            lossless &= torch.equal(out, target.generate(ids, do_sample=False, max_new_tokens=max_new_tokens))
        per_prompt.append(head.stats["mean_accepted_length"])
    return {
        "mean_accepted_length": sum(per_prompt) / max(len(per_prompt), 1),
        "per_prompt": per_prompt,
        "lossless": lossless if check_lossless else None,
        "prompts": len(prompts),
        "max_new_tokens": max_new_tokens,
    }
