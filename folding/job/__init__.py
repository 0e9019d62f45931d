"""What a training job is: its typed configuration (``parallel.*``, ``train.*``, ``logging.*``,
``checkpoint.*`` around the model, MoE, optimizer and data sections), the Hydra schema derived from
it, the cross-section checks run before any process group exists, and the machine it runs on.

- :mod:`.config`: the dataclasses and :func:`~folding.job.config.job_config_from_dict`.
- :mod:`.schema`: Hydra's structured-config schema, derived from the dataclasses.
- :mod:`.compose`: Hydra's composition of ``configs/`` as a plain dict.
- :mod:`.validate`: the checks that span sections.
- :mod:`.machine`: the training device and the experts' backend on it, decided once.
"""
