"""Atomic directory writes: build in a hidden sibling directory, then rename into place.

A process killed mid-write leaves at most a hidden ``.partial-*`` directory, never a half-written
checkpoint, policy or model at the real path (an existing one is replaced only once the new one is
complete).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_directory(final: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield an empty temporary directory; on success it becomes ``final``, on error it is removed."""
    final = Path(final).expanduser()
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".partial-{final.name}-", dir=final.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; give it normal directory permissions
        yield tmp
        if final.exists():
            old = final.with_name(f".old-{final.name}-{uuid.uuid4().hex[:8]}")
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
