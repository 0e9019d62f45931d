"""Routing: which experts each token goes to, with what weight, and the balancing terms.

- :mod:`.functions`: the math as pure functions (top-k, capacity, load-balancing losses, expert bias).
- :mod:`.router`: :class:`~folding.moe.routing.router.Router`, the module with the gate weight.
- :mod:`.balancing`: what a training step reads from and updates on the routers of a model.
"""
