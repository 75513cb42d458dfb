"""rdakit.compiler.frontend: the way in for PyTorch models (``torch.export`` programs).

:mod:`~rdakit.compiler.frontend.aten` is the registry of the aten ops the importer handles;
:mod:`~rdakit.compiler.frontend.importer` turns a program into an integer IR graph. torch is an
optional dependency (``pip install rdakit[torch]``): nothing here imports it at module level.
"""
