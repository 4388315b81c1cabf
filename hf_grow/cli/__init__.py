"""The ``hf-grow`` command: load a language model, read text, grow it, write the grown model atomically.

``hf-grow MODEL ...`` grows (and optionally pushes to the Hub); ``hf-grow inspect MODEL ...`` reports what growth
would gain per layer and head, without growing. Causal LMs (GPT-2) grow on next-token loss; masked LMs (BERT) on
masked-LM loss with transformers' standard collator. Any other objective goes through the Python API's ``loss_fn``.

Launched with several processes (``torchrun --nproc_per_node N -m hf_grow ...`` or ``accelerate launch``;
``WORLD_SIZE`` > 1), every process reads the same text, takes every N-th batch, and the statistics and
held-out losses are summed across processes; only the main process writes and pushes.

The modules, in the order a run meets them: `parsers` (options and help), `checks` (arguments refused before any
work), `loading` (tokenizer, model, saved statistics), `text` (token windows, held-out split, batches), `running`
(progress, processes, atomic writes), `commands` (the commands and `main`); `pairs` is ``--pairs FILE``.
"""

from .checks import CommandError
from .commands import main, run, run_inspect
from .parsers import build_inspect_parser, build_parser


__all__ = ["CommandError", "build_inspect_parser", "build_parser", "main", "run", "run_inspect"]
