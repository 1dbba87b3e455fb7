"""Pre-start actions and their validation, without any service."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

import pytest
from pydantic import TypeAdapter

from config.catalog import CatalogError, PreStartAction, load_definition
from workers.prestart import PreStartFailed, run_prestart

ACTIONS = TypeAdapter(list[PreStartAction])


def actions(raw: list[dict[str, object]]) -> list[PreStartAction]:
    return ACTIONS.validate_python(raw)


def test_actions_run_in_order_and_relative_files_land_under_the_state_folder(
    tmp_path: Path,
) -> None:
    marker = tmp_path / "ran.txt"
    run_prestart(
        actions(
            [
                {"action": "write_file", "path": "conf/app.ini", "body": "x=1\n", "mode": "0600"},
                {
                    "action": "run_command",
                    "args": [sys.executable, "-c", f"open({str(marker)!r}, 'w').write('ok')"],
                },
            ]
        ),
        tmp_path,
    )
    written = tmp_path / "conf" / "app.ini"
    assert written.read_text() == "x=1\n"
    assert stat.S_IMODE(written.stat().st_mode) == 0o600
    assert marker.read_text() == "ok"


def test_a_failing_command_names_the_action_its_status_and_its_output(tmp_path: Path) -> None:
    after = tmp_path / "never.txt"
    with pytest.raises(PreStartFailed) as caught:
        run_prestart(
            actions(
                [
                    {"action": "run_command", "args": ["sh", "-c", "echo disk full >&2; exit 3"]},
                    {"action": "write_file", "path": str(after), "body": "x"},
                ]
            ),
            tmp_path,
        )
    message = str(caught.value)
    assert message.startswith("pre_start_actions[0] (run_command sh)")
    assert "exited with status 3" in message and "disk full" in message
    assert caught.value.index == 0
    assert not after.exists()  # the sequence stops at the first failure


def test_a_slow_command_is_stopped_at_its_timeout(tmp_path: Path) -> None:
    with pytest.raises(PreStartFailed, match=r"timed out after 0\.2 s"):
        run_prestart(
            actions([{"action": "run_command", "args": ["sleep", "5"], "timeout_s": 0.2}]),
            tmp_path,
        )


def test_a_missing_program_and_an_unwritable_path_are_reported(tmp_path: Path) -> None:
    with pytest.raises(PreStartFailed, match="no such program"):
        run_prestart(actions([{"action": "run_command", "args": ["no-such-tool-xyz"]}]), tmp_path)
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(PreStartFailed, match=r"pre_start_actions\[0\] \(write_file"):
        run_prestart(
            actions([{"action": "write_file", "path": str(blocker / "sub"), "body": "x"}]),
            tmp_path,
        )


def test_bad_actions_in_a_definition_name_the_field(tmp_path: Path) -> None:
    path = tmp_path / "m.yaml"
    path.write_text(
        "name: m\n"
        "source: {kind: local, path: /nowhere}\n"
        "pre_start_actions:\n"
        "  - action: run_command\n"
        "    args: []\n"
    )
    with pytest.raises(CatalogError) as caught:
        load_definition(path)
    assert caught.value.field.startswith("pre_start_actions.0")
    path.write_text(
        "name: m\nsource: {kind: local, path: /nowhere}\npre_start_actions:\n  - action: reboot\n"
    )
    with pytest.raises(CatalogError) as caught:
        load_definition(path)
    assert caught.value.field.startswith("pre_start_actions.0")
    path.write_text(
        "name: m\nsource: {kind: local, path: /nowhere}\nhealth_check: {timeout_s: 0}\n"
    )
    with pytest.raises(CatalogError) as caught:
        load_definition(path)
    assert caught.value.field == "health_check.timeout_s"
