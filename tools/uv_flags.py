"""Prints the flags that make `uv pip install` take packages from where pip is configured to take them on this
machine: pip's index, extra indexes, find-links folders and constraints files, as `pip config list` reports them (its
configuration files and ``PIP_*`` variables). uv reads none of pip's configuration itself.

    uv pip install $(python tools/uv_flags.py) torch==2.13.0

The Makefile installs with uv (about 10 s on the 2-core CI machine, where pip took 100-250 s, most of it resolving and
unpacking) and falls back to pip when uv fails.
"""

from __future__ import annotations

import shlex
import subprocess
import sys

FLAGS = {"index-url": "--index-url", "extra-index-url": "--extra-index-url", "find-links": "--find-links",
         "constraint": "--constraint"}


def uv_flags(pip_config: str) -> list[str]:
    """``pip_config``: `pip config list`'s lines (``global.find-links='/opt/wheels'``, ``:env:.constraint='a b'``);
    each value of a key uv has a flag for, in order, once."""
    flags: list[str] = []
    for line in pip_config.splitlines():
        key, _, value = line.partition("=")
        flag = FLAGS.get(key.rpartition(".")[2])
        if flag is None:
            continue
        for item in shlex.split(value)[0].split() if value else ():
            if [flag, item] not in (flags[i:i + 2] for i in range(0, len(flags), 2)):
                flags += [flag, item]
    return flags


def main() -> None:
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    print(shlex.join(uv_flags(listed.stdout)))


if __name__ == "__main__":
    main()
