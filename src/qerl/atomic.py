"""Atomic writes: build in a hidden sibling (``.partial-*``), fsync, then rename into place.

A process killed mid-write (SIGKILL, SIGTERM, a full disk) leaves at most a hidden ``.partial-*``
file or directory, never a half-written checkpoint, table, plot or model at the real path; an
existing directory is replaced only once the new one is complete. A kill between the two renames of
a directory swap leaves ``.old-<name>-*`` beside a missing ``<name>``: :func:`recover` (run at the
start of every Kedro run) renames it back and removes stale ``.partial-*`` leftovers.

``QERL_KILL_AT=<point>[:<n>]`` makes the process SIGKILL itself at the n-th pass (default 1st)
through a named point (``file_write``, ``file_rename``, ``dir_write``, ``dir_swap``): the crash
tests use it to kill a real CLI run exactly inside a write or between the two renames.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import signal
import tempfile
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from qerl.errors import QerlConfigError

log = logging.getLogger(__name__)

PARTIAL = ".partial-"
OLD = ".old-"
_HITS: Counter[str] = Counter()


def kill_point(name: str) -> None:
    """SIGKILL this process here if ``QERL_KILL_AT`` names this point (crash tests only)."""
    spec = os.environ.get("QERL_KILL_AT")
    if not spec:
        return
    point, _, nth = spec.partition(":")
    if point != name:
        return
    _HITS[name] += 1
    if _HITS[name] == int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for f in files:
            with open(os.path.join(dirpath, f), "rb") as fh:
                os.fsync(fh.fileno())
        _fsync_dir(Path(dirpath))


def _disk_full(final: Path, err: OSError) -> QerlConfigError | OSError:
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return QerlConfigError(str(final), f"could not be written: no space left on the device ({err.strerror})",
                               "free disk space and rerun; the previous version is intact")
    return err


@contextmanager
def atomic_directory(final: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield an empty temporary directory; on success it becomes ``final``, on error it is removed."""
    final = Path(final).expanduser()
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{PARTIAL}{final.name}-", dir=final.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp makes it private; give it normal directory permissions
        yield tmp
        kill_point("dir_write")
        _fsync_tree(tmp)
        if final.exists():
            old = final.with_name(f"{OLD}{final.name}-{uuid.uuid4().hex[:8]}")
            os.replace(final, old)
            kill_point("dir_swap")
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(final.parent)
    except OSError as err:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _disk_full(final, err) from err
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write(final: str | os.PathLike[str], write: Callable[[Path], None]) -> Path:
    """Call ``write(tmp_path)`` on a hidden file beside ``final``, fsync it, rename it to ``final``."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f"{PARTIAL}{final.name}-", dir=final.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        write(tmp)
        kill_point("file_write")
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, final)
        kill_point("file_rename")
        _fsync_dir(final.parent)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise _disk_full(final, err) from err
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return final


def recover(root: str | os.PathLike[str]) -> dict[str, list[str]]:
    """Clean what killed writes left under ``root``: ``.old-<name>-*`` without a ``<name>`` is renamed
    back (an interrupted swap), other ``.old-*`` and every ``.partial-*`` are removed.

    Returns ``{"restored": [...], "removed": [...]}`` (paths, for the log).
    """
    restored: list[str] = []
    removed: list[str] = []
    base = Path(root)
    if not base.exists():
        return {"restored": restored, "removed": removed}
    for dirpath, dirnames, filenames in os.walk(base):
        here = Path(dirpath)
        for name in list(dirnames) + filenames:
            if not (name.startswith(OLD) or name.startswith(PARTIAL)):
                continue
            path = here / name
            if name.startswith(OLD):
                original = here / name[len(OLD):].rsplit("-", 1)[0]
                if not original.exists():
                    os.replace(path, original)
                    restored.append(str(original))
                    continue
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
            removed.append(str(path))
        dirnames[:] = [d for d in dirnames if not (d.startswith(OLD) or d.startswith(PARTIAL))]
    for p in restored:
        log.warning("recovered %s from an interrupted write", p)
    if removed:
        log.info("removed %d leftover(s) of interrupted writes under %s", len(removed), base)
    return {"restored": restored, "removed": removed}
