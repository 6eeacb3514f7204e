"""The Grafana dashboard generator, deploy/grafana/dashboard.py, loaded as a module for the tests.

It is a maintainer's script that lives beside the provisioning it writes, not a module of a package:
`load_dashboard()` imports it from its path (once), so tests can call its `build()` and `main()`.
"""

from __future__ import annotations

import functools
import importlib.util
from pathlib import Path
from types import ModuleType

DASHBOARD_SCRIPT = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "dashboard.py"


@functools.cache
def load_dashboard() -> ModuleType:
    """deploy/grafana/dashboard.py as a module (its `__main__` block does not run)."""
    spec = importlib.util.spec_from_file_location("parallax_grafana_dashboard", DASHBOARD_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
