"""From a command line to a finished run: the entry point's command-line checks, the dry run, the
run directory, process-group start-up and the hand-over to the training loop.

- :mod:`.cli`: the command line, checked before Hydra starts (Megatron-LM flags are explained with
  the overrides that say the same, through :mod:`folding.interop.megatron`).
- :mod:`.run`: a composed config to a finished run (:func:`~folding.launch.run.run_job`).
- :mod:`.dry_run`: ``train.dry_run=true``, what each rank would hold.
- :mod:`.model_from_hf`: ``model=from_hf``, the architecture read from the initial weights.
- :mod:`.run_dir`, :mod:`.threads`: the run's directory and the CPU threads per process.

This package sits on top of the engine: nothing in ``folding`` imports it.
"""
