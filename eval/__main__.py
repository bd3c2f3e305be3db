"""``python -m hf_scatter.eval ARGS``: lm-eval's own command line with the ``hf-scatter`` models registered.

The stock ``lm_eval`` command finds ``--model hf-scatter`` through hf-scatter's startup hook
(``_hf_scatter_lm_eval``, installed by the wheel and by ``pip install -e``); this entry point registers the
models in the running process itself, for an interpreter that skips site hooks (``python -S``, some
embedded or frozen environments):

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
