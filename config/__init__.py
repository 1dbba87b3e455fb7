"""Configuration: the one settings object and the model catalog.

Only this package reads ``os.environ``; everything else is handed a
:class:`Settings` instance.
"""

from config.catalog import Catalog, CatalogError, ModelDefinition, load_catalog
from config.settings import Settings, SettingsError, load_settings

__all__ = [
    "Catalog",
    "CatalogError",
    "ModelDefinition",
    "Settings",
    "SettingsError",
    "load_catalog",
    "load_settings",
]
