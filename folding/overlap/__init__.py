"""Hiding MoE communication behind compute (``parallel.overlap_moe_comm``, ``parallel.delay_wgrad``).

The ground floor of the package: it imports nothing of ``folding`` (``parallel``, ``moe``, the model
and the schedules import it), and it keeps no state at module level: everything lives on one
:class:`~folding.overlap.runtime.OverlapRuntime` per schedule.

- :mod:`.lanes`: the baton of a pair's two lanes and the helper thread that runs the second one.
- :mod:`.deferred`: work a lane defers to its next exchange wait, and its flush.
- :mod:`.exchange`: the exchange record every token exchange is waited on through (its works, what it
  carries, whether it is an overlap point) and the observers instruments subscribe with.
- :mod:`.wgrad`: dense weight gradients computed behind the backward's next exchange.
- :mod:`.backward_turn`: the backward lane's own hand-over, where a marked tensor's gradient is ready
  (the turn that matches the forward's hand-over at the count read).
- :mod:`.runtime`: :class:`~folding.overlap.runtime.OverlapRuntime`, which holds the state of all of
  the above, and how code reaches it (the current runtime of a schedule, kept by autograd functions
  for their backward).
"""
