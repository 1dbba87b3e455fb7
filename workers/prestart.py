"""Pre-start actions: what a model definition asks a worker to do before it loads the model.

Actions run in file order. ``run_command`` runs its ``args`` with no shell,
bounded by its ``timeout_s``; ``write_file`` writes its ``body`` (relative
paths land under the state folder). The first failure stops the sequence and
raises :class:`PreStartFailed`, whose message names the action and says why —
the worker reports it in its heartbeat (state ``failed``) and never consumes
its queue, so the model's jobs stay queued for a healthy worker.
"""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path

from config.catalog import PreStartAction, RunCommand, WriteFile

log = logging.getLogger(__name__)

# How much of a failed command's output its error message quotes, in characters.
OUTPUT_TAIL_CHARS = 500


class PreStartFailed(RuntimeError):
    """A pre-start action failed; ``index`` is its place in ``pre_start_actions``."""

    def __init__(self, index: int, action: str, reason: str) -> None:
        super().__init__(f"pre_start_actions[{index}] ({action}): {reason}")
        self.index = index
        self.action = action
        self.reason = reason


def _tail(output: bytes | str | None) -> str:
    if not output:
        return ""
    text = output.decode(errors="replace") if isinstance(output, bytes) else output
    return text.strip()[-OUTPUT_TAIL_CHARS:]


def _run_command(index: int, action: RunCommand, env: dict[str, str] | None) -> None:
    label = f"run_command {action.args[0]}"
    try:
        done = subprocess.run(
            action.args,
            capture_output=True,
            timeout=action.timeout_s,
            env=env,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except FileNotFoundError:
        raise PreStartFailed(index, label, "no such program") from None
    except PermissionError:
        raise PreStartFailed(index, label, "not executable") from None
    except subprocess.TimeoutExpired:
        raise PreStartFailed(index, label, f"timed out after {action.timeout_s:g} s") from None
    if done.returncode != 0:
        output = _tail(done.stderr) or _tail(done.stdout)
        detail = f": {output}" if output else ""
        raise PreStartFailed(index, label, f"exited with status {done.returncode}{detail}")
    log.info("pre-start %d: %s ok", index, label)


def _write_file(index: int, action: WriteFile, state_dir: Path) -> None:
    path = Path(action.path).expanduser()
    if not path.is_absolute():
        path = state_dir / path
    label = f"write_file {path}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(action.body, encoding="utf-8")
        os.chmod(path, int(action.mode, 8))
    except OSError as exc:
        raise PreStartFailed(index, label, exc.strerror or str(exc)) from None
    log.info("pre-start %d: %s ok", index, label)


def run_prestart(
    actions: Sequence[PreStartAction], state_dir: Path, env: dict[str, str] | None = None
) -> None:
    """Run every action in order; raise :class:`PreStartFailed` at the first failure.

    ``env`` is the environment of commands (default: this process's).
    """
    for index, action in enumerate(actions):
        if isinstance(action, RunCommand):
            _run_command(index, action, env)
        else:
            _write_file(index, action, state_dir)
