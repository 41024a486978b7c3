"""dart_hf: DART speculative decoding for Hugging Face transformers.

    import dart_hf                                   # registers model_type "dart" and routes DartHead assistants
    head = AutoModel.from_pretrained("<org>/<target>-dart")
    out = target.generate(**inputs, assistant_model=head, max_new_tokens=256)   # same text, fewer target steps
"""

from transformers import AutoConfig, AutoModel

from . import generation
from .configuration_dart import DartConfig
from .decoding import dart_decode
from .generation import DartCandidateGenerator
from .modeling_dart import DartHead
from .ngram import NGramModel
from .tree import DraftTree, TreeSearchParams, build_tree

AutoConfig.register("dart", DartConfig)
AutoModel.register(DartConfig, DartHead)
generation.install()

__version__ = "0.1.0"
__all__ = [
    "DartCandidateGenerator",
    "DartConfig",
    "DartHead",
    "DraftTree",
    "NGramModel",
    "TreeSearchParams",
    "build_tree",
    "dart_decode",
]
