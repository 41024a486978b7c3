#!/usr/bin/env bash
# GPU check (issue 4): DART on CUDA, a few minutes on one H200. Run from the repository root:
#
#     bash examples/gpu_check.sh            # results under $OUT (default runs/gpu_check)
#
# 1. lossless + cost-aware budget on CUDA with a tiny random target (fp32 and bf16): DART output == generate,
#    the verify cost by tree size is measured with CUDA syncs and printed (nothing is stored: the size rule times
#    its own steps), head.stats reports the chosen budgets and the policy its step times by size (~30 s);
# 2. `dart-hf bench --synthetic` with SDPA: a random Qwen3-8B-shaped target in bf16 -> verify cost by tree size,
#    per-phase DART step times by node budget, head + tree search share of a step (~1-2 min);
# 3. compiled rows on the synthetic Qwen3-8B shape: plain eager, plain static cache + torch.compile, DART eager and
#    DART static cache + torch.compile at node budgets 1 7 60, the 60-node one also with dart_timing=True (draft =
#    head + tree search / verify / accept), outputs compared with plain -> compiled DART step / compiled plain step
#    (the 60-node ratio is the headline), head + tree share of a compiled step. Every compiled call compiles first
#    (inductor; plain with CUDA graphs, the DART step without them until part 5 validates them): 7 compiles, ~5-8 min;
# 4. the synthetic bench with flex_attention (first call compiles the kernel; ~2-3 min);
# 5. the DART step under CUDA graphs (DART_HF_CUDA_GRAPHS=1, compile mode "reduce-overhead", what plain generate
#    uses on CUDA), budget 7, outputs compared with plain: if this part gives a wrong token or crashes, the default
#    (CUDA graphs off for the DART step, `step.compile_options`) must stay (~2-3 min);
# 6. part 3 sampling with Qwen3's shipped settings (`--qwen3-sampling`: temperature 0.6, top-p 0.95, top-k 20), every
#    call seeded alike: compiled DART step / compiled plain step when both sample, budgets 7 60 (outputs are not
#    compared: sampled texts differ by method; 6 compiles, ~5-7 min);
# 7. part 3 on batches (`--batch-size 1 8 32`: B random prompts of 512 tokens, no padding), greedy, budget 7: per
#    batch size the compiled plain step and the compiled DART step, ms per row token and DART / plain, every row
#    compared with plain eager generate's; no dart_timing split (a run of several batch sizes leaves it out). 3 plain
#    + 3 DART compiles, batch size 1's warm in inductor's cache from part 3 (~4 min; each more budget: 3 more
#    compiles, ~2-3 min).
# Every part has its own timeout and writes what it has; a failing part does not stop the next one.
# All seven parts take ~20-30 min, more than one 15-minute device session: PARTS picks some, e.g.
#     PARTS="1 5 7" bash examples/gpu_check.sh   # lossless on CUDA, CUDA graphs, batches (~10 min)
#     PARTS="3 6" bash examples/gpu_check.sh     # compiled greedy and sampled rows (~10-14 min)
# It needs no download (random targets) and runs from the source tree with the machine's own torch / transformers,
# so it fits a device machine that cannot fetch anything. The real SmolLM2 target cannot travel to such a machine
# (98 MB as Q4_1 GGUF, 270 MB in bf16, over a 64 MiB transfer limit), so regeneration at scale is not part of it.
set -uo pipefail
OUT="${OUT:-runs/gpu_check}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export DART_HF_CACHE="$OUT/cache"
export TOKENIZERS_PARALLELISM=false
status=0
PARTS=" ${PARTS:-1 2 3 4 5 6 7} "
want() { [[ "$PARTS" == *" $1 "* ]]; }  # run part $1? (PARTS="5 7" runs parts 5 and 7 only)

{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1
  python -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

if want 1; then
echo "== 1. tiny target on CUDA: lossless, auto budget"
timeout 120 python - > "$OUT/tiny_cuda.txt" 2>&1 <<'EOF'
import json, os, torch
from transformers import AutoModelForCausalLM, LlamaConfig
import dart_hf
from dart_hf.core.budget import budget_policy
from dart_hf.tools.verify_cost import measure_verify_cost

report = {}
for dtype in (torch.float32, torch.bfloat16):
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512, bos_token_id=0, eos_token_id=1, pad_token_id=2)
    with torch.device("cuda"):
        target = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa").eval()
        with torch.no_grad():
            target.lm_head.weight.mul_(8.0)
        head = dart_hf.DartHead.from_target(target, draft_length=4, node_budget=None, tree_top_k=32, beam_width=8).eval()
    cost = measure_verify_cost(target, sizes=(1, 2, 4, 8, 16, 32, 64), repeats=3)  # a measurement, not stored
    g = torch.Generator().manual_seed(1)
    equal, budgets = [], []
    for i in range(6):
        ids = torch.randint(3, 96, (1, 5 + 3 * i), generator=g).cuda()
        ref = target.generate(ids, do_sample=False, max_new_tokens=40)
        out = target.generate(ids, assistant_model=head, do_sample=False, max_new_tokens=40, dart_timing=(i % 2 == 0))
        budgets.append(head.stats["node_budgets"])
        fixed = target.generate(ids, assistant_model=head, do_sample=False, max_new_tokens=40, dart_node_budget=20)
        equal.append(bool(torch.equal(out, ref)) and bool(torch.equal(fixed, ref)))
    policy = budget_policy(head, target)
    report[str(dtype)] = {"all_equal": all(equal), "equal": equal, "budgets_first_prompt": budgets[0],
                          "policy": {"candidates": policy.candidates, "choice": policy.choice,
                                     "step_ms": [round(1e3 * s, 3) for s in policy.prices(1).tolist()],
                                     "expected_accepted": policy.expected_at(policy.candidates).tolist()},
                          "verify_ms": dict(zip(cost.sizes, (round(1e3 * s, 3) for s in cost.seconds))),
                          "verify_machine": cost.record["machine"]}
for name, r in report.items():
    print(name, json.dumps(r, default=str))
# fp32 must be exact; bf16 may differ on near-tied logits (batched vs one-token kernels), reported only
raise SystemExit(0 if report["torch.float32"]["all_equal"] else 1)
EOF
rc=$?; echo "exit $rc"; [ $rc -ne 0 ] && status=1; tail -n 40 "$OUT/tiny_cuda.txt"
fi

if want 2; then
echo "== 2. synthetic Qwen3-8B shape, bf16, SDPA"
timeout 300 python -m dart_hf_cli bench --synthetic --attn sdpa --max-new-tokens 48 --out "$OUT/synthetic_sdpa" \
  > "$OUT/synthetic_sdpa.log" 2>&1
rc=$?; echo "exit $rc"; [ $rc -ne 0 ] && status=1; tail -n 40 "$OUT/synthetic_sdpa.log"
fi

if want 3; then
echo "== 3. compiled rows on the synthetic Qwen3-8B shape (static cache + torch.compile), bf16, SDPA"
timeout 600 python -m dart_hf_cli bench --synthetic --compiled --attn sdpa --budget 1 7 60 \
  --max-new-tokens 48 --out "$OUT/synthetic_compiled" > "$OUT/synthetic_compiled.log" 2>&1
rc=$?; echo "exit $rc"; [ $rc -ne 0 ] && status=1; tail -n 60 "$OUT/synthetic_compiled.log"
fi

if want 4; then
echo "== 4. synthetic Qwen3-8B shape, bf16, flex_attention"
timeout 240 python -m dart_hf_cli bench --synthetic --attn flex_attention --max-new-tokens 48 \
  --out "$OUT/synthetic_flex" > "$OUT/synthetic_flex.log" 2>&1
rc=$?; echo "exit $rc"; [ $rc -ne 0 ] && status=1; tail -n 40 "$OUT/synthetic_flex.log"
fi

if want 5; then
echo "== 5. the DART step under CUDA graphs (reduce-overhead), synthetic Qwen3-8B shape, bf16, SDPA"
DART_HF_CUDA_GRAPHS=1 timeout 300 python -m dart_hf_cli bench --synthetic --compiled --attn sdpa --budget 7 \
  --max-new-tokens 48 --out "$OUT/synthetic_cudagraphs" > "$OUT/synthetic_cudagraphs.log" 2>&1
rc=$?; echo "exit $rc"; [ $rc -ne 0 ] && status=1; tail -n 40 "$OUT/synthetic_cudagraphs.log"
fi

if want 6; then
echo "== 6. compiled rows sampling with Qwen3's settings (--qwen3-sampling), synthetic Qwen3-8B shape, bf16, SDPA"
timeout 600 python -m dart_hf_cli bench --synthetic --compiled --qwen3-sampling --attn sdpa --budget 7 60 \
  --max-new-tokens 48 --out "$OUT/synthetic_compiled_sampling" > "$OUT/synthetic_compiled_sampling.log" 2>&1
rc=$?; echo "exit $rc"; [ $rc -ne 0 ] && status=1; tail -n 60 "$OUT/synthetic_compiled_sampling.log"
fi

if want 7; then
echo "== 7. compiled rows on batches of 1, 8 and 32 prompts, synthetic Qwen3-8B shape, bf16, SDPA"
timeout 420 python -m dart_hf_cli bench --synthetic --compiled --batch-size 1 8 32 --attn sdpa --budget 7 \
  --max-new-tokens 48 --out "$OUT/synthetic_compiled_batches" > "$OUT/synthetic_compiled_batches.log" 2>&1
rc=$?; echo "exit $rc"; [ $rc -ne 0 ] && status=1; tail -n 40 "$OUT/synthetic_compiled_batches.log"
fi

exit $status
