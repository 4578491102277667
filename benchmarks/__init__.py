"""flexserve's benchmarks (see README.md); a package so scripts share `benchmarks.harness`."""
