"""The last step of every Triton model's ``finalize``: nothing of ``pb_utils`` is freed after it.

Triton 2.51's Python-backend stub tears its shared memory down before the
embedded interpreter finalizes.  Any ``pb_utils`` object still alive then
(a metric, a cached tensor, an inference response held by a reference
cycle) runs its C++ destructor in ``Py_FinalizeEx``'s garbage collection
against freed shared memory: seen on SIGTERM shutdowns, segfaults in
``MetricFamily::~MetricFamily`` (2 of 2), ``PbTensor::~PbTensor`` and
``InferResponse`` disposal.  The models drop what they hold in ``finalize``
and then call :func:`quiesce_for_exit`.
"""

from __future__ import annotations

import gc


def quiesce_for_exit() -> None:
    """Collect every cycle now, then freeze what is left so the exit-time collection skips it.

    Frozen objects are never deallocated by the interpreter (the process
    exits right after, and the OS reclaims the memory), so no ``pb_utils``
    destructor runs after the stub's shared memory is gone.
    """
    gc.collect()
    gc.freeze()
