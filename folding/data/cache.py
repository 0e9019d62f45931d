"""Build-once caching that is safe when N processes start at once.

:func:`build_once` produces a directory ``final`` exactly once: the first process to take an
exclusive ``fcntl`` lock on ``final + ".lock"`` builds into a private temporary directory next to it
and publishes it with an atomic ``os.rename``; the others block on the lock and then find ``final``
complete. A builder that dies releases its lock (the kernel drops it), and its temporary directory is
never mistaken for a finished result, so the next process simply builds again. Readers never see a
half-written result. The lock needs a file system with working ``flock`` (local disks do; on NFS
give each node a local cache directory).

Usage::

    path = build_once("/cache/sample_index-3f2a", lambda tmp: np.save(f"{tmp}/idx.npy", arr))
"""

from __future__ import annotations

import fcntl
import os
import shutil
import tempfile
from typing import Callable


def default_cache_dir() -> str:
    """``~/.cache/folding/data`` (used when ``data.cache_dir`` is not set)."""
    return os.path.join(os.path.expanduser("~"), ".cache", "folding", "data")


def build_once(final: str, build: Callable[[str], None]) -> str:
    """Return ``final``, building it first with ``build(tmp_dir)`` if no process has done so yet."""
    if os.path.isdir(final):
        return final
    parent = os.path.dirname(os.path.abspath(final))
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise OSError(
            f"cannot create the cache directory {parent} (data.cache_dir): {e}; "
            f"set data.cache_dir to a writable directory"
        ) from e
    with open(final + ".lock", "a+") as lock:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
        try:
            if os.path.isdir(final):
                return final
            tmp = tempfile.mkdtemp(prefix=os.path.basename(final) + ".tmp-", dir=parent)
            try:
                build(tmp)
                os.rename(tmp, final)
            except BaseException:
                shutil.rmtree(tmp, ignore_errors=True)
                raise
        finally:
            fcntl.flock(lock.fileno(), fcntl.LOCK_UN)
    return final
