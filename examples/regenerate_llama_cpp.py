"""Grow a dart_hf token corpus with llama.cpp (llama-cpp-python) answering from the target's own GGUF.

Why: on a 2-core CPU, transformers' batched `generate` of SmolLM2-135M makes 40-45 response tokens per second in
fp32 and 80 in bf16; llama.cpp on the same Q4_1 GGUF (the file dart_hf de-quantises into the fp32 target) makes 95-99
with two 1-thread processes: a modest gain, measured. The prompts are dart_hf's
token ids (the target's chat template, `prompt_token_ids`), the answers come back as token ids too, so nothing is
re-tokenised; each answer is cut after its first EOS as `dart-hf regenerate` does.
The answers are llama.cpp's greedy ones (quantised weights, its own kernels), which agree with the fp32 target's
for a while and then may drift; the trainer takes every label from the fp32 target's own forward (KL), so the
corpus only decides which texts the head is trained on. `--check N` measures how far the two agree.

    pip install llama-cpp-python           # builds llama.cpp from source (about 6 minutes on 2 cores)
    python examples/regenerate_llama_cpp.py --prompts sharegpt-code --skip 400 --num-prompts 1000 \
        --out corpora/smollm2-llama-cpp --processes 2
    python examples/regenerate_llama_cpp.py --check 8   # agreement with transformers' fp32 greedy answers

Resumable like `dart-hf regenerate`: prompts already in the corpus are skipped.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import time
from pathlib import Path

from tqdm.auto import tqdm

from dart_hf.tools.assets import KNOWN_TARGETS, load_target, packaged_file
from dart_hf.training.corpus import Corpus, eos_token_ids, training_prompts
from dart_hf.training.data import cut_after_eos, prompt_token_ids

_worker_llm = None


def gguf_path(target: str) -> Path:
    """The known target's GGUF as installed from the package index (single-file targets only)."""
    spec = KNOWN_TARGETS[target]
    if len(spec.parts) != 1:
        raise SystemExit(f"{target}'s GGUF ships in {len(spec.parts)} parts; assemble it first "
                         "(dart_hf.tools.assets.assemble_gguf) and pass --gguf")
    return packaged_file(spec.parts[0])


def _init_worker(path: str, threads: int, n_ctx: int) -> None:
    global _worker_llm
    from llama_cpp import Llama

    _worker_llm = Llama(model_path=path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads, n_batch=512,
                        verbose=False)


def _answer(job: tuple[list[int], int, list[int]]) -> tuple[list[int], list[int]]:
    """Greedy answer token ids to one prompt: argmax at every step (temperature 0, no repeat penalty)."""
    prompt, max_new_tokens, eos_ids = job
    _worker_llm.reset()  # else generate() reuses the previous prompt's cached prefix: answers may depend on order
    out: list[int] = []
    for token in _worker_llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
        out.append(int(token))
        if token in eos_ids or len(out) >= max_new_tokens:
            break
    return prompt, cut_after_eos(out, set(eos_ids))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="smollm2-135m-instruct", choices=sorted(KNOWN_TARGETS))
    ap.add_argument("--gguf", help="the target's GGUF (default: the file dart_hf converts the target from)")
    ap.add_argument("--prompts", default="sharegpt-code", help="as `dart-hf regenerate --prompts`")
    ap.add_argument("--skip", type=int, default=0, help="leave out the first prompts of the source")
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--out", default="corpora/smollm2-llama-cpp")
    ap.add_argument("--processes", type=int, default=1, help="llama.cpp instances, each on --threads threads")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--check", type=int, default=0,
                    help="instead: answer N held-out-free prompts with both engines and report agreement")
    args = ap.parse_args()

    target, tokenizer = load_target(args.target)
    eos_ids = eos_token_ids(target, tokenizer)
    path = str(args.gguf or gguf_path(args.target))
    texts = training_prompts(args.prompts, args.skip + (args.check or args.num_prompts))[args.skip :]
    if args.check:
        prompts = [prompt_token_ids(tokenizer, t) for t in dict.fromkeys(texts)]
        check(target, tokenizer, prompts, path, args, max(map(len, prompts)) + args.max_new_tokens + 8, eos_ids)
        return
    corpus = Corpus(args.out, target.config.get_text_config().vocab_size, eos_ids)
    todo = [(list(p), args.max_new_tokens, eos_ids) for p in corpus.pending(tokenizer, texts)]
    if not todo:
        print(f"every prompt is already answered in {corpus.path}")
        return
    n_ctx = max(len(prompt) for prompt, _, _ in todo) + args.max_new_tokens + 8
    del target
    started, tokens = time.perf_counter(), 0
    with mp.get_context("spawn").Pool(args.processes, _init_worker, (path, args.threads, n_ctx)) as pool, \
            tqdm(total=len(todo), unit="prompt", desc="regenerate (llama.cpp)") as bar:
        for prompt, response in pool.imap_unordered(_answer, todo):
            corpus.append([{"prompt": prompt, "response": response}])
            tokens += len(response)
            bar.update(1)
            bar.set_postfix(response_tokens=tokens, tok_per_s=f"{tokens / (time.perf_counter() - started):.0f}")
    print(json.dumps({"prompts": len(todo), "response_tokens": tokens,
                      "seconds": round(time.perf_counter() - started, 1), "corpus": str(corpus.path)}))


def check(target, tokenizer, prompts: list[list[int]], path: str, args, n_ctx: int, eos_ids: list[int]) -> None:
    """Greedy answers of llama.cpp and of the fp32 transformers target to the same prompts: tokens per second
    each, and how many leading tokens agree."""
    import torch

    from dart_hf.training.data import generate_batch, greedy_config

    _init_worker(path, args.threads, n_ctx)
    started = time.perf_counter()
    fast = [_answer((p, args.max_new_tokens, eos_ids))[1] for p in prompts]
    fast_s = time.perf_counter() - started
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    slow = [generate_batch(target, [p], greedy_config(target, tokenizer, args.max_new_tokens))[0]["response_ids"]
            for p in prompts]
    slow_s = time.perf_counter() - started
    prefix = []
    for a, b in zip(fast, slow):
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix.append(same)
    print(json.dumps({
        "prompts": len(prompts), "threads": args.threads,
        "llama_cpp_tok_per_s": round(sum(map(len, fast)) / fast_s, 1),
        "transformers_tok_per_s": round(sum(map(len, slow)) / slow_s, 1),
        "agreeing_prefix": prefix, "identical_answers": sum(a == b for a, b in zip(fast, slow)),
        "answer_lengths": [len(b) for b in slow],
    }))


if __name__ == "__main__":
    main()
