"""Live capture: hooks on a running PyTorch model (``Capture``, in ``live.recorder``).

Record one training step of a model in fp16, into the default database::

    import torch, precision_lab
    from precision_lab.live import CaptureOptions

    with precision_lab.capture(model, run="fp16", dtype_policy=torch.float16,
                               options=CaptureOptions(steps=10)) as cap:
        for batch in loader:
            loss = loss_fn(cap.model(cap.prepare_inputs(batch)))
            loss.backward()
            optimizer.step()
            cap.step()

An fp32 reference and a candidate of the same model, compared op by op
(accumulated error) and each op against its own fp32 re-run (local error),
is a use case over this package (``precision_lab.services.capture``)::

    from precision_lab.live import PairOptions

    session = precision_lab.capture_pair(build_model, inputs, torch.float16,
                                         store=Store(), pair=PairOptions(loss_fn=loss_fn))

In a process that cannot hold the database (a training job, one process per
rank), pass ``shard_dir=`` instead of ``store=``: each rank writes
``<shard_dir>/<run>/rank<R>/step<S>.parquet`` and merges its run into
``<shard_dir>/manifest.json``; ``precision-lab ingest <shard_dir>`` reads them.
"""

from __future__ import annotations

from ..ops import VIEW_OPS
from .options import CaptureOptions, PairOptions
from .recorder import Capture

__all__ = ["Capture", "CaptureOptions", "PairOptions", "VIEW_OPS"]
