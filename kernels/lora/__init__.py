"""LoRA kernels: serving (serve/) and fused training (train/)."""
