"""Precision policies, the fix catalogue, recipes, diagnosis, re-runs and op replay.

- ``policy``: ``PrecisionPolicy`` / ``QuantConfig`` (frozen) and named presets.
- ``catalogue``: fixes as named edits of a policy (``parse_fix``, ``apply_fixes``).
- ``modules``: policy-aware building blocks and the kernels they compute with.
- ``recipes``: reproducible models that fail under a policy (``get_recipe``).
- ``diagnose``: rules that explain a session's failure and rank fixes.
- ``rerun``: capture a recipe, re-run a session under a fix, fp32-island search.
- ``jobs``: re-runs in a background thread (the dashboard's button).
- ``replay``: re-run one dumped op from its dumped inputs.

Submodules import torch only where they run models.
"""
