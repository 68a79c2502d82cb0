"""A worker process of a multi-host engine, from the command line:

    python -m paxkv.parallel.worker --coordinator_address=H:P --num_processes=N --process_id=I

It joins the engine process 0 builds (`paxkv.parallel.multihost`) and serves it until
process 0's program exits.
"""
from __future__ import annotations

from typing import Any


def main(argv: Any = None) -> None:
    """`python -m paxkv.parallel.worker --coordinator_address=H:P --num_processes=N
    --process_id=I`: a worker process (I > 0) serving whatever engines process 0 builds."""
    import argparse
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--coordinator_address", required=True)
    parser.add_argument("--num_processes", type=int, required=True)
    parser.add_argument("--process_id", type=int, required=True)
    args = parser.parse_args(argv)
    if args.process_id == 0:
        raise ValueError("--process_id 0 is the driver: run the program itself there, with "
                         "LLM(..., distributed_process_id=0)")
    from paxkv import LLM
    LLM(distributed_coordinator_address=args.coordinator_address,
        distributed_num_processes=args.num_processes, distributed_process_id=args.process_id)


if __name__ == "__main__":
    main()
