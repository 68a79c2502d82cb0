"""Files shipped inside the package: the embedded tiny model (a Hugging Face directory)."""
from __future__ import annotations

import os

_HERE = os.path.dirname(os.path.abspath(__file__))


def tiny_model_dir() -> str | None:
    """Path of the shipped tiny checkpoint, or None while it has not been trained yet."""
    path = os.path.join(_HERE, "tiny")
    return path if os.path.exists(os.path.join(path, "config.json")) else None
