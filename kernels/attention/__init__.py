"""Attention kernels: paged prefill, split-K decode, the paged KV-cache write."""
