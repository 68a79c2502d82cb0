"""The MoE grouped matmul: rows sorted by expert, each run times its expert's matrix, reading
only the experts that own rows (`grouped_matmul.py`)."""
from pallas_kernels.grouped_matmul.grouped_matmul import (grouped_matmul,
                                                          grouped_matmul_reference, tile_list)

__all__ = ["grouped_matmul", "grouped_matmul_reference", "tile_list"]
