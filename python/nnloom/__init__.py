"""nnloom: a GPU-aware interleaving runtime for PyTorch with nnsight's tracing API.

    import nnloom
    model = nnloom.NNsight(my_module)
    with model.trace(x):
        h = model.layers[3].output.save()
"""

from . import _C
from ._C import MissedProviderError, NNloomError, OutOfOrderError, save
from ._capture import SourceError
from .batching import Batcher, TensorBatcher
from .envoy import Envoy, NNsight
from .language import LanguageModel, TextBatcher
from .tracing import Barrier, Invoker, Tracer

__all__ = [
    "NNsight",
    "LanguageModel",
    "TextBatcher",
    "Barrier",
    "Envoy",
    "Tracer",
    "Invoker",
    "Batcher",
    "TensorBatcher",
    "save",
    "NNloomError",
    "OutOfOrderError",
    "MissedProviderError",
    "SourceError",
]

__version__ = "0.1.0"
