"""dart_hf: DART speculative decoding for Hugging Face transformers.

    import dart_hf                                   # registers model_type "dart" and routes DartHead assistants
    head = AutoModel.from_pretrained("<org>/<target>-dart")
    out = target.generate(**inputs, assistant_model=head, max_new_tokens=256)   # same text, fewer target steps
"""

import transformers
from packaging.version import Version
from transformers import AutoConfig, AutoModel

# An older transformers fails deep inside (5.3: the config class; 5.4: no target states captured) or, worse, runs:
# the floor is what the test suite and the target matrix were measured on (pyproject and custom_generate/ pin it).
TRANSFORMERS_FLOOR = "5.25"
if Version(transformers.__version__).release[:2] < Version(TRANSFORMERS_FLOOR).release:
    raise ImportError(f"dart_hf needs transformers >= {TRANSFORMERS_FLOOR}, found {transformers.__version__}: "
                      f"pip install -U 'transformers>={TRANSFORMERS_FLOOR},<6'")

from .integrations import transformers as _routing
from .core.configuration import DartConfig
from .core.loop import dart_decode
from .integrations.transformers import DartCandidateGenerator
from .core.modeling import DartHead
from .core.ngram import NGramModel
from .core.stats import DartStats
from .core.tree import DraftTree, TreeSearchParams, build_tree

AutoConfig.register("dart", DartConfig)
AutoModel.register(DartConfig, DartHead)
_routing.install()

__version__ = "0.1.0"
__all__ = [
    "DartCandidateGenerator",
    "DartConfig",
    "DartHead",
    "DartStats",
    "DraftTree",
    "NGramModel",
    "TreeSearchParams",
    "build_tree",
    "dart_decode",
]
