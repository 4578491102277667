"""The worker's fine-tuning: runner, activation store, layer-wise backward, window loss."""
