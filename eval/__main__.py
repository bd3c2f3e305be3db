"""``python -m hf_scatter.eval ARGS``: lm-eval's own command line with the ``hf-scatter`` models registered.

lm-eval releases that discover models through entry points find ``--model hf-scatter`` by themselves
(``pip install hf-scatter`` declares it); released lm-eval up to 0.4.13 only knows models registered in
the running process, which is what this entry point does before handing over to ``lm-eval``:

    python -m hf_scatter.eval run --model hf-scatter --model_args pretrained=DIR,dtype=bfloat16 \\
        --tasks hfs_all --include_path "$(python -c 'import hf_scatter.eval as e; print(e.TASKS_DIR)')"
"""

from __future__ import annotations

import sys

from . import MIN_LM_EVAL, register_with_lm_eval


def main() -> int:
    if not register_with_lm_eval():
        print(f"python -m hf_scatter.eval: needs lm-eval >= {MIN_LM_EVAL}: pip install 'hf-scatter[eval]'",
              file=sys.stderr)
        return 2
    from lm_eval.__main__ import cli_evaluate

    sys.argv[0] = "lm-eval"
    cli_evaluate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
