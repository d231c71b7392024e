"""V-LoRA: one vision-language model serving many vision applications through LoRA adapters.

Shared pieces every stage uses: the command line (`vlora.cli`), the offline model zoo
(`vlora.zoo`) and the synthetic vision world (`vlora.world`).
"""

__version__ = "0.1.0"
