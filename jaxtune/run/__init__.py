"""A run end to end (layer 6): input checks (``checks``), the run directory (``run_dir``),
the built-in default model (``default_model``) and the session that loads, trains and
exports (``session``)."""
