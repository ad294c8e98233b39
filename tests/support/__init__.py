"""Support shared by the tests and the benchmarks (never imported by the product)."""
