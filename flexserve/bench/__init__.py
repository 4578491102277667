"""The benchmark client behind `flexserve bench serve`: workloads, the HTTP driver, metrics."""
