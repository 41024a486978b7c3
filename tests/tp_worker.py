"""One rank of `tests/test_tensor_parallel.py`: run under `python -m torch.distributed.run --nproc-per-node N`.

`python tp_worker.py SPEC.json`: for each target folder in the spec, load it tensor-parallel
(`from_pretrained(folder, tp_plan="auto")` or `distributed_config=DistributedConfig(tp_plan="auto")`, gloo on CPU),
load the head from its folder, run the spec's calls (tree and chain mode, one row and a left-padded batch, greedy and
seeded sampling, in tree mode at budget 0 too) and the calls that must be refused on every rank, and write
`rank<R>.json` (token ids, or the error each call raised) into the spec's `out` folder.
A model with `"bench": true` also runs `dart_hf.tools.bench.run_bench` (each rank gives its own `bench_rank<R>`
folder: only rank 0's may be written). `"fail_rank": R` makes rank R raise before its first call (the others are
then ended by the launcher, or by gloo seeing R's connection close).
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, DistributedConfig

import dart_hf


def attempt(fn) -> dict:
    """{"ids": output ids} or {"error": "<type>: <message>"}: a refusal is recorded, not raised, so the next case
    still runs (and shows that the process group survived it)."""
    try:
        return {"ids": fn().tolist()}
    except (ValueError, TypeError) as err:
        return {"error": f"{type(err).__name__}: {err}"}


def run_model(spec: dict, case: dict, rank: int) -> dict:
    if case.get("distributed_config"):  # transformers 5.25's spelling
        target = AutoModelForCausalLM.from_pretrained(
            case["folder"], distributed_config=DistributedConfig(tp_plan="auto")).eval()
    else:  # the spelling transformers' TP guide shows (a FutureWarning in 5.25)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            target = AutoModelForCausalLM.from_pretrained(case["folder"], tp_plan="auto").eval()
    head = dart_hf.DartHead.from_pretrained(case["head"]).eval()
    n = spec["max_new_tokens"]
    prompts = [torch.tensor([p]) for p in spec["prompts"]]
    batch_ids, batch_mask = torch.tensor(spec["batch_ids"]), torch.tensor(spec["batch_mask"])
    out: dict = {"tp_size": target.tp_size, "accepted": []}

    def dart(ids, mask=None, seed=None, **kw):
        if seed is not None:
            torch.manual_seed(seed)
        mask = torch.ones_like(ids) if mask is None else mask
        result = target.generate(ids, attention_mask=mask, assistant_model=head, max_new_tokens=n,
                                 do_sample=seed is not None, **kw)
        out["accepted"].append(head.stats["mean_accepted_length"])
        return result

    for mode in ("tree", "chain"):
        out[f"greedy_{mode}"] = [attempt(lambda: dart(ids, dart_mode=mode)) for ids in prompts]
        out[f"sample_{mode}"] = [attempt(lambda: dart(ids, seed=100 + i, dart_mode=mode))
                                 for i, ids in enumerate(prompts)]
    # DART's draws do not depend on the trees: the same seeds at budget 0 (plain decoding in DART's loop)
    out["sample_tree_budget_0"] = [attempt(lambda: dart(ids, seed=100 + i, dart_node_budget=0))
                                   for i, ids in enumerate(prompts)]
    out["greedy_batch"] = attempt(lambda: dart(batch_ids, batch_mask))
    out["sample_batch"] = attempt(lambda: dart(batch_ids, batch_mask, seed=7))
    out["sample_batch_budget_0"] = attempt(lambda: dart(batch_ids, batch_mask, seed=7, dart_node_budget=0))

    # the cost-aware budget (the shipped heads' default): every rank follows the first rank's choice
    out["auto_tree"] = [attempt(lambda: dart(ids, dart_node_budget="auto")) for ids in prompts]
    budget = head.config.node_budget
    head.config.node_budget = None  # a cost-aware head, chain mode
    out["auto_chain"] = attempt(lambda: dart(prompts[0], dart_mode="chain"))
    head.config.node_budget = budget
    # what must be refused on every rank, each followed by nothing: the next case shows the group still works
    out["refused_seed"] = attempt(lambda: dart(prompts[0], seed=1000 + rank))  # a seed per rank: not shared
    other = dart_hf.DartHead.from_pretrained(case["head"]).eval()
    if rank == 1:  # the same folder, then one weight changed on one rank: a head built apart on each rank
        with torch.no_grad():
            next(other.parameters()).view(-1)[0] += 1e-3
    out["refused_head"] = attempt(lambda: target.generate(prompts[0], attention_mask=torch.ones_like(prompts[0]),
                                                          assistant_model=other, max_new_tokens=n, do_sample=False))
    out["after_refusals"] = attempt(lambda: dart(prompts[0]))
    if case.get("bench"):  # `dart-hf bench`'s runner on the tensor-parallel target: rank 0 alone reports
        from dart_hf.tools import bench, bench_methods

        methods = [m for m in bench_methods.standard_methods(fixed_budget=[3])
                   if m.name in ("plain", "prompt_lookup", "dart_chain", "dart_tree_3", "dart_tree_auto")]
        results = bench.run_bench(target, head, {"x": prompts}, max_new_tokens=n, methods=methods,
                                  out_dir=os.path.join(spec["out"], f"bench_rank{rank}"), progress=False)
        out["bench"] = {"all_equal": results["all_equal"], "methods": list(results["methods"]),
                        "tensor_parallel": results["meta"].get("tensor_parallel")}
    return out


def main() -> None:
    spec = json.loads(open(sys.argv[1]).read())
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if spec.get("fail_rank") == rank:
        raise RuntimeError(f"rank {rank} fails on purpose")
    results = {case["name"]: run_model(spec, case, rank) for case in spec["models"]}
    with open(os.path.join(spec["out"], f"rank{rank}.json"), "w") as f:
        json.dump({"out": spec["out"], **results}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
