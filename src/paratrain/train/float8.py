"""--dtype fp8: torchao's float8 training linears (dynamic tensorwise scaling) in place of nn.Linear.

Applied right after the model is built and before parallelize() (torchtitan's order), so FSDP and compile see
the float8 modules. The output head stays bf16 (the logits are the most precision-sensitive matmul) and so does
any linear whose sizes are not multiples of 16 (the FP8 GEMM needs them). The rest of the step runs under bf16
autocast, as --dtype bf16 does. Runs only where train/precision.check_fp8 allowed it.
"""

from __future__ import annotations

import logging

from torch import nn

log = logging.getLogger("paratrain")


def float8_eligible(module: nn.Module, fqn: str) -> bool:
    if fqn.split(".")[-1] == "output":
        return False
    if isinstance(module, nn.Linear):
        return module.in_features % 16 == 0 and module.out_features % 16 == 0
    return True


def convert_to_float8(model: nn.Module) -> nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name("tensorwise")
    model = convert_to_float8_training(model, config=config, module_filter_fn=float8_eligible)
    converted = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    log.info("fp8: %d linear layers converted to torchao Float8Linear (tensorwise scaling); the head stays bf16",
             converted)
    return model
