"""Command-line programs: benchmarks, training and data preparation (run as files)."""
