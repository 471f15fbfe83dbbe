"""Training (layer 6): what a step minimises (``objective.Objective``; ``losses``,
``preference``, ``rl``, ``rewards``), the pure jitted step (``step``), its memory plan
(``plan``), the compilation cache (``compile_cache``) and the signed step store
(``step_store``), the loop (``loop``; ``signals``, ``host_rows`` around it), orbax checkpoints
(``checkpoint``), the run's log (``log``) and writes under --out (``files``)."""
