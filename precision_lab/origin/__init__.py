"""Where a run's failure started: facts in, a frozen ``Origin`` out.

The analysis is pure: it reads a run's non-finite op calls and records (``RunFacts``, what the store
answers) and returns typed values; it never touches a database, so it is tested on hand-made facts.
``services.report`` reads the facts and renders the result; the Overview, the CLI, the diagnosis rules,
``bisect``/``verify`` and the localization bench all read the same ``Origin``.

Start from the failure, not from a list of suspicious ops.  A failure is a non-finite value the run was not
meant to have in what matters: the model's output (the root module's, or the last op's in a dump without one,
``model_outputs``), a gradient, a parameter.  A run whose failures hold none is healthy, whatever NaN or inf it
holds on the way (a ``+inf`` fill that ``min`` consumes, a ``finfo.min`` mask that became ``-inf`` in fp16 and
met real scores, ``log(0)`` dropped by ``where``): those are listed as intended, never blamed.  With an fp32
reference, what the reference holds too is no failure of the lower precision.

From the failure the walk goes back (``_walk``): a module call's value came from the last op inside it that
wrote one; an op that received a value that explains its own (NaN or inf in, anything out; ``-inf`` in,
``-inf`` or NaN out) came from the nearest op before it that wrote what it received; an op whose inputs were
finite (or, with a reference, held only what the reference holds) made it, and is the answer, whatever its
type: a mask whose ``-inf`` fills a whole row that a softmax turns into NaN is named, not the softmax.  A
parameter or buffer already non-finite is itself the origin, named with its value.  An op list only orders
where the order says nothing.

Each answer says what it saw and what it inferred (``guessed``): inputs not recorded, an order recovered from
the data or from names, more than one earlier op that could have written what an op received.  It is
``certain`` only when nothing was guessed, else ``likely``, with the other candidates (``others``) and what
would settle it (``decide``).  Without the model's output (hand-made facts), the first op in order whose
inputs are finite and whose output is not is named, as before: ``_pick``.
"""

from __future__ import annotations

from .analysis import analyse
from .calls import intended_output, is_additive_mask
from .values import (KINDS, ORDER_TEXT, UNKNOWN_ORDERS, ComparedRecord, Intended, NonfiniteCall, OpRef, Origin,
                     ParameterOrigin, PathStep, RunFacts, order_known, order_text)
from .walk import ModelOutputs, model_outputs

__all__ = ["Origin", "OpRef", "PathStep", "ParameterOrigin", "Intended", "RunFacts", "NonfiniteCall",
           "ComparedRecord", "analyse", "ORDER_TEXT", "order_text", "order_known", "UNKNOWN_ORDERS",
           "intended_output", "is_additive_mask", "KINDS", "ModelOutputs", "model_outputs"]
