"""What libraries do differently when they see fake tensors, undone while a step is traced.

transformers asks ``is_tracing(tensor)`` before it reads a mask's values (``torch.all(mask == 1)``, to
skip the 4-D causal mask that ``scaled_dot_product_attention`` does not need) and answers True for any
``FakeTensor``: under the trace it built a mask the real step skips (+1.6% on a checkpointed LLaMA,
where the recomputation keeps it at the peak). While an estimate traces, on its own thread, a fake
tensor is not "tracing" to transformers: the value is read as the real step reads it, from the batch's
shadow or a small constant made in the step, else as a stated assumption of the recovery.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["as_real_step"]


@contextlib.contextmanager
def as_real_step() -> Iterator[None]:
    """Within, on this thread, transformers' ``is_fake_tensor`` answers False (restored on exit)."""
    module = sys.modules.get("transformers.utils.import_utils")  # never imported here
    original = getattr(module, "is_fake_tensor", None)
    if module is None or original is None:
        yield
        return
    me = threading.get_ident()

    def is_fake_tensor(x: Any) -> bool:
        return False if threading.get_ident() == me else bool(original(x))

    setattr(module, "is_fake_tensor", is_fake_tensor)  # noqa: B010 - a module found at run time
    try:
        yield
    finally:
        if getattr(module, "is_fake_tensor", None) is is_fake_tensor:
            setattr(module, "is_fake_tensor", original)  # noqa: B010
