"""The transformer example under ``LightningCLI``, with ResourceGuard added from a YAML config::

    python examples/lightning_cli.py fit --config configs/lightning_cli.yaml

``configs/lightning_cli.yaml`` adds the callback under ``trainer.callbacks`` (``class_path`` +
``init_args``); any of its arguments can be overridden on the command line, e.g.
``--trainer.callbacks.init_args.memory_limit=32MiB``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from lightning.pytorch.cli import LightningCLI

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling example module

from lightning_transformer import TokenData, TransformerLM  # noqa: E402


def main() -> LightningCLI:
    return LightningCLI(TransformerLM, TokenData)


if __name__ == "__main__":
    main()
