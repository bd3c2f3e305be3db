"""How much of a multi-GPU offload row's distance from its prediction is the profile's: each measured row priced
again, its realised policy unchanged, on every profile given. Runs on the CPU (the HRM is arithmetic).

    PYTHONPATH=. python3 scripts/probes/probe_reprice_offload_rows.py --rows REPORT.json ... --profiles P.json ...
        [--out FILE.json]

REPORT: ``hf-scatter bench offload --gpus`` reports (each row's policy, budgets, prefill chunk and group);
P: profiles, or reports that carry the profile they ran on.
"""
import argparse
import dataclasses
import json
import re

from hf_scatter.bench.offload_workload import prompts
from hf_scatter.common.shapes import builtin_config
from hf_scatter.offload import ModelSpec, Workload, load_profile
from hf_scatter.offload.plan.cost_model import CostOptions, predict
from hf_scatter.offload.plan.policy import Policy

POLICY_FIELDS = {f.name for f in dataclasses.fields(Policy)} - {"prediction"}


def reprice(report_path: str, profile_paths: list[str]) -> list[dict]:
    report = json.load(open(report_path))
    config = builtin_config(report["model"], num_hidden_layers=report["layers"])
    workload = Workload.from_prompts([len(r) for r in prompts(report["requests"], config.vocab_size)],
                                     report["new_tokens"])
    spec = ModelSpec.from_config(config)
    rows = []
    for row in report["by_gpus"]:
        policy = Policy(**{k: v for k, v in row["policy"].items() if k in POLICY_FIELDS})
        chunk, group = re.search(r"prefill chunk / group \(tokens\) \| (\d+) / (\d+)", row["policy_markdown"]).groups()
        options = CostOptions(prefill_chunk_tokens=int(chunk), prefill_group_tokens=int(group))
        priced = {}
        for path in profile_paths:
            prediction = predict(policy, spec, load_profile(path), workload, row["gpu_budget_per_gpu"],
                                 row["cpu_budget"], options)
            priced[path] = {"tokens_per_s": prediction.tokens_per_s,
                            "measured_over_predicted": row["tokens_per_s"] / prediction.tokens_per_s,
                            "bottleneck": prediction.decode_layer.bottleneck}
        rows.append({"report": report_path, "gpus": row["gpus"], "measured_tokens_per_s": row["tokens_per_s"],
                     "weights_gpu_fraction": policy.weights_gpu_fraction, "priced_on": priced})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", nargs="+", required=True)
    parser.add_argument("--profiles", nargs="+", required=True)
    parser.add_argument("--out")
    args = parser.parse_args()
    rows = [r for path in args.rows for r in reprice(path, args.profiles)]
    for r in rows:
        print(r["report"], r["gpus"], round(r["measured_tokens_per_s"]),
              {p: round(v["measured_over_predicted"], 2) for p, v in r["priced_on"].items()})
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"what": __doc__.split("\n\n")[0], "command": "scripts/probes/probe_reprice_offload_rows.py "
                       + " ".join(["--rows", *args.rows, "--profiles", *args.profiles]),
                       "profiles_cpu_attention_group": {p: load_profile(p).cpu_attention_group for p in args.profiles},
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
