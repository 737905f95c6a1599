"""nnloom: a GPU-aware interleaving runtime for PyTorch with nnsight's tracing API.

    import nnloom
    model = nnloom.NNsight(my_module)
    with model.trace(x):
        h = model.layers[3].output.save()
"""

from . import _C
from ._C import (DeviceError, MissedProviderError, NNloomError, OutOfOrderError, PayloadError,
                 PoolExhaustedError, UnsafePayloadError, save)
from ._capture import SourceError
from .batching import Batcher, TensorBatcher
from .envoy import Envoy, NNsight
from .language import LanguageModel, TextBatcher
from .requests import Requests
from . import collect
from .tracing import Barrier, Invoker, Tracer

__all__ = [
    "NNsight",
    "LanguageModel",
    "TextBatcher",
    "Barrier",
    "Requests",
    "collect",
    "Envoy",
    "Tracer",
    "Invoker",
    "Batcher",
    "TensorBatcher",
    "save",
    "NNloomError",
    "OutOfOrderError",
    "MissedProviderError",
    "UnsafePayloadError",
    "PayloadError",
    "PoolExhaustedError",
    "DeviceError",
    "SourceError",
]

__version__ = "0.1.0"
