"""Checkpoints: saving (synchronous or asynchronous), loading into any layout, and starting from
Hugging Face weights.

- :mod:`.save`: the temporary directory, the tensors, the metadata, atomic publication, pruning.
- :mod:`.async_save`: training goes on while ``torch.distributed.checkpoint`` writes.
- :mod:`.load`: finding the checkpoint to resume, checking it against the job, resharding on load.
- :mod:`.blocks`: every tensor as blocks of its full (1-rank) tensor, the form DCP reads.
- :mod:`.from_hf`: ``checkpoint.init_from_hf``, Hugging Face weights sharded on load.

Usage::

    from folding.checkpoint import save_checkpoint, load_checkpoint, latest_complete
"""

from .load import latest_complete, load_checkpoint, load_full_model, resolve_resume
from .save import save_checkpoint

__all__ = ["latest_complete", "load_checkpoint", "load_full_model", "resolve_resume", "save_checkpoint"]
