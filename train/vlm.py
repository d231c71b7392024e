"""`VisionLM`: one loaded base model with its LoRA slot, processor, encoder cache and accelerator.

It lives as long as the process trains: every adapter trained in it (one `vlora train`, or the
many trainings of a fusion) swaps its LoRA weights in and out of the same PEFT model, and the
vision tower's cached outputs are shared by all of them (the tower is frozen, so a feature
does not depend on the adapter).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .data import Encoder
from .model import LoraSpec, ModelRef, arch_of, enable_checkpointing, frozen_linears_to, load_base, wrap_lora

MIXED_PRECISION = ("no", "bf16", "fp16")


class VisionLM:
    def __init__(self, ref: ModelRef, lora: LoraSpec, train_vision_tower: bool = False,
                 mixed_precision: str = "no", device: str | None = None, seed: int = 0,
                 gradient_checkpointing: bool = False):
        from accelerate import Accelerator

        if mixed_precision not in MIXED_PRECISION:
            raise ValueError(f"mixed_precision={mixed_precision!r}: must be one of {list(MIXED_PRECISION)}")
        cpu = device == "cpu" or (device is None and not torch.cuda.is_available())
        self.accelerator = Accelerator(cpu=cpu, mixed_precision=mixed_precision)
        self.ref, self.lora, self.train_vision_tower, self.seed = ref, lora, train_vision_tower, seed
        base, self.processor = load_base(ref, device=self.accelerator.device)
        self.arch = arch_of(base)
        self.model = wrap_lora(base, lora, train_vision_tower, seed)
        if mixed_precision != "no":  # the frozen projections in the dtype autocast would cast them to
            frozen_linears_to(self.model, torch.bfloat16 if mixed_precision == "bf16" else torch.float16)
        if gradient_checkpointing:  # activations recomputed in backward: less memory at full size
            enable_checkpointing(self.model)
        self.hidden_size = int(base.config.get_text_config().hidden_size)
        # Features are only cacheable while the tower is frozen.
        self.encoder = Encoder(self.model, self.processor, cache_visual=not train_vision_tower)

    @property
    def device(self) -> torch.device:
        return self.accelerator.device

    def lora_parameters(self) -> list[torch.nn.Parameter]:
        return [p for n, p in self.model.named_parameters() if "lora_" in n]

    def lora_state(self) -> dict[str, Tensor]:
        """The LoRA weights as CPU copies, keyed as PEFT saves them (no adapter name)."""
        from peft import get_peft_model_state_dict

        return {k: v.detach().to("cpu", copy=True) for k, v in get_peft_model_state_dict(self.model).items()}

    def load_lora_state(self, state: dict[str, Tensor]) -> None:
        from peft import set_peft_model_state_dict

        expected = set(get_keys(self.model))
        missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
        if missing or unexpected:
            raise ValueError(f"LoRA weights do not fit this model's LoRA ({self.lora.rank=}, targets "
                             f"{self.lora.target_modules}): missing {missing[:4]}, unexpected {unexpected[:4]}")
        set_peft_model_state_dict(self.model, state)

    def reset_lora(self, seed: int) -> None:
        """A fresh LoRA (A random with `seed`, B = 0) in place of the current one."""
        from peft.tuners.lora import LoraLayer

        torch.manual_seed(seed)
        for module in self.model.modules():
            if isinstance(module, LoraLayer):
                module.reset_lora_parameters("default", True)


def get_keys(model: torch.nn.Module) -> list[str]:
    from peft import get_peft_model_state_dict

    return list(get_peft_model_state_dict(model))
