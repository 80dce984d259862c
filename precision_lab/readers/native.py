"""Our own format: Parquet shards written by live capture, plus ``manifest.json``.

A folder is ours when its ``manifest.json`` says ``"format":
"precision-lab-shards"``, or, with no manifest (a capture killed before it
wrote one), when it holds ``<run>/rank<R>/step<S>.parquet`` shards.  Reading is delegated to
``precision_lab.readers.shards.read_shards(root)``, which yields ``(run_meta,
TensorRecord)`` pairs; each distinct ``run_meta["run_id"]`` becomes one run,
keeping the kind (reference/candidate/rerun), parent, fix, policy and
warnings the capture wrote.  Shard records carry execution order (``seq``)
from capture.  The local (shadow fp32) comparisons the capture stored come
through ``local_comparisons`` and are kept as ``kind="local"`` comparisons.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Iterator

from .base import ReadError, RunSource, Tick
from .safeio import open_regular
from .shards import ShardError, read_local_comparisons, read_shards, read_timeline
from .shardtimeline import RankTimeline

__all__ = ["NativeReader", "FORMAT_NAME"]

FORMAT_NAME = "precision-lab-shards"


def _manifest(root: Path):
    p = root / "manifest.json"
    if not os.path.lexists(p):
        # a capture killed before its first manifest: the shards say what it is (read_manifest rebuilds one)
        return {} if any(root.glob("*/rank*/step*.parquet")) else None
    if p.is_symlink() or not p.is_file():
        # claimed, so that reading it refuses the link or pipe by name instead of skipping the file
        return {} if any(root.glob("*/rank*/step*.parquet")) else None
    try:
        with open_regular(p, "manifest.json", root) as f:
            head = f.read(1 << 16)
    except ReadError:
        return None
    # recognised by its format tag near the top; the whole file is parsed (within limits) by the reader
    return {} if FORMAT_NAME.encode() in head else None


class NativeReader:
    name = "precision-lab"
    priority = 100

    def detect(self, root: Path) -> bool:
        return root.is_dir() and _manifest(root) is not None

    def iter_runs(self, root: Path, tick: Tick) -> Iterator[RunSource]:
        try:
            stream = iter(read_shards(root))
            pending = next(stream, None)
        except ReadError:
            raise
        except ShardError as e:
            raise ReadError(str(e)) from None
        except (ValueError, OSError, KeyError) as e:
            raise ReadError(f"manifest.json: cannot read the shards ({e})") from None
        ticked = set()

        while pending is not None:
            meta = pending[0]
            key = str(meta.get("run_id") or meta.get("name") or "run")

            def records(key=key):
                nonlocal pending
                while pending is not None and str(pending[0].get("run_id") or pending[0].get("name") or "run") == key:
                    rec = pending[1]
                    src_file = rec.source or ""
                    if src_file and src_file not in ticked:
                        ticked.add(src_file)
                        p = root / src_file
                        tick(os.lstat(p).st_size if os.path.lexists(p) else 0, src_file)
                    yield rec
                    try:
                        pending = next(stream, None)
                    except ShardError as e:
                        raise ReadError(str(e)) from None
                    except (ValueError, OSError, KeyError) as e:
                        raise ReadError(f"manifest.json: cannot read the shards ({e})") from None

            policy = meta.get("policy")
            order = meta.get("order") or "execution"
            src = RunSource(
                key=key, name=str(meta.get("name") or key), root=root, reader=self.name, records=records(),
                order=order, order_note="capture order (seq) recorded in the shards" if order == "execution"
                else "by name, as the shards say",
                kind=meta.get("kind"), parent_key=meta.get("parent_run_id"), fix=meta.get("fix"),
                policy=policy if policy is None or isinstance(policy, str) else json.dumps(policy),
                dtype=meta.get("dtype") or None,
            )
            for w in meta.get("warnings") or []:
                where, msg = (w[0], w[1]) if isinstance(w, (list, tuple)) and len(w) == 2 else ("manifest.json", w)
                src.warnings.append((str(where), str(msg)))
            yield src
            for _ in src.records:  # the consumer may stop early; the stream must move on
                pass

    def local_comparisons(self, root: Path):
        """``(run key, output record, Comparison)`` of each op's output against its own fp32 re-run."""

        try:
            for meta, rec, cmp in read_local_comparisons(root):
                yield str(meta.get("run_id") or meta.get("name") or "run"), rec, cmp
        except ShardError as e:
            raise ReadError(str(e)) from None
        except (ValueError, OSError, KeyError) as e:
            raise ReadError(f"manifest.json: cannot read the shards' local comparisons ({e})") from None

    def timeline(self, root: Path) -> Iterator[RankTimeline]:
        """A long run's per-step summaries, per rank, each under its run's key."""
        try:
            for t in read_timeline(root):
                yield dataclasses.replace(t, run_id=str(t.run_id or "run"))
        except ShardError as e:
            raise ReadError(str(e)) from None
        except (ValueError, OSError, KeyError) as e:
            raise ReadError(f"manifest.json: cannot read the shards' timeline ({e})") from None
