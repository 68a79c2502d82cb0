"""Experiment, model and engine settings, as Python modules (importable with PYTHONPATH=.)."""
