"""Training (layer 6): losses and methods (``losses``, ``preference``, ``rl``, ``rewards``),
the pure jitted step (``step``), its memory plan (``plan``), the compilation cache and step
store (``compile_cache``), the loop (``loop``), orbax checkpoints (``checkpoint``), the run's
log (``log``) and writes under --out (``files``)."""
