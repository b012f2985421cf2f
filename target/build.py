"""Headway's C++ kernels built with torch's extension builder, in a way an interrupted build cannot
break.

torch's builder guards each extension's build directory with a lock file that it creates before
compiling and deletes after (`FileBaton`). A build killed midway (Ctrl-C during the first `headway
demo`'s compile, SIGKILL, a lost machine) leaves that file behind, and every later build of the
extension then waits for it forever, printing nothing. So Headway takes its own lock first: an flock
on a file beside torch's, which the kernel releases when its holder dies, however it dies. Whoever
holds it is the only Headway process building that extension, so a torch lock file found then was
left by a dead build: it is removed (with a warning that names it) and the build runs again; the
compiler's own build log reruns whatever the dead build left unfinished. Two processes that build at
once still share one build: the second waits on the flock, then finds the extension built. A build
that another live process holds for longer than `HEADWAY_BUILD_WAIT_S` seconds (default 900) stops
with a message naming the lock.
"""

from __future__ import annotations

import fcntl
import logging
import os
import time
from typing import Any, Sequence

from torch.utils import cpp_extension

from headway.errors import HeadwayError

log = logging.getLogger("headway")

# Headway's flock, beside torch's `lock` in the extension's build directory
LOCK_NAME = "headway-build.lock"
# how long to wait for another process's build of the same extension
WAIT_ENV = "HEADWAY_BUILD_WAIT_S"
# a first build of the layer loop takes about 30 s on 2 cores; this leaves room
DEFAULT_WAIT_S = 900.0


def build_directory(name: str) -> str:
    """The directory torch's builder uses for extension `name` (under TORCH_EXTENSIONS_DIR), created
    if absent."""
    return cpp_extension._get_build_directory(name, False)


def load_extension(
    name: str,
    sources: Sequence[str],
    extra_cflags: Sequence[str],
    announce: str = "",
    **kwargs: Any,
) -> Any:
    """`torch.utils.cpp_extension.load(name, sources, extra_cflags=..., **kwargs)`, under Headway's
    build lock.

    Args:
        name: the extension's name (its build directory's).
        sources: the C++ files.
        extra_cflags: compiler flags.
        announce: a line to log where the library has to be compiled (not where it is only loaded).
        kwargs: passed on to torch's `load` (e.g. `is_python_module=False`).
    Returns:
        What torch's `load` returns: the module (or, for `is_python_module=False`, the library's
        path).
    """
    directory = build_directory(name)
    lock_path = os.path.join(directory, LOCK_NAME)
    with open(lock_path, "a") as lock:
        _acquire(lock, lock_path, name)
        try:
            if announce and not _built_after(os.path.join(directory, f"{name}.so"), sources):
                log.info(announce)
            stale = os.path.join(directory, "lock")
            if os.path.exists(stale):
                log.warning(
                    "removing %s, left by an interrupted build of %s; building it again",
                    stale,
                    name,
                )
                os.remove(stale)
            return cpp_extension.load(
                name,
                list(sources),
                extra_cflags=list(extra_cflags),
                build_directory=directory,
                **kwargs,
            )
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _built_after(library: str, sources: Sequence[str]) -> bool:
    """Whether `library` exists and is newer than every file beside the sources (their headers
    included): what torch's builder will only load. (It decides by the compiler's own dependency
    list; this only chooses whether to say that a build is starting.)"""
    if not os.path.isfile(library):
        return False
    folders = {os.path.dirname(os.path.abspath(source)) for source in sources}
    newest = max(
        os.path.getmtime(os.path.join(folder, entry))
        for folder in folders
        for entry in os.listdir(folder)
    )
    return os.path.getmtime(library) >= newest


def _acquire(lock: Any, lock_path: str, name: str) -> None:
    """Take the flock, waiting (with one message) while another live process builds the same
    extension."""
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return
    except BlockingIOError:
        pass
    wait_s = float(os.environ.get(WAIT_ENV, DEFAULT_WAIT_S))
    log.info("waiting for another process that is building %s (lock: %s)", name, lock_path)
    deadline = time.monotonic() + wait_s
    while True:
        time.sleep(0.2)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise HeadwayError(
                    f"another process has been building {name} for over {wait_s:.0f} s (it holds "
                    f"{lock_path}): wait for it or stop it, then rerun; raise {WAIT_ENV} to wait longer"
                ) from None
