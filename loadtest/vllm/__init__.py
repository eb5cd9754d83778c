"""vLLM itself (its CPU build) with a tiny random-weight model: for tests, benchmarks and a try."""
