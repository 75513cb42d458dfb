"""The host driver's old import path, kept for scripts written against it: everything is in
:mod:`rdakit.sim.runtime.host` now (docs/architecture.md)."""

from rdakit.sim.runtime.host import *  # noqa: F403
from rdakit.sim.runtime.host import __all__  # noqa: F401
