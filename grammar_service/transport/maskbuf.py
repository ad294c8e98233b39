"""A bitmask buffer in shared memory, so a step's mask crosses from the grammar model to its caller without Triton.

A step's bitmask is ``B x ceil(V/32)`` int32 words: 1.2 MB at 64 rows of
Qwen3's vocabulary.  As a BLS output tensor it is copied into the grammar
stub's shared memory, moved through Triton's core and read back by the
caller (``bench/grammar_step_bench.py --rows 64``, p50: ``bls tensor`` 3.48 ms,
through this buffer 2.45 ms, in-process 1.44 ms).  With a
:class:`MaskBuffer` the caller (the ``llm`` model) creates one file in
``/dev/shm`` per instance, passes its name with every step
(``BITMASK_BUFFER``), and the grammar model writes the rows there instead of
returning ``BITMASK``; the BLS response carries only the small per-row
outputs.

Ownership and lifetime: the caller creates, names and unlinks its buffer
(:meth:`MaskBuffer.create` / :meth:`MaskBuffer.close`); names carry the
creator's pid, and :meth:`MaskBuffer.create` removes the files of creators
that died without unlinking theirs (a killed stub).  The grammar side only
attaches to names that match :data:`NAME_RE` inside :data:`SHM_DIR` and are
large enough for the rows it writes (:class:`Attached`).  Steps of one
caller never overlap (its decode loop waits for each), and each caller has
its own buffer, so one write never races another.
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path
from typing import Final

import numpy as np

from grammar_backend.errors import ConstraintError, GrammarError
from grammar_backend.lru import Lru
from grammar_backend.protocol import bitmask_width

__all__ = ["NAME_RE", "SHM_DIR", "Attached", "MaskBuffer"]

SHM_DIR: Final = Path("/dev/shm")
_PREFIX: Final = "cgrammar-mask"
#: The only names the grammar side opens: ``cgrammar-mask-<pid>-<16 hex>``.
NAME_RE: Final = re.compile(rf"{_PREFIX}-([0-9]{{1,10}})-[0-9a-f]{{16}}")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class MaskBuffer:
    """The caller's side: an int32 ``[rows, ceil(V/32)]`` array backed by a file in ``/dev/shm``.

    Parameters
    ----------
    path : Path
        The file (use :meth:`create`).
    rows, vocab_size : int
        Shape: ``rows`` x ``ceil(vocab_size / 32)`` words.
    """

    def __init__(self, path: Path, rows: int, vocab_size: int) -> None:
        self.path = path
        self.name = path.name
        # A plain ndarray over the mapping (it keeps the memmap alive as its base): np.memmap's
        # Python-level __getitem__ and __array_finalize__ would slow each step's slices.
        self.array: np.ndarray = np.memmap(path, dtype=np.int32, mode="r+",
                                           shape=(rows, bitmask_width(vocab_size))).view(np.ndarray)

    @classmethod
    def create(cls, rows: int, vocab_size: int, directory: Path = SHM_DIR) -> MaskBuffer:
        """A new buffer owned by this process (stale ones of dead processes are removed first).

        Raises
        ------
        GrammarError
            ``directory`` is missing or the file cannot be created.
        """
        if rows <= 0 or vocab_size <= 0:
            raise GrammarError(f"mask buffer: rows and vocab_size must be positive, got {rows}, {vocab_size}")
        try:
            for old in directory.glob(f"{_PREFIX}-*"):
                m = NAME_RE.fullmatch(old.name)
                if m is not None and not _alive(int(m.group(1))):
                    old.unlink(missing_ok=True)
            path = directory / f"{_PREFIX}-{os.getpid()}-{secrets.token_hex(8)}"
            with open(path, "xb") as f:
                f.truncate(rows * bitmask_width(vocab_size) * 4)
        except OSError as err:
            raise GrammarError(f"mask buffer: cannot create it in {directory}: {err}") from err
        return cls(path, rows, vocab_size)

    def close(self) -> None:
        """Unlink the file (the grammar side's mappings stay valid until it drops them)."""
        self.path.unlink(missing_ok=True)


class Attached:
    """The grammar side: callers' buffers by name, opened once each (at most ``capacity``, least recent dropped).

    Parameters
    ----------
    width : int
        Words per row (``ceil(V/32)`` of the grammar model's vocabulary).
    capacity : int
        Most buffers kept open (one per caller instance).
    directory : Path
        Where names are looked up.
    """

    def __init__(self, width: int, capacity: int = 64, directory: Path = SHM_DIR) -> None:
        self.width = width
        self.directory = directory
        self._open: Lru[str, np.ndarray] = Lru(capacity)

    def rows(self, name: str, count: int) -> np.ndarray:
        """Rows ``0..count`` of the buffer ``name``, for a step to fill its masks into.

        Raises
        ------
        ConstraintError
            ``BITMASK_BUFFER``: a name that is not a mask buffer's, a missing
            file, or one too small for ``count`` rows.
        """
        buf = self._open.get(name)
        if buf is None:
            buf = self._attach(name)
        if count > buf.shape[0]:
            raise ConstraintError("BITMASK_BUFFER", f"{name} holds {buf.shape[0]} rows, the step has {count}")
        return buf[:count]

    def _attach(self, name: str) -> np.ndarray:
        if NAME_RE.fullmatch(name) is None:
            raise ConstraintError("BITMASK_BUFFER", f"{name!r} is not a mask buffer name")
        path = self.directory / name
        try:
            size = path.stat().st_size
            row_bytes = self.width * 4
            if size < row_bytes or size % row_bytes:
                raise ConstraintError("BITMASK_BUFFER", f"{name} is {size} bytes, not whole rows of {row_bytes}")
            buf = np.memmap(path, dtype=np.int32, mode="r+", shape=(size // row_bytes, self.width)).view(np.ndarray)
        except OSError as err:
            raise ConstraintError("BITMASK_BUFFER", f"cannot open {name}: {err.strerror}") from err
        return self._open.put(name, buf)
