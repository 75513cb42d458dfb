"""rdakit: an open Reconfigurable Dataflow Accelerator.

The package is assembled from the repository's top-level folders: ``hdl/`` is
:mod:`rdakit.hdl`, ``compiler/`` is :mod:`rdakit.compiler`, ``sim/`` is
:mod:`rdakit.sim` and ``boards/`` is :mod:`rdakit.boards`.
"""

__version__ = "0.1.0"
