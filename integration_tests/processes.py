"""Engine stand-ins run as their own OS processes, spoken to with JSON lines over stdin / stdout."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class JsonLineProcess:
    """``python -m MODULE ARGS...``: reads its first line (``ready``) and answers one line per command."""

    def __init__(self, module: str, args: list[str], env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT,
                                     env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.ready = self.read()

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        while line and not line.startswith("{"):  # a library printing to stdout
            line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"process died: {self.proc.stderr.read()[-4000:]}")
        return json.loads(line)

    def ask(self, command: dict) -> dict:
        self.proc.stdin.write(json.dumps(command) + "\n")
        self.proc.stdin.flush()
        return self.read()

    def close(self) -> str:
        """Ask it to exit (releasing its store); returns what it wrote to stderr."""
        if self.proc.poll() is None:
            with contextlib.suppress(AssertionError, BrokenPipeError):
                self.ask({"exit": True})
        try:
            _, err = self.proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        return err


def serve(handlers: dict[str, Callable[[dict], dict]], on_exit: Callable[[], None]) -> None:
    """The other side of :class:`JsonLineProcess`: for each line ``{name: args}`` on stdin, print
    ``handlers[name](args)``; on ``{"exit": true}`` run ``on_exit`` and end the process at once (engine
    libraries' worker threads would keep the interpreter alive)."""
    for line in sys.stdin:
        command = json.loads(line)
        if command.get("exit"):
            on_exit()
            print(json.dumps({"exited": True}), flush=True)
            sys.stderr.flush()
            os._exit(0)
        ((name, args),) = command.items()
        print(json.dumps(handlers[name](args)), flush=True)
    os._exit(1)


def stop_process(proc: subprocess.Popen | None, timeout: float) -> None:
    """SIGTERM a process still running, SIGKILL it if it has not exited within ``timeout`` seconds."""
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=timeout)

