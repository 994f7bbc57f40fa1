"""Module entries of the registry: every module of this package is one entry, and importing the
package imports (so registers) each of them; a new module is a new file, with no list to edit."""

import importlib
import pkgutil

for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    importlib.import_module(f"{__name__}.{_info.name}")
