"""The `flexserve` command line: serve, profile, bench, finetune-plan."""
