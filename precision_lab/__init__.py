"""Precision Lab: find where a model's numbers go wrong in low precision.

Light to import: torch and the capture machinery load only when used.
"""

from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["capture", "capture_pair", "__version__"]


def __getattr__(name):
    # Deferred so that `import precision_lab` does not import torch.
    if name in ("capture", "capture_pair"):
        from .services import capture as _capture  # deferred: it imports torch

        return getattr(_capture, name)
    raise AttributeError(f"module 'precision_lab' has no attribute {name!r}")
