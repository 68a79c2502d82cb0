"""What every experiment shares: the paper's figures and the writers of json, png and markdown.

Each experiment writes three files under `--out_dir` (default `results/`):
`<name>.json` (settings, figures, the command and hardware that produced them),
`<name>.png` (the plot) and `<name>.md` (our figures beside the paper's, as a table).
"""
from __future__ import annotations

import json
import math
import os
import platform
import shlex
import sys
from typing import Any, Iterable, Sequence

import matplotlib

matplotlib.use("Agg")  # files only, never a window
import matplotlib.pyplot as plt  # noqa: E402

# Figures published in the PagedAttention paper (Kwon et al., SOSP 2023) that the
# experiments are measured against. Ranges are (low, high).
PAPER: dict[str, Any] = {
    "citation": "Kwon et al., Efficient Memory Management for Large Language Model Serving "
                "with PagedAttention, SOSP 2023",
    "workloads": {
        "sharegpt": {"input_mean": 161, "output_mean": 338},
        "alpaca": {"input_mean": 19, "output_mean": 58},
    },
    # Fig. 2: share of the KV memory holding actual token states, serving OPT-13B on an
    # A100-40GB. The three existing-system variants (Orca with max / power-of-two / oracle
    # reservation) span 20.4%-38.2%; vLLM wastes under 4%.
    "kv_utilization": {
        "existing_systems_range": (0.204, 0.382),
        "existing_worst_max_reservation": 0.204,
        "existing_best_oracle_reservation": 0.382,
        "vllm": 0.96,
    },
    # Fig. 1: 13B model on an A100-40GB: parameters 26 GB (65%), KV cache over 30%.
    "memory_layout": {
        "model": "OPT-13B", "gpu": "A100-40GB", "weights_gb": 26.0, "weights_share": 0.65,
        "kv_share_min": 0.30, "kv_bytes_per_token": 800 * 1024,
    },
    "block_size_best": {"sharegpt": (16, 128), "alpaca": (16, 32), "default": 16},
    "sharing_savings": {"parallel_sampling": (0.061, 0.098), "beam_search": (0.376, 0.552)},
    "throughput_gain_vs_orca_ft": (2.0, 4.0),
    "kernel_slowdown_vs_contiguous": (0.20, 0.26),
    "recompute_max_overhead_vs_swap": 0.20,
    # Fig. 13 (§6.2): OPT-13B batches 2.2x the requests of Orca (Oracle) and 4.3x those of
    # Orca (Max) on ShareGPT at 2 requests/s; the bars are also drawn for Alpaca at 30/s.
    "batched_requests": {"sharegpt_rate": 2.0, "alpaca_rate": 30.0,
                         "sharegpt_vs_orca_oracle": 2.2, "sharegpt_vs_orca_max": 4.3},
    # Fig. 14 (§6.3): on Alpaca, vLLM's gain over Orca (Oracle) grows with the number of
    # sequences, from 1.3x in basic sampling to 2.3x in beam search of width 6.
    "sampling_gain_vs_orca_oracle": {"basic": 1.3, "beam_6": 2.3},
    # Fig. 16 (§6.4): LLaMA-13B translating WMT16 En-De with a shared few-shot prefix: 1.67x
    # the throughput of Orca (Oracle) with the 1-shot prefix (80 tokens), 3.58x with 5-shot (341).
    "shared_prefix": {"prefix_tokens": {"1-shot": 80, "5-shot": 341},
                      "gain_vs_orca_oracle": {"1-shot": 1.67, "5-shot": 3.58}},
    # Fig. 17 (§6.5): chatbot (ShareGPT conversations, the last 1,024 tokens as the prompt,
    # OPT-13B): vLLM sustains 2x the request rate of the three Orca baselines.
    "chatbot_gain_vs_orca": 2.0,
}


# Environment variables that change what an experiment measures; recorded in its command.
_RECORDED_ENV = ("XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_PREALLOCATE", "XLA_FLAGS")


def define_serving_flags() -> None:
    """The flags every serving experiment takes: which settings, where to write, time budget."""
    from absl import flags
    flags.DEFINE_enum("setting", "cpu", ["cpu", "gpu", "tiny"],
                      "Which settings of configs/experiments.py to use.")
    flags.DEFINE_string("out_dir", "scratch/results", "Where to write NAME.json/.png/.md (gpu setting: NAME_gpu.*) (--out_dir=results updates the committed results)")
    flags.DEFINE_float("time_budget_s", None,
                       "Override the settings' time budget (seconds; <= 0: none).")
    flags.DEFINE_string("resume_from", None,
                        "A json this experiment wrote before at the same setting (a partial sweep): its "
                        "points are kept and not run again, the rest are run, and the extended json is "
                        "written to --out_dir. A missing file means nothing to resume.")
    flags.DEFINE_string("resume_measured_since", None,
                        "With --resume_from: keep only the points measured at or after this UTC time "
                        "(YYYY-MM-DDTHH:MM:SSZ, as the json's measured_at), so that points from an "
                        "older engine are measured again; points without a time are measured again too.")
    define_parallel_flags()


def define_parallel_flags() -> None:
    """Tensor parallelism and multi-host: `parallel_llm_kwargs()` maps them to LLM arguments.

    On several hosts every process runs the experiment with the same flags but its own
    `--distributed_process_id`; process 0 runs it and writes the results, the others serve
    its engines' steps and exit with it.
    """
    from absl import flags
    flags.DEFINE_integer("tensor_parallel_size", 1, "Devices (of all processes) the weights and "
                         "KV heads are split over.")
    flags.DEFINE_string("distributed_coordinator_address", None,
                        "host:port of process 0, to run one engine over several processes.")
    flags.DEFINE_integer("distributed_num_processes", None, "Processes of a multi-host run.")
    flags.DEFINE_integer("distributed_process_id", None, "This process's index (0 = driver).")


def parallel_llm_kwargs() -> dict[str, Any]:
    """The parallel flags' values as LLM keyword arguments ({} where they are not defined)."""
    from absl import flags
    from paxkv.parallel.multihost import llm_kwargs
    f = flags.FLAGS
    if "tensor_parallel_size" not in f:
        return {}
    return llm_kwargs(f.distributed_coordinator_address, f.distributed_num_processes,
                      f.distributed_process_id, f.tensor_parallel_size)


def command_line(argv: Sequence[str] | None = None) -> str:
    """The command that reproduces this run, relative to the repository root."""
    argv = list(sys.argv if argv is None else argv)
    script = argv[0] if argv else "?"
    here = os.path.abspath(script)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if here.startswith(root + os.sep):
        script = os.path.relpath(here, root)
    env = [f"{k}={shlex.quote(os.environ[k])}" for k in _RECORDED_ENV if os.environ.get(k)]
    return " ".join([*env, "PYTHONPATH=. python3"] + [shlex.quote(a) for a in [script, *argv[1:]]])


def host_hardware(what: str = "host code only") -> str:
    """A one-line description of the machine for host-only (simulated) experiments."""
    return (f"{what}, on a CPU ({platform.machine()}, {os.cpu_count()} cores, "
            f"Python {platform.python_version()}), no accelerator")


def device_hardware() -> str:
    """The accelerator and JAX version, for experiments that run the model."""
    import jax  # local import: host-only experiments never load JAX
    dev = jax.devices()[0]
    return f"{dev.device_kind} ({dev.platform}), JAX {jax.__version__}"


def jsonable(x: Any) -> Any:
    """`x` with tuples as lists, numpy scalars as numbers and non-finite floats as strings."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if hasattr(x, "item") and callable(x.item):  # numpy scalars
        return x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return x


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """A GitHub markdown table; cells are printed with str()."""
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    for r in rows:
        if len(r) != len(header):
            raise ValueError(f"row has {len(r)} cells for {len(header)} columns: {r}")
        lines.append("| " + " | ".join(str(c) for c in r) + " |")
    return "\n".join(lines)


def pct(x: float, digits: int = 1) -> str:
    return f"{100.0 * x:.{digits}f}%"


def write_results(name: str, out_dir: str, *, title: str, command: str, hardware: str,
                  settings: dict[str, Any], results: dict[str, Any], table: str,
                  notes: str = "", figure: "plt.Figure | None" = None) -> dict[str, str]:
    """Write `<name>.json`, `<name>.md` and (when given a figure) `<name>.png`; return their paths."""
    os.makedirs(out_dir, exist_ok=True)
    paths = {"json": os.path.join(out_dir, f"{name}.json"),
             "md": os.path.join(out_dir, f"{name}.md")}
    payload = {"name": name, "title": title, "command": command, "hardware": hardware,
               "settings": settings, "results": results}
    with open(paths["json"], "w") as f:
        json.dump(jsonable(payload), f, indent=1, sort_keys=False)
        f.write("\n")
    md = [f"# {title}", "", f"Command: `{command}`", "", f"Hardware: {hardware}", ""]
    if figure is not None:
        paths["png"] = os.path.join(out_dir, f"{name}.png")
        figure.savefig(paths["png"], dpi=120, bbox_inches="tight")
        plt.close(figure)
        md += [f"![{title}]({name}.png)", ""]
    md += [table, ""]
    if notes:
        md += [notes.strip(), ""]
    with open(paths["md"], "w") as f:
        f.write("\n".join(md))
    return paths
