"""Command-line programs: benchmarks, training and data preparation (run as files; index in
README.md), and one-off probes in probes/."""
