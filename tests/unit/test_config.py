"""Settings and model definitions: bad values stop start-up with a precise message."""

from __future__ import annotations

from pathlib import Path

import pytest

from config import CatalogError, SettingsError, load_catalog, load_settings
from config.settings import PROJECT_ROOT, default_state_dir


def test_defaults_need_no_environment() -> None:
    s = load_settings({})
    assert s.database_url.startswith("sqlite:///")
    assert s.key("job", "abc") == "sy:job:abc"


def test_state_lives_in_the_checkout_or_the_users_home(tmp_path: Path) -> None:
    assert load_settings({}).state_dir == PROJECT_ROOT / ".switchyard"  # a checkout
    assert load_settings({}).database_url == f"sqlite:///{PROJECT_ROOT}/.switchyard/switchyard.db"
    site = tmp_path / "site-packages"  # an installed copy: no pyproject.toml beside it
    site.mkdir()
    home = tmp_path / "home"
    assert default_state_dir(site, home) == home / ".local" / "state" / "switchyard"
    (site / "pyproject.toml").touch()
    assert default_state_dir(site, home) == site / ".switchyard"


def test_environment_is_read_with_conventional_and_prefixed_names() -> None:
    s = load_settings(
        {
            "DATABASE_URL": "postgresql://x/y",
            "REDIS_URL": "redis://r:1/2",
            "SWITCHYARD_API_PORT": "9000",
        }
    )
    # A bare postgresql:// gets the installed driver (SQLAlchemy would pick psycopg 3).
    assert (s.database_url, s.redis_url, s.api_port) == (
        "postgresql+psycopg2://x/y",
        "redis://r:1/2",
        9000,
    )


@pytest.mark.parametrize(
    ("given", "used"),
    [
        ("postgres://u:p@h:5432/d", "postgresql+psycopg2://u:p@h:5432/d"),
        ("postgresql://u@h/d?sslmode=require", "postgresql+psycopg2://u@h/d?sslmode=require"),
        ("postgresql+psycopg2://u@h/d", "postgresql+psycopg2://u@h/d"),
        ("postgresql+psycopg://u@h/d", "postgresql+psycopg://u@h/d"),
        ("sqlite:////tmp/x.db", "sqlite:////tmp/x.db"),
    ],
)
def test_postgres_urls_use_the_installed_driver(given: str, used: str) -> None:
    from sqlalchemy import create_engine

    s = load_settings({"DATABASE_URL": given})
    assert s.database_url == used
    if used.startswith("postgresql+psycopg2"):
        create_engine(s.database_url)  # the driver loads (no connection is made)


@pytest.mark.parametrize(
    ("env", "variable"),
    [
        ({"SWITCHYARD_API_PORT": "eighty"}, "SWITCHYARD_API_PORT"),
        ({"SWITCHYARD_API_PORT": "70000"}, "SWITCHYARD_API_PORT"),
        ({"SWITCHYARD_LOG_LEVEL": "LOUD"}, "SWITCHYARD_LOG_LEVEL"),
        ({"SWITCHYARD_STREAM_TTL_S": "-1"}, "SWITCHYARD_STREAM_TTL_S"),
        ({"SWITCHYARD_API_PROT": "8000"}, "SWITCHYARD_API_PROT"),
    ],
)
def test_bad_setting_names_the_variable(env: dict[str, str], variable: str) -> None:
    with pytest.raises(SettingsError) as info:
        load_settings(env)
    assert info.value.variable == variable
    assert variable in str(info.value)


def test_shipped_catalog_is_valid() -> None:
    catalog = load_catalog(PROJECT_ROOT / "config" / "models")
    assert {"smollm2-135m", "tiny-random"} <= set(catalog.names)
    assert catalog["tiny-random"].limits.max_input_tokens == 512


def _write(folder: Path, name: str, body: str) -> None:
    (folder / f"{name}.yaml").write_text(body)


GOOD = "name: {name}\nsource: {{kind: local, path: /tmp/x}}\n"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ("name: bad\nsource: {kind: local}\n", "source.local.path"),
        ("name: bad\nsource: {kind: teleport}\n", "source"),
        (
            "name: bad\nsource: {kind: local, path: /x}\nlimits: {max_batch_size: 0}\n",
            "limits.max_batch_size",
        ),
        (
            "name: bad\nsource: {kind: local, path: /x}\n"
            "scaling: {min_replicas: 3, max_replicas: 1}\n",
            "scaling",
        ),
        ("name: bad\nsource: {kind: local, path: /x}\ncolour: red\n", "colour"),
        (
            "name: bad\nsource: {kind: local, path: /x}\nquantization: int4-a8\ndevice: cuda\n",
            "(file)",
        ),
        ("name: other\nsource: {kind: local, path: /x}\n", "name"),
        ("- a list\n", "(file)"),
        ("name: [unclosed\n", "(file)"),
    ],
)
def test_bad_definition_names_file_and_field(tmp_path: Path, body: str, field: str) -> None:
    _write(tmp_path, "good", GOOD.format(name="good"))
    _write(tmp_path, "bad", body)
    with pytest.raises(CatalogError) as info:
        load_catalog(tmp_path)
    assert info.value.path.name == "bad.yaml"
    assert info.value.field == field
    assert "bad.yaml" in str(info.value)


def test_random_model_must_borrow_a_known_tokenizer(tmp_path: Path) -> None:
    _write(tmp_path, "r", "name: r\nsource: {kind: random, tokenizer_from: missing}\n")
    with pytest.raises(CatalogError) as info:
        load_catalog(tmp_path)
    assert info.value.field == "source.tokenizer_from"
