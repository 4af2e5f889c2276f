"""Presto kernels: fast implementations, each beside a plain-torch reference.

A leaf package: it imports only torch and the standard library, never ``runtime``,
``loaders`` or ``submission``. Every fast kernel added here has a readable reference next
to it (``optim_reference`` for optimizer steps and gradient norms/clipping) and a test that
holds the two equal; ``runtime`` chooses between them by name (``backend=``).
"""
