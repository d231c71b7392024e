"""V-LoRA: one vision-language model serving many vision applications through LoRA adapters.

This package is the top floor: the `vlora` command (`vlora.cli`), its Hydra plumbing
(`vlora.config`) and one module per subcommand (`vlora.commands`). Everything it drives lives
in the packages below it (README, Layout).
"""

__version__ = "0.1.0"
