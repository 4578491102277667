"""RMSNorm, rotary embedding, and rotary fused with the KV-cache write."""
