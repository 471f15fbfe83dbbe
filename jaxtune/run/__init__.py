"""A run end to end (layer 7): the one resolve of every run-time choice and refusal
(``resolve``, its per-concern choices in ``choices``), input checks (``checks``), the run
directory (``run_dir``), the built-in default model (``default_model``), a model and tokenizer
from files (``loading``), the session that loads, trains and exports (``session``), what it
says (``report``), and ``jaxtune.train`` from Python (``api``)."""
