"""The engine: pure Python (no torch import). Requests, scheduler, KV block manager, core loop."""
