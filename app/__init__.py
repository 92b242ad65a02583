"""The `tfdp-train` application, above the library.

- `train`: the command line (absl flags) and its `main`, thin;
- `run_config`: `RunConfig`, the validated options of one run, one field per flag;
- `experiment`: `train_and_evaluate(config, ...)`, the sequence of one run.

This package may import `tfdp.pipelines` and `tfdp.models`; the library
(`tfdp/`) never imports it.
"""
