"""Precision policies, the fix catalogue, recipes, diagnosis, re-runs and op replay.

- ``policy``: ``PrecisionPolicy`` / ``QuantConfig`` (frozen) and named presets.
- ``islands``: which modules a pattern reaches, tied tensors, what an fp32 island changes.
- ``prepare``: a policy applied to a model, and the hooks on modules that are not policy-aware.
- ``trees``: the one cast of a tree of tensors, a model's call and its first output tensor.
- ``catalogue``: fixes as named edits of a policy (``parse_fix``, ``apply_fixes``).
- ``modules``: policy-aware building blocks and the kernels they compute with.
- ``recipes``: reproducible models that fail under a policy (``get_recipe``).
- ``rulebook``: the one registry of diagnosis rules (``register_rule``) and what a rule sees.
- ``facts``: the typed rows a rule reads, and facts added by name (``register_fact``).
- ``op_rules`` / ``run_rules``: the built-in rules; ``rules``: a run's diagnosis from them.
- ``replay``: re-run one dumped op from its dumped inputs.

Submodules import torch only where they run models.
"""
