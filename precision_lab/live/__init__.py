"""Live capture: hooks on a running PyTorch model.

``capture(model, ...)`` records per-op statistics while user code runs;
``capture_pair(build_model, inputs, policy, ...)`` runs an fp32 reference
and a low-precision candidate of the same model and compares them op by op
(accumulated error) and each op against its own fp32 re-run (local error).
"""

from __future__ import annotations

from .capture import Capture, capture
from .options import CaptureOptions, VIEW_OPS
from .pair import capture_pair

__all__ = ["capture", "capture_pair", "CaptureOptions", "Capture", "VIEW_OPS"]
