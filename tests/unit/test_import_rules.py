"""The layout's import rules hold (tests/import_rules.py), and the check sees breaches."""

from __future__ import annotations

from tests import import_rules


def test_the_tree_keeps_the_import_rules() -> None:
    assert import_rules.breaches() == []


def test_a_cycle_is_found_whatever_its_length() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e"}}
    assert import_rules.cycles(graph) == [["a", "b", "c"]]


def test_an_api_module_importing_workers_is_a_breach() -> None:
    graph = {"api.x": {"workers.y", "db.z"}, "workers.y": {"api.x"}, "db.z": set()}
    assert import_rules.forbidden_imports(graph) == ["api.x imports workers.y"]


def test_imports_inside_functions_count() -> None:
    graph = import_rules.import_graph()
    # workers/executors/__init__.py imports its executors inside build_executor.
    assert "workers.executors.local" in graph["workers.executors"]


def test_an_api_module_importing_celery_code_or_the_engine_is_a_breach() -> None:
    graph = {"api.x": {"tasks.generate", "models.engine", "jobs.events", "fleet.registry"}}
    assert import_rules.forbidden_imports(graph) == [
        "api.x imports models.engine",
        "api.x imports tasks.generate",
    ]


def test_the_neutral_packages_import_neither_side() -> None:
    graph = {
        "jobs.a": {"fleet.b", "tasks.celery", "api.errors"},
        "fleet.b": {"jobs.a", "workers.c", "api.jobs"},
    }
    assert import_rules.forbidden_imports(graph) == [
        "fleet.b imports api.jobs",
        "fleet.b imports workers.c",
        "jobs.a imports api.errors",
        "jobs.a imports fleet.b",
        "jobs.a imports tasks.celery",
    ]


def test_importing_the_command_line_is_a_breach() -> None:
    graph = {"workers.a": {"cli.main"}, "cli.main": {"cli.scaling", "workers.a"}}
    assert import_rules.forbidden_imports(graph) == ["workers.a imports cli.main"]
