"""LoRAFusion's fused LoRA linear for training: forward, backward, dropout, references."""
