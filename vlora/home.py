"""Everything a run writes stays under its home (${paths.home}, VLORA_HOME): the third-party
libraries that keep settings, fonts or caches under the user's home directory are pointed there.

ultralytics writes settings.json and downloads its fonts into YOLO_CONFIG_DIR (else
~/.config/Ultralytics), matplotlib its font cache into MPLCONFIGDIR (else ~/.config/matplotlib and
~/.cache/matplotlib); both read the variable once, when first imported. `pin_tool_dirs` runs before
every command (vlora.config.hydra_entry), so no import order can escape it. A variable the user set
is kept.
"""

from __future__ import annotations

import os
from pathlib import Path

TOOL_DIRS = {"YOLO_CONFIG_DIR": "ultralytics", "MPLCONFIGDIR": "matplotlib"}  # variable -> folder under home


def pin_tool_dirs(home: str | os.PathLike) -> dict[str, str]:
    """Sets each unset variable of TOOL_DIRS to its folder under `home` (absolute: a later chdir
    cannot move it); returns the variables set."""
    pinned = {}
    for variable, folder in TOOL_DIRS.items():
        if not os.environ.get(variable):
            pinned[variable] = os.environ[variable] = str(Path(home).expanduser().resolve() / folder)
    return pinned
