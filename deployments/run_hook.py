"""What omni-ray adds to Ray Serve's ``serve run`` process, through a ``.pth`` file in site-packages (Python runs its
``import`` line at every interpreter's start; ``python -m deployments.run_hook`` writes it, as ``make install``
and the image do). With a config file ``serve run`` builds the app in a Ray task, never importing omni-ray in its
own process, so this is the only code of ours that runs there; in any other process ``install`` returns at once,
having imported nothing.

In ``serve run`` it does two things:

* A ``/tmp/ray/ray_current_cluster`` naming an address where nothing accepts a connection (left by a cluster whose
  processes were killed rather than stopped with ``ray stop``) is removed before ``ray.init`` reads it, so that
  ``serve run`` starts a local cluster instead of retrying the dead address for some 14 minutes and failing.
* Once ``ray.init`` has connected, SIGTERM raises KeyboardInterrupt in the main thread as Ctrl-C does, so ``serve
  run`` deletes its applications and exits 0: ``ray.init``'s own handler exits with status 15 past ``serve run``'s
  clean-up, after the core worker's fatal-signal handler has printed a stack dump, and sometimes aborts (status 134).
  Kubernetes and systemd stop a process with SIGTERM.
"""

from __future__ import annotations

import os
import sys

PTH_NAME = "omni_ray_serve_run.pth"
PTH_LINE = "import deployments.run_hook as hook; hook.install()\n"


def install() -> None:
    argv = getattr(sys, "argv", None) or [""]
    if os.path.basename(argv[0]) != "serve" or argv[1:2] != ["run"]:
        return
    drop_dead_address_file(argv[2:])
    import ray._private.worker

    # Run by ray.init once connected, after its SIGTERM handler and the core worker's are in place (Ray's own
    # libraries register here too).
    ray._private.worker._post_init_hooks.append(_sigterm_as_ctrl_c)


def drop_dead_address_file(args: list[str]) -> None:
    """Removes the address file that ``ray.init`` would join, when nothing answers at the address it names."""
    given = os.environ.get("RAY_ADDRESS") or None  # `serve run --address`'s default
    for i, arg in enumerate(args):
        if arg in ("-a", "--address") and i + 1 < len(args):
            given = args[i + 1]
        elif arg.startswith("--address="):
            given = arg.partition("=")[2]
    if given not in (None, "auto"):
        return  # ray.init reads the file only without an address, or with "auto"
    import socket

    from ray._common.utils import get_ray_address_file

    path, address = get_ray_address_file(None), ""
    try:
        with open(path) as file:
            address = file.read().strip()
        host, _, port = address.rpartition(":")
        with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
            return  # a GCS answers: `serve run` joins that cluster, as Ray means it to
    except FileNotFoundError:
        return
    except (OSError, ValueError):
        pass
    print(f"omni-ray: nothing answers at {address!r}, which {path} names (a Ray cluster stopped without `ray "
          "stop`): removing it, so that `serve run` starts a local cluster", file=sys.stderr)
    try:
        os.remove(path)
    except OSError:
        pass


def _sigterm_as_ctrl_c() -> None:
    import signal
    import threading

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, signal.default_int_handler)


def write_pth() -> str:
    """Writes the ``.pth`` file into this interpreter's site-packages; its path."""
    import sysconfig

    path = os.path.join(sysconfig.get_paths()["purelib"], PTH_NAME)
    with open(path, "w") as file:
        file.write(PTH_LINE)
    return path


if __name__ == "__main__":
    print(f"wrote {write_pth()}")
