"""Processes of a server under test: who is in its process group, who is still alive.

``/proc`` is read through :mod:`psutil` (pinned in requirements.txt, as
:func:`deploy.server.listening_ports` uses it), not parsed here: a process
that exits between the listing and the read raises
:class:`psutil.NoSuchProcess`, which every helper treats as gone.
"""

from __future__ import annotations

import os

import psutil

__all__ = ["alive", "group_processes"]


def group_processes(pgid: int) -> list[psutil.Process]:
    """The live processes whose process group is ``pgid`` (a tritonserver and its Python-backend stubs).

    Zombies (exited, not yet reaped) are left out: they hold no memory and run nothing.
    """
    found: list[psutil.Process] = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                found.append(proc)
        except (psutil.NoSuchProcess, ProcessLookupError):
            continue  # exited while we scanned
    return found


def alive(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie."""
    try:
        return bool(psutil.Process(pid).status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False
