"""Imported only in the forkserver of :class:`~phantora_assets.instance.launcher.ForkRunLauncher`
(its first preload module): moves that process into a session of its own, so that the run workers
it forks are not in the daemon's process group. A signal to that group (``kill -- -PGID``, Ctrl-C
in the daemon's terminal, a container runtime stopping the daemon) then ends the daemon but not
the runs in flight: they finish and record their outcome; the restarted daemon carries on with the
queue. (Measured: with the workers in the daemon's group, a SIGKILL of the group failed every run
in progress.) The forkserver itself still exits when its daemon does (its pipe closes)."""

import os

try:
    os.setsid()
except OSError:  # already a session leader
    pass
