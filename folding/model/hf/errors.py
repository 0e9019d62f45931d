"""The error of the Hugging Face conversion (shared by the config mappings and the weight loader).

Usage::

    raise CheckpointError("config.json model_type='llama' is not supported; supported: [...]")
"""


class CheckpointError(ValueError):
    """A checkpoint that the engine cannot load as asked (architecture, files, names or shapes)."""
