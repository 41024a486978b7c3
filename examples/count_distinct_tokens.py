"""How many response tokens a chain of fine-tunes has really seen: corpora in training order, each answer counted
only when its prompt was not answered before (by an earlier corpus or by the head's first training set).

Why: a second corpus grown from an overlapping prompt source answers some prompts again; those answers are near
copies (the same greedy target, another engine or dtype) and add no distinct data. The model card's data curve
plots the count this prints. The first training set is given as a prompt source and its response-token count
(a feature run keeps no token corpus):

    python examples/count_distinct_tokens.py --prior sharegpt:1488 --prior-tokens 307395 \
        corpora/smollm2-code corpora/smollm2-code-2:1267 corpora/smollm2-code-2 corpora/smollm2-chat-2
"""

from __future__ import annotations

import argparse
import json
from itertools import islice
from pathlib import Path

from transformers import AutoTokenizer

from dart_hf.tools.assets import KNOWN_TARGETS, target_folder
from dart_hf.training.corpus import CORPUS_FILE, read_records, training_prompts
from dart_hf.training.data import prompt_token_ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("corpora", nargs="+", help="corpus folders in the order the head was trained on them; "
                    "FOLDER:N counts only its first N answers (a fine-tune that stopped part way through it)")
    ap.add_argument("--target", default="smollm2-135m-instruct", choices=sorted(KNOWN_TARGETS))
    ap.add_argument("--prior", help="SOURCE:N, the first training set's prompts (as `dart-hf regenerate --prompts`)")
    ap.add_argument("--prior-tokens", type=int, default=0, help="response tokens of that first training set")
    args = ap.parse_args()
    seen: set[tuple[int, ...]] = set()
    if args.prior:
        source, count = args.prior.rsplit(":", 1)
        tokenizer = AutoTokenizer.from_pretrained(target_folder(args.target))
        seen = {tuple(prompt_token_ids(tokenizer, text)) for text in training_prompts(source, int(count))}
    total = args.prior_tokens
    rows = [{"corpus": args.prior or "-", "answers": len(seen), "repeated_prompts": 0, "new_tokens": total,
             "distinct_tokens": total}]
    for spec in args.corpora:
        folder, _, first = spec.partition(":")
        answers = repeated = tokens = new_tokens = 0
        for record in islice(read_records(Path(folder) / CORPUS_FILE), int(first) if first else None):
            key, length = tuple(record["prompt"]), len(record["response"])
            answers, tokens = answers + 1, tokens + length
            if key in seen:
                repeated += 1
            else:
                new_tokens += length
                seen.add(key)
        total += new_tokens
        rows.append({"corpus": spec, "answers": answers, "response_tokens": tokens, "repeated_prompts": repeated,
                     "new_tokens": new_tokens, "distinct_tokens": total})
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()
