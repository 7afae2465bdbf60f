"""Imported only in the forkserver of :class:`~phantora_assets.instance.launcher.ForkRunLauncher`
(its first preload module): moves that process into a session of its own, so that the run workers
it forks are not in the daemon's process group. A signal to that group (``kill -- -PGID``, Ctrl-C
in the daemon's terminal, a container runtime stopping the daemon) then ends the daemon but not
the runs in flight: they finish and record their outcome; the restarted daemon carries on with the
queue. (Measured: with the workers in the daemon's group, a SIGKILL of the group failed every run
in progress.) The forkserver itself still exits when its daemon does (its pipe closes).

It also blocks ``worker.CANCEL_SIGNAL`` (SIGUSR1, whose default action ends a process): a
worker forked from it keeps the signal pending until the worker's thread waits for it, so a
terminate that reaches a worker before its first run starts never kills it."""

import os
import signal

signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})

try:
    os.setsid()
except OSError:  # already a session leader
    pass
