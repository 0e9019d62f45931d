"""folding: a PyTorch training engine for Mixture-of-Experts models with MoE Parallel Folding."""

__version__ = "0.1.0"
