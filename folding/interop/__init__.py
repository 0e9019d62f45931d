"""Adapters to other frameworks. They wrap the engine from above; the engine imports none of them."""
