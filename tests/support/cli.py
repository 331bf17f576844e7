"""Running the `specgate` command in a child process and reading its output as it comes."""

from __future__ import annotations

import queue
import sys
import threading
from pathlib import Path
from typing import Any


def specgate_command() -> list[str]:
    script = Path(sys.executable).with_name("specgate")
    return [str(script)] if script.exists() else [sys.executable, "-m", "specgate"]


def line_queue(stream: Any) -> queue.Queue[str]:
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        for line in stream:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    return lines
