"""Repository tooling: benchmarks and the chaos harness (not installed; run from a checkout)."""
