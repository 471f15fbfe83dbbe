"""A run end to end (layer 7): the one resolve of every run-time choice and refusal
(``resolve``), input checks (``checks``), the run directory (``run_dir``), the built-in default
model (``default_model``), a model and tokenizer from files (``loading``) and the session
that loads, trains and exports (``session``)."""
