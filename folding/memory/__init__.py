"""What a forward keeps for backward, and where: tensors discarded and refilled (recompute without a
checkpoint), tensors moved to host memory (activation offloading)."""
