"""Multi-LoRA serving: SGMV/BGMV shrink and expand, fused and folded decode forms, the CUDA BGMV extension."""
