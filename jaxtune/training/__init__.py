"""Training (layer 5): losses and methods (``losses``, ``preference``, ``rl``, ``rewards``),
the pure jitted step (``step``), its memory plan and the step store (``plan``), the loop
(``loop``), orbax checkpoints (``checkpoint``) and the run's log (``log``)."""
