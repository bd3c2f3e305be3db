"""The tile table's kernel (``scatter2scatter.expert_tiles``: each program's expert and first row) by how many
table entries one program writes and its warps, at 128-row tiles for Qwen3-30B-A3B (E 128), the fine-grained
shape (E 64) and GPT-OSS-20B (E 32) at training size, and E 128 at 512 rows; CUDA-graph replays (launch
included), each checked against the torch form.

Run on the GPU: PYTHONPATH=. python3 scripts/probes/probe_expert_tiles_width.py   (writes $OUT/expert_tiles_width.json)
"""
import os

import torch

from hf_scatter.common.timing import graph_replay_ms, run_header
from hf_scatter.kernels import scatter2scatter as s2s
from hf_scatter.kernels.backend import cdiv, next_power_of_2
from hf_scatter.common.atomic_files import write_json


def main():
    report = {**run_header(), "what": __doc__, "shapes": {}}
    for E, M in ((128, 131072), (64, 131072), (32, 65536), (128, 512)):
        ends = torch.linspace(M / E, M, E, device="cuda").round().to(torch.int64)  # [E] cumulative row ends
        programs = s2s.num_tile_programs(M, E, 128)
        tile_expert = torch.empty(programs, dtype=torch.int32, device="cuda")
        tile_row = torch.empty_like(tile_expert)
        want = s2s.expert_tiles_reference(ends, 128, M)
        row = {}
        for per_program in (16, 32, 64, 128):
            for warps in (1, 2, 4):
                def run():
                    s2s._expert_tiles_kernel[(cdiv(programs, per_program),)](
                        ends, tile_expert, tile_row, E, programs, BLOCK_M=128, BLOCK_E=max(16, next_power_of_2(E)),
                        BLOCK_P=per_program, num_warps=warps)
                run()
                torch.cuda.synchronize()
                equal = bool(torch.equal(tile_expert, want[0]) and torch.equal(tile_row, want[1]))
                row[f"entries{per_program}_warps{warps}"] = {"us": graph_replay_ms(run, 200) * 1e3, "equal": equal}
        report["shapes"][f"E{E}_rows{M}"] = row
        print(E, M, {key: round(v["us"], 1) for key, v in row.items()}, flush=True)
    write_json(os.path.join(os.environ.get("OUT", "."), "expert_tiles_width.json"), report)


if __name__ == "__main__":
    main()
