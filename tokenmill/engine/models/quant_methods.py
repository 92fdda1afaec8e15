"""Which quantization method new linear layers get: the methods by name, and the scope a model
is built in (``build_model`` enters ``quantized_layers(name)``; a layer given no method of its
own takes one from the scope, the unquantized one outside any).

Besides ``QUANT_METHODS``' names, ``int4_g<G>`` is the INT4 method with groups of G inputs (a
GPTQ / AWQ checkpoint's group size, a multiple of 32), and ``int4_g<G>_act`` the same for an
act-order GPTQ checkpoint (each layer holds its inputs' order).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from tokenmill.engine.models.fp8 import Fp8Method
from tokenmill.engine.models.int4 import Int4Method
from tokenmill.engine.models.int8 import Int8Method
from tokenmill.engine.models.quantization import QuantMethod, UnquantizedMethod

__all__ = ["QUANT_METHODS", "new_quant_method", "quantized_layers"]

QUANT_METHODS: dict[str, Callable[[], QuantMethod]] = {
    "none": UnquantizedMethod,
    "fp8": Fp8Method,  # a float checkpoint, quantized at load
    "fp8_checkpoint": lambda: Fp8Method(checkpoint=True),  # an FP8 checkpoint as it is
    "int4": Int4Method,  # a GGUF file's Q4_0 / Q4_1 blocks as they are (groups of 32)
    "int8": Int8Method,  # a GGUF file's Q8_0 blocks as they are (groups of 32)
}
_INT4_GROUP = re.compile(r"int4_g(\d+)(_act)?")  # a GPTQ / AWQ checkpoint's layers, repacked
_SCOPE: ContextVar[Callable[[], QuantMethod]] = ContextVar(
    "quant_method", default=UnquantizedMethod
)


@contextmanager
def quantized_layers(name: str) -> Iterator[None]:
    """Linear layers built inside use the method ``name``; ValueError lists the known ones."""
    factory = QUANT_METHODS.get(name)
    if factory is None and (m := _INT4_GROUP.fullmatch(name)):
        Int4Method(int(m[1]))  # raises ValueError for a group size the layer cannot take
        factory = functools.partial(Int4Method, int(m[1]), act_order=m[2] is not None)
    if factory is None:
        raise ValueError(
            f"unknown quantization {name!r}; known: {', '.join(QUANT_METHODS)}, int4_g<G>[_act]"
        )
    token = _SCOPE.set(factory)
    try:
        yield
    finally:
        _SCOPE.reset(token)


def new_quant_method() -> QuantMethod:
    """A method object for a new layer, from the current scope."""
    return _SCOPE.get()()
