"""``python -m hf_scatter.eval ARGS``: lm-eval's own command line with the ``hf-scatter`` models registered.

An installed wheel makes the stock ``lm_eval`` command find ``--model hf-scatter`` (its startup hook,
``_hf_scatter_lm_eval``); an editable install has no hook, and lm-eval only knows models registered in the
running process, which is what this entry point does before handing over to ``lm-eval``:

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
