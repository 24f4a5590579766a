"""Print the fastest accurate launch configuration per row count from a down_gemm_bench.py JSON,
as the CONFIGS dict literal gemm_triton takes (row tile -> config): rows 1-16 share the 16-row tile.

    python bench/engines/pick_config.py gate_up_gemm.json
"""

import json
import sys

rows = json.load(open(sys.argv[1]))["rows"]
tiles = {}
for row in rows:
    if "best_triton" in row:
        tile = max(16, 1 << (row["m"] - 1).bit_length())
        if row["m"] == tile or tile not in tiles:  # the tile's own row count decides
            tiles[tile] = tuple(int(v) for v in row["best_triton"].split("x"))
print(tiles)
