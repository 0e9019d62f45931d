"""Hiding MoE communication behind compute: the two lanes of an overlap pair, deferred work, the
exchange record and the weight-gradient split (``parallel.overlap_moe_comm``, ``parallel.delay_wgrad``).

A ground-floor package: it imports nothing of ``folding`` (``parallel``, ``moe`` and the layers above
import it).

- :mod:`.lanes`: the baton and the helper thread that runs a pair's second lane.
- :mod:`.exchange`: the exchange record every token exchange is waited on through, and deferred work.
- :mod:`.wgrad`: dense weight gradients computed behind the backward's next exchange.
"""
