"""Peak host memory of `load_checkpoint` on a large sharded bfloat16 checkpoint.

Writes a random bf16 Llama checkpoint (Llama-3-8B layer shapes, fewer layers, a 32k vocab;
about 2.3 GB by default) with the `safetensors` library, sharded with an index file as HF
does, then loads it with `paxkv.model.weights.load_checkpoint` in a fresh subprocess and
reports that process's peak resident set (ru_maxrss) against the checkpoint's bf16 size.
On CPU the loaded parameters themselves live in host memory, so the floor is about 1x the
checkpoint plus the interpreter; a loader that held an fp32 copy of the model would need 3x.

    PYTHONPATH=. python3 scripts/measure_load_memory.py [--layers 4] [--out results/load_memory.md]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def random_bf16(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Finite random bf16 values of magnitude in [2^-7, 2^-6), random sign: fast to make."""
    import ml_dtypes
    bits = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    bits = (bits & np.uint16(0x807F)) | np.uint16(0x3C00)
    return bits.view(ml_dtypes.bfloat16)


def write_checkpoint(path: str, layers: int, shard_bytes: int, seed: int = 0) -> int:
    """Write config.json + sharded model-*.safetensors + index; returns total tensor bytes."""
    import jax.numpy as jnp
    from safetensors.flax import save_file
    from tqdm import tqdm

    from paxkv.config import ModelConfig
    from paxkv.model.weights import hf_config_dict, tensor_specs

    cfg = ModelConfig(vocab_size=32000, hidden_size=4096, intermediate_size=14336,
                      num_layers=layers, num_heads=32, num_kv_heads=8, head_dim=128,
                      rope_theta=500000.0, bos_token_id=1, eos_token_ids=(2,))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config_dict(cfg, "bfloat16"), f, indent=2)
    specs = tensor_specs(cfg)
    shards: list[list] = [[]]
    size = 0
    for spec in specs:
        nbytes = int(np.prod(spec.hf_shape)) * 2
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += nbytes
    rng = np.random.default_rng(seed)
    weight_map, total = {}, 0
    with tqdm(total=len(specs), desc="writing checkpoint") as bar:
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            tensors = {}
            for spec in shard:
                tensors[spec.hf_name] = jnp.asarray(random_bf16(rng, spec.hf_shape))
                weight_map[spec.hf_name] = fname
                total += tensors[spec.hf_name].nbytes
                bar.update(1)
            save_file(tensors, os.path.join(path, fname), metadata={"format": "pt"})
            del tensors
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return total


def _vm_hwm() -> int | None:
    """This process's own RSS high-water mark (bytes) from /proc, where available."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def measure_in_this_process(path: str) -> dict:
    """Run by the subprocess: load and report peak RSS before and after (bytes)."""
    import resource

    import jax

    from paxkv.model.weights import load_checkpoint
    # Initialise the backend and run one small computation before taking the baseline: the
    # runtime's one-time host allocations (on GPU: libraries, kernels) are not the loader's.
    jax.jit(lambda x: x + 1)(jax.numpy.zeros((8,), jax.numpy.bfloat16)).block_until_ready()
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    base_hwm = _vm_hwm()
    t0 = time.perf_counter()
    params, cfg = load_checkpoint(path, dtype="bfloat16", progress=False)
    jax.block_until_ready(params)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    param_bytes = sum(x.nbytes for x in jax.tree_util.tree_leaves(params))
    return {"baseline_rss": base, "peak_rss": peak, "baseline_hwm": base_hwm,
            "peak_hwm": _vm_hwm(), "param_bytes": param_bytes, "load_seconds": seconds,
            "platform": jax.default_backend(), "device": jax.devices()[0].device_kind,
            "jax": jax.__version__}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--shard-mb", type=int, default=500)
    parser.add_argument("--out", default=None, help="markdown file for the result")
    parser.add_argument("--platform", default="cpu",
                        help="JAX_PLATFORMS for the loading process (cpu, cuda), or 'auto'")
    parser.add_argument("--_measure", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--_write", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._measure:
        print("RESULT " + json.dumps(measure_in_this_process(args._measure)))
        return
    if args._write:
        print("TOTAL", write_checkpoint(args._write, args.layers, args.shard_mb << 20))
        return

    # Both the writer and the loader run as children of this small process: Linux carries a
    # parent's RSS high-water mark into a forked child's ru_maxrss, so the parent must stay
    # light for the child's figure to be its own.
    env = dict(os.environ, JAX_PLATFORMS="cpu")  # the writer: host numpy only
    me = os.path.abspath(__file__)
    with tempfile.TemporaryDirectory(prefix="paxkv-load-mem-") as tmp:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, me, "--_write", tmp, "--layers", str(args.layers),
                               "--shard-mb", str(args.shard_mb)], env=env, stdout=subprocess.PIPE,
                              text=True)
        if proc.returncode != 0:
            raise SystemExit(proc.returncode)
        total = int(next(l for l in proc.stdout.splitlines() if l.startswith("TOTAL")).split()[1])
        write_s = time.perf_counter() - t0
        shards = sum(f.endswith(".safetensors") for f in os.listdir(tmp))
        if args.platform == "auto":
            env.pop("JAX_PLATFORMS")
        else:
            env["JAX_PLATFORMS"] = args.platform
        proc = subprocess.run([sys.executable, me, "--_measure", tmp],
                              env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            sys.stderr.write(proc.stderr)
            raise SystemExit(proc.returncode)
    line = next(l for l in proc.stdout.splitlines() if l.startswith("RESULT "))
    r = json.loads(line[len("RESULT "):])
    gib = 1 << 30
    rows = [
        ("checkpoint (bf16 tensors)", f"{total / gib:.2f} GiB in {shards} shards"),
        ("loaded parameters", f"{r['param_bytes'] / gib:.2f} GiB (on {r['device']})"),
        ("peak RSS before loading (JAX initialised, one op run)", f"{r['baseline_rss'] / gib:.2f} GiB"),
        ("peak RSS of the loading process", f"{r['peak_rss'] / gib:.2f} GiB"),
        ("peak RSS / checkpoint size", f"{r['peak_rss'] / total:.2f}x"),
        ("(peak - baseline) / checkpoint size", f"{(r['peak_rss'] - r['baseline_rss']) / total:.2f}x"),
    ]
    if r["peak_hwm"] is not None:
        rows.append(("peak VmHWM (/proc, cross-check) / checkpoint size",
                     f"{r['peak_hwm'] / total:.2f}x"))
    rows += [
        ("load time", f"{r['load_seconds']:.1f} s (write: {write_s:.1f} s)"),
    ]
    table = "| what | figure |\n| --- | --- |\n" + "\n".join(f"| {a} | {b} |" for a, b in rows)
    print(table)
    if args.out:
        cmd = "PYTHONPATH=. python3 scripts/measure_load_memory.py"
        if args.layers != 4:
            cmd += f" --layers {args.layers}"
        if args.platform != "cpu":
            cmd += f" --platform {args.platform}"
        cmd += f" --out {args.out}"
        with open(args.out, "w") as f:
            f.write(f"""# Host memory of checkpoint loading

`load_checkpoint` streams a Hugging Face checkpoint tensor by tensor (read into a fresh host
buffer, put on the device, transposed and cast there, buffer released), so it never holds a
second copy of the model, let alone a float32 one.

Checkpoint: random bf16 weights with Llama-3-8B layer shapes (hidden 4096, intermediate
14336, 32 query / 8 KV heads of 128), {args.layers} layers, vocabulary 32000, untied head,
written with the `safetensors` library as {shards} shards plus `model.safetensors.index.json`.
Loaded with `dtype="bfloat16"` in a fresh process; peak resident set from
`resource.getrusage(RUSAGE_SELF).ru_maxrss`.

Command: `{cmd}`

Machine: {_cpu_name()} ({os.cpu_count()} cores), weights loaded onto {r['device']}
({r['platform']} backend), JAX {r['jax']}, Python {platform.python_version()}.

{table}

On the CPU backend the parameters are themselves host memory, so about 1x the checkpoint
plus the interpreter and JAX runtime is the floor; the rest is a few copies of one tensor in
flight (read buffer, device copy, transposed copy; the largest tensors here, the embedding
and the LM head, are {32000 * 4096 * 2 / (1 << 20):.0f} MiB each). With an accelerator the
parameters leave host memory as they are loaded.
""")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
