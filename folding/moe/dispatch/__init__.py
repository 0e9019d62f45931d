"""Token dispatch: moving each token's copies to the ranks of their experts and back.

- :mod:`.build`: :func:`~folding.moe.dispatch.build.build_dispatcher`, the one way to make one.
- :mod:`.base`: argument checks, the per-call :class:`~folding.moe.dispatch.base.DispatchRecord`.
- :mod:`.alltoall`, :mod:`.allgather`, :mod:`.hierarchical`: the three dispatchers
  (:mod:`.hier_plan` and :mod:`.hier_exchange` are the hierarchical one's planning and exchanges).
- :mod:`.permute`: token movement as pure functions; :mod:`.wire`: wire formats and exchanges;
  :mod:`.host_sync`: the one instrumented device-to-host read.
"""

from .build import build_dispatcher, dispatcher_for

__all__ = ["build_dispatcher", "dispatcher_for"]
