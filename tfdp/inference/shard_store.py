"""The files of a prediction run in `output_dir`, and the rules that make a
rerun resume it.

    output_dir/
      run.json                      what is being scored: the model's identity,
                                    the input size, shard size, format, key
      part-WWWWW-SSSSS.<ext>        shard S, written by worker W
      entries/SSSSS.json            shard S is complete (written after its file)
      index.json                    every shard is complete (written last)

Every file appears under its final name by an atomic rename, so a reader (or
a rerun) sees a file whole or not at all:

- A shard's data file is written under a temporary name and renamed; then its
  entry is written. A shard is complete when its entry exists and names a file
  of the recorded size. A worker killed mid-shard leaves only a temporary file
  (or a data file without an entry): the rerun deletes it and redoes the shard.
- `run.json` is written by whichever worker starts first; every worker writes
  the same bytes, so a race is harmless. A rerun whose model, input size,
  shard size, format or key differ is refused before anything is written.
- `index.json` is written by every worker that, after completing its own
  shards, finds every shard complete; the last one to finish always does.

The layout is for a local or shared POSIX filesystem (NFS, Lustre): renames
must be atomic. Object stores (GCS, S3) are not supported.
"""

from __future__ import annotations

import glob
import json
import os
import uuid
from typing import Mapping

from tfdp.inference import shard_formats
from tfdp.inference.shard_layout import ShardLayout

RUN_FILE = "run.json"
INDEX_FILE = "index.json"
ENTRIES_DIR = "entries"
FORMAT_VERSION = 1

#: run.json fields that must match for a rerun to continue a run. Of the
#: model, only its weights' fingerprint counts (its name or checkpoint path
#: may be recorded beside it, for people).
IDENTITY_FIELDS = ("model", "num_examples", "shard_size", "output_format", "key")


def _identity(run: dict, field: str):
    value = run.get(field)
    return value.get("fingerprint") if field == "model" and isinstance(value, dict) else value


class OutputDirError(ValueError):
    """`output_dir` cannot be used: unwritable, or it holds another run."""


def _write_atomically(path: str, text: str) -> None:
    scratch = f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    with open(scratch, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(scratch, path)


def _dumps(value) -> str:
    return json.dumps(value, indent=2, sort_keys=True) + "\n"


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


class ShardStore:
    """The prediction files in `output_dir`.

    Args:
        output_dir: the directory (created if missing).
        output_format: one of `shard_formats.FORMATS`.
    """

    def __init__(self, output_dir: str, output_format: str):
        self.output_dir = output_dir
        self.output_format = output_format
        self.extension = shard_formats.EXTENSIONS[output_format]

    # -- the run --------------------------------------------------------

    def check_writable(self) -> None:
        """Creates `output_dir` and checks a file can be written there.

        Raises:
            OutputDirError: it cannot be created or written.
        """
        probe = os.path.join(self.output_dir, f".write-check-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        try:
            os.makedirs(os.path.join(self.output_dir, ENTRIES_DIR), exist_ok=True)
            with open(probe, "w") as f:
                f.write("ok")
            os.remove(probe)
        except OSError as error:
            raise OutputDirError(
                f"output_dir {self.output_dir!r} is not writable ({error.strerror or error}). "
                f"Pick a directory this process can write to."
            ) from None

    def read_run(self) -> dict | None:
        return _read_json(os.path.join(self.output_dir, RUN_FILE))

    def claim(self, run: dict) -> bool:
        """Records `run` in `run.json`, or checks it matches the recorded one.

        Returns:
            Whether `output_dir` already held this run (a resume).

        Raises:
            OutputDirError: `output_dir` holds another run (another model,
                input size, shard size, format or key); nothing is changed.
        """
        recorded = self.read_run()
        if recorded is None:
            if glob.glob(os.path.join(self.output_dir, "part-*")) or os.path.exists(
                os.path.join(self.output_dir, INDEX_FILE)
            ):
                raise OutputDirError(
                    f"output_dir {self.output_dir!r} holds prediction files but no {RUN_FILE}, "
                    f"so what they are is unknown. Use a new output_dir (nothing was changed)."
                )
            _write_atomically(os.path.join(self.output_dir, RUN_FILE), _dumps(run))
            return False
        differences = [
            f"{field} {_identity(recorded, field)!r} there vs {_identity(run, field)!r} now"
            for field in IDENTITY_FIELDS
            if _identity(recorded, field) != _identity(run, field)
        ]
        if differences:
            raise OutputDirError(
                f"output_dir {self.output_dir!r} holds predictions of another run: "
                + "; ".join(differences)
                + ". Nothing was changed. Use a new output_dir, or delete this one to "
                "score again."
            )
        return True

    # -- shards ---------------------------------------------------------

    def shard_file(self, shard: int, worker: int) -> str:
        return f"part-{worker:05d}-{shard:05d}.{self.extension}"

    def _entry_path(self, shard: int) -> str:
        return os.path.join(self.output_dir, ENTRIES_DIR, f"{shard:05d}.json")

    def completed(self, layout: ShardLayout) -> dict[int, dict]:
        """The complete shards' entries, by shard; entries whose file is
        missing or of another size are not complete."""
        done = {}
        for shard in range(layout.num_shards):
            entry = _read_json(self._entry_path(shard))
            if entry is None:
                continue
            path = os.path.join(self.output_dir, entry["file"])
            first, count = layout.bounds(shard)
            if (
                os.path.isfile(path)
                and os.path.getsize(path) == entry["bytes"]
                and (entry["first"], entry["count"]) == (first, count)
            ):
                done[shard] = entry
        return done

    def start_shard(self, shard: int, worker: int) -> tuple[str, str]:
        """Deletes what an earlier attempt left of `shard` (it has no valid
        entry); returns `(temporary path, final file name)` to write it to."""
        try:
            os.remove(self._entry_path(shard))
        except FileNotFoundError:
            pass
        pattern = f"part-*-{shard:05d}.{self.extension}"
        for leftover in glob.glob(os.path.join(self.output_dir, pattern)) + glob.glob(
            os.path.join(self.output_dir, f".{pattern}.tmp-*")
        ):
            os.remove(leftover)
        name = self.shard_file(shard, worker)
        scratch = os.path.join(self.output_dir, f".{name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
        return scratch, name

    def commit_shard(
        self, scratch: str, name: str, *, shard: int, worker: int, first: int, count: int,
        columns: Mapping[str, shard_formats.Column],
    ) -> dict:
        """Renames the written `scratch` file to `name`, then writes the entry."""
        path = os.path.join(self.output_dir, name)
        os.replace(scratch, path)
        entry = {
            "shard": shard, "file": name, "worker": worker, "first": first, "count": count,
            "bytes": os.path.getsize(path),
            "columns": {k: c.to_json() for k, c in columns.items()},
        }
        _write_atomically(self._entry_path(shard), _dumps(entry))
        return entry

    # -- the index ------------------------------------------------------

    def write_index_if_complete(self, run: dict, layout: ShardLayout) -> dict | None:
        """Writes `index.json` if every shard is complete; returns it, else `None`."""
        done = self.completed(layout)
        if len(done) < layout.num_shards:
            return None
        entries = [done[s] for s in range(layout.num_shards)]
        columns = entries[0]["columns"]
        for entry in entries[1:]:
            if entry["columns"] != columns:
                raise ValueError(
                    f"Shards {entries[0]['file']} and {entry['file']} in {self.output_dir!r} "
                    f"hold different columns ({columns} vs {entry['columns']}); the model's "
                    f"outputs changed between batches. Delete the directory and score again."
                )
        index = {
            **run, "format_version": FORMAT_VERSION, "columns": columns,
            "shards": [{k: e[k] for k in ("shard", "file", "first", "count", "bytes", "worker")}
                       for e in entries],
        }
        _write_atomically(os.path.join(self.output_dir, INDEX_FILE), _dumps(index))
        return index

    def read_index(self) -> dict | None:
        return _read_json(os.path.join(self.output_dir, INDEX_FILE))
