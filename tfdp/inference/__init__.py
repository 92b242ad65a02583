"""Data-parallel batch inference: `tfdp.predict` and `tfdp.read_predictions`.

Every worker scores its own output shards on all of its local replicas and
writes them itself; nothing is all-gathered and no collective runs, so a
stopped worker never holds the others up, and a rerun scores only the shards
that are not complete. Modules:

- `shard_layout`: which examples make which output shard, and which worker
  scores it (pure arithmetic, the same in every process).
- `shard_store`: the files in `output_dir` (run record, shard entries, index)
  and the rules that make them resumable and safe to share.
- `shard_formats`: TFRecord, `.npz` and Parquet shard writers and readers.
- `replica_forward`: one worker's batches through the model on every local
  replica.
- `predict` and `read`: the two public functions.
"""
